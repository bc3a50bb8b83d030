//! `flashover bench overlap`: a loop of one's own under data parallelism, the reference
//! transformer's gradients reduced in buckets during backward (its forward through
//! `Parallelized::forward`, `gradient_buckets.overlap` on) against after it (overlap off),
//! side by side in one run at each `dp` degree, alternating round by round on the same ranks
//! and batches.

use flashover::train::{TrainConfig, make_batch, token_source};
use flashover_models::transformer;
use flashover_parallel::ParallelError;
use flashover_parallel::data_parallel::GradientBuckets;
use flashover_parallel::parallelize::{ParallelizePlan, parallelize};
use flashover_runtime::{Axis, Launch};
use serde::Serialize;
use std::time::Instant;

/// One (dp, overlap) measurement.
#[derive(Debug, Clone, Serialize)]
pub struct OverlapBenchRecord {
    /// Data-parallel ranks.
    pub dp: usize,
    /// Whether the buckets were reduced during backward.
    pub overlap: bool,
    /// Median time of a step (forward, backward, gradient reduction) over the rounds, on rank 0.
    pub step_s: f64,
    /// Tokens per second of the whole batch at that time.
    pub tokens_per_s: f64,
    /// Median communication time of a step's buckets, on rank 0.
    pub comm_s: f64,
    /// Of it, the median part that ran before backward ended.
    pub overlapped_s: f64,
    /// Median time the training thread waited for the buckets after backward.
    pub exposed_s: f64,
    /// Buckets per step.
    pub buckets: usize,
}

/// Per step: time, communication, overlapped, exposed, buckets.
type StepMeasure = (f64, f64, f64, f64, usize);

/// Runs `config`'s model and batch at each degree of `dps`, in its buckets
/// (`parallel.bucket_mb`), for `rounds` rounds of `steps` steps each way (the first round warms
/// up and is not counted).
pub fn run(
    config: &TrainConfig,
    dps: &[usize],
    rounds: usize,
    steps: usize,
) -> Result<Vec<OverlapBenchRecord>, String> {
    let source = token_source(config)?;
    let model_config = config.transformer(source.vocab_size())?;
    let plan = |overlap| {
        let buckets = GradientBuckets::default()
            .bucket_mb(config.parallel.bucket_mb)
            .overlap(overlap);
        ParallelizePlan::new().gradient_buckets(buckets)
    };
    let plans = [plan(false), plan(true)];
    let batch = config.run.global_batch;
    let tokens = (batch * config.data.seq_len) as f64;
    let mut out = vec![];
    for &dp in dps {
        let per_rank = super::share_of("--dps", dp, batch)?;
        let results = Launch::new(format!("dp={dp}").as_str())
            .map_err(|e| e.to_string())?
            .run(|ctx| {
                let device = ctx.device().clone().autodiff();
                let model = model_config.init(config.run.seed, &device);
                let mut ways = vec![];
                for plan in &plans {
                    ways.push(parallelize(model.clone(), plan, &ctx)?);
                }
                let rank = ctx.coord(Axis::Dp) as u64 * per_rank as u64;
                let (x, y) = make_batch(
                    &*source,
                    rank..rank + per_rank as u64,
                    config.data.seq_len,
                    &device,
                );
                let fwd = transformer::forward_context();
                let step = |way: usize, learning: bool| -> Result<StepMeasure, ParallelError> {
                    let (model, par) = &ways[way];
                    let started = Instant::now();
                    let loss =
                        par.forward(model, |m| m.forward_loss(x.clone(), y.clone(), &fwd))?;
                    par.gradients(model, loss.backward(), None, &ctx)?;
                    let time = started.elapsed().as_secs_f64();
                    let r = par.reducer().last_reduction();
                    if r.reduced_during_backward != (way == 1 && !learning) {
                        // Overlap off never reduces during backward; on, from the second step.
                        return Err(ParallelError::Invalid(format!(
                            "bench overlap: way {way} reduced during backward: {}",
                            r.reduced_during_backward
                        )));
                    }
                    let secs = |d: std::time::Duration| d.as_secs_f64();
                    Ok((
                        time,
                        secs(r.comm),
                        secs(r.overlapped),
                        secs(r.exposed),
                        r.buckets,
                    ))
                };
                // A first step of each way learns the micro-batches (overlap from the second).
                step(0, true)?;
                step(1, true)?;
                super::alternate(2, rounds, steps, |way| step(way, false))
            })
            .map_err(|e| e.to_string())?;
        let rank0 = results.into_iter().next().expect("rank 0");
        for (way, runs) in rank0.into_iter().enumerate() {
            let median = |f: fn(&StepMeasure) -> f64| super::median(runs.iter().map(f).collect());
            let step_s = median(|m| m.0);
            out.push(OverlapBenchRecord {
                dp,
                overlap: way == 1,
                step_s,
                tokens_per_s: tokens / step_s,
                comm_s: median(|m| m.1),
                overlapped_s: median(|m| m.2),
                exposed_s: median(|m| m.3),
                buckets: runs.first().map_or(0, |m| m.4),
            });
        }
    }
    Ok(out)
}
