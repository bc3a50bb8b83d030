//! `flashover bench units`: a plan's fully sharded parameters gathered one parameter at a time
//! (where the forward reads them) against a unit at a time with the next unit prefetched
//! (`Parallelized::forward`), side by side in one run: the job's reference transformer under
//! `fully_shard("")` at each `fsdp` degree, the two ways alternating round by round on the
//! same ranks, model and batches.

use crate::train::{TrainConfig, make_batch, token_source};
use burn::optim::GradientsParams;
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::{ParallelizePlan, parallelize, transformer};
use flashover_runtime::{Axis, Launch, OpKind};
use serde::Serialize;
use std::time::Instant;

/// One (fsdp, way of gathering) measurement.
#[derive(Debug, Clone, Serialize)]
pub struct UnitsBenchRecord {
    /// Ranks the parameters are sharded over.
    pub fsdp: usize,
    /// `per read` or `units`.
    pub gathers: &'static str,
    /// Median time of a step (forward, backward, gradient reduction) over the rounds, on rank 0.
    pub step_s: f64,
    /// Tokens per second of the whole batch at that time.
    pub tokens_per_s: f64,
    /// All-gathers over `fsdp` per step.
    pub all_gathers: u64,
    /// Reduce-scatters over `fsdp` per step.
    pub reduce_scatters: u64,
    /// Of the all-gathers, those submitted ahead of their unit (0 per read).
    pub prefetches: usize,
}

/// Runs `config`'s model and batch at each degree of `fsdps` for `rounds` rounds of `steps`
/// steps each way (the first round warms up and is not counted).
pub fn run(
    config: &TrainConfig,
    fsdps: &[usize],
    rounds: usize,
    steps: usize,
) -> Result<Vec<UnitsBenchRecord>, String> {
    let source = token_source(config)?;
    let model_config = config.transformer(source.vocab_size())?;
    let plan = ParallelizePlan::new().fully_shard("");
    let batch = config.run.global_batch;
    let tokens = (batch * config.data.seq_len) as f64;
    let mut out = vec![];
    for &fsdp in fsdps {
        if fsdp == 0 || !batch.is_multiple_of(fsdp) {
            return Err(format!(
                "--fsdps {fsdp}: the global batch of {batch} must split evenly over the ranks"
            ));
        }
        let per_rank = batch / fsdp;
        let results = Launch::new(format!("fsdp={fsdp}").as_str())
            .map_err(|e| e.to_string())?
            .run(|ctx| {
                let device = ctx.device().clone().autodiff();
                let model = model_config.init(config.run.seed, &device);
                let (model, par) = parallelize(model, &plan, &ctx)?;
                let group = ctx.group(Axis::Fsdp);
                let rank = group.rank() as u64 * per_rank as u64;
                let (x, y) = make_batch(
                    &*source,
                    rank..rank + per_rank as u64,
                    config.data.seq_len,
                    &device,
                );
                let fwd = transformer::forward_context();
                // One step, in units or per read: its time, collectives and prefetches.
                let step = |units: bool| -> Result<(f64, [u64; 2], usize), ParallelError> {
                    let prefetched_before = par.unit_stats().map_or(0, |s| s.snapshot().prefetches);
                    let before = group.stats();
                    let started = Instant::now();
                    let forward = |m: &flashover_models::Transformer| {
                        m.forward_loss(x.clone(), y.clone(), &fwd)
                    };
                    let loss = match units {
                        true => par.forward(&model, forward)?,
                        false => forward(&model),
                    };
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    par.reduce_gradients(&model, grads, None, &ctx)?;
                    let time = started.elapsed().as_secs_f64();
                    let ops = group.stats().since(&before).ops;
                    let calls = |op| ops.get(&op).map_or(0, |s| s.calls);
                    let prefetched = par.unit_stats().map_or(0, |s| s.snapshot().prefetches);
                    let counts = [calls(OpKind::AllGather), calls(OpKind::ReduceScatter)];
                    Ok((time, counts, prefetched - prefetched_before))
                };
                let mut measured: [Vec<(f64, [u64; 2], usize)>; 2] = [vec![], vec![]];
                for round in 0..rounds + 1 {
                    // Alternate which way goes first, so neither always follows the other.
                    for units in [round % 2 == 1, round % 2 == 0] {
                        for _ in 0..steps {
                            let m = step(units)?;
                            if round > 0 {
                                measured[units as usize].push(m);
                            }
                        }
                    }
                }
                Ok::<_, ParallelError>(measured)
            })
            .map_err(|e| e.to_string())?;
        let rank0 = results.into_iter().next().expect("rank 0");
        for (units, runs) in rank0.into_iter().enumerate() {
            let mut times: Vec<f64> = runs.iter().map(|r| r.0).collect();
            times.sort_by(f64::total_cmp);
            let step_s = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
            let (counts, prefetches) = runs.first().map_or(([0, 0], 0), |r| (r.1, r.2));
            out.push(UnitsBenchRecord {
                fsdp,
                gathers: if units == 1 { "units" } else { "per read" },
                step_s,
                tokens_per_s: tokens / step_s,
                all_gathers: counts[0],
                reduce_scatters: counts[1],
                prefetches,
            });
        }
    }
    Ok(out)
}
