//! `flashover bench units`: the reference transformer's fully sharded parameters gathered three
//! ways, side by side in one run at each `fsdp` degree, alternating round by round on the same
//! ranks and batches:
//! - *per read*: a plan's `fully_shard("")`, each parameter all-gathered where the forward
//!   reads it;
//! - *units*: the same inside `Parallelized::forward`, a unit at a time with the next one
//!   prefetched, kept gathered until backward;
//! - *units, resharded*: the same with every block's forward checkpointed, so each block is
//!   freed after its forward and gathered again for its backward (FSDP's
//!   `reshard_after_forward`, what `flashover train --zero 3` runs by default).

use burn::optim::GradientsParams;
use flashover::train::{TrainConfig, make_batch, token_source};
use flashover_models::Transformer;
use flashover_models::transformer;
use flashover_parallel::ParallelError;
use flashover_parallel::activation_checkpointing::CheckpointPolicy;
use flashover_parallel::parallelize::{ParallelizePlan, parallelize};
use flashover_runtime::{Axis, Launch, OpKind};
use serde::Serialize;
use std::time::Instant;

/// One (fsdp, way of gathering) measurement.
#[derive(Debug, Clone, Serialize)]
pub struct UnitsBenchRecord {
    /// Ranks the parameters are sharded over.
    pub fsdp: usize,
    /// How: one of [`WAYS`].
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
    /// Gathered parameter bytes alive at once, at most, on rank 0 (`None` per read, which
    /// keeps no count).
    pub gathered_peak_bytes: Option<usize>,
}

/// The ways compared, in the order reported.
pub const WAYS: [&str; 3] = ["per read", "units", "units, resharded"];

/// One step's measurements: time, all-gathers and reduce-scatters, prefetches, peak bytes.
type StepMeasure = (f64, [u64; 2], usize, Option<usize>);

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
        let per_rank = super::share_of("--fsdps", fsdp, batch)?;
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
                let mut resharding = transformer::forward_context();
                let recompute = CheckpointPolicy::Full
                    .block_recompute()
                    .expect("block-level");
                resharding.checkpointing = Some(recompute.hook());
                // One step of `way`: its time, collectives, prefetches and gathered peak.
                let step = |way: usize| -> Result<StepMeasure, ParallelError> {
                    let stats = par.sharded().unit_stats();
                    let prefetched_before = stats.map_or(0, |s| s.snapshot().prefetches);
                    if let Some(stats) = stats {
                        stats.reset_peak();
                    }
                    let before = group.stats();
                    let started = Instant::now();
                    let (x, y) = (&x, &y);
                    let plan_forward =
                        |ctx| move |m: &Transformer| m.forward_loss(x.clone(), y.clone(), ctx);
                    let loss = match way {
                        0 => plan_forward(&fwd)(&model),
                        1 => par.forward(&model, plan_forward(&fwd))?,
                        _ => par.forward(&model, plan_forward(&resharding))?,
                    };
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    par.reduce_gradients(&model, grads, None, &ctx)?;
                    let time = started.elapsed().as_secs_f64();
                    let ops = group.stats().since(&before).ops;
                    let calls = |op| ops.get(&op).map_or(0, |s| s.calls);
                    let snapshot = stats.map(|s| s.snapshot());
                    let prefetched = snapshot.map_or(0, |s| s.prefetches) - prefetched_before;
                    let counts = [calls(OpKind::AllGather), calls(OpKind::ReduceScatter)];
                    let peak = snapshot.filter(|_| way > 0).map(|s| s.peak_bytes);
                    Ok((time, counts, prefetched, peak))
                };
                super::alternate(WAYS.len(), rounds, steps, step)
            })
            .map_err(|e| e.to_string())?;
        let rank0 = results.into_iter().next().expect("rank 0");
        for (way, runs) in rank0.into_iter().enumerate() {
            let step_s = super::median(runs.iter().map(|r| r.0).collect());
            let (counts, prefetches, peak) =
                runs.first().map_or(([0, 0], 0, None), |r| (r.1, r.2, r.3));
            out.push(UnitsBenchRecord {
                fsdp,
                gathers: WAYS[way],
                step_s,
                tokens_per_s: tokens / step_s,
                all_gathers: counts[0],
                reduce_scatters: counts[1],
                prefetches,
                gathered_peak_bytes: peak,
            });
        }
    }
    Ok(out)
}
