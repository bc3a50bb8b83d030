//! `flashover bench pipeline`: measured pipeline bubbles next to the formulas and the
//! simulation of the same schedule.
//!
//! The measured bubble of a rank is the idle part of its schedule (wall time of the schedule
//! minus its forwards and backwards) divided by the schedule's wall time, over steps 2..N; the
//! optimizer step and the step's reductions are outside it. The peak of micro-batches in
//! flight is counted by the executor.
//!
//! `flashover train` runs these dense pipelines through the reference model's plan
//! (`parallelize` with a pipeline rule, then `PipelineRunner::step`), the path a user's
//! model takes.

use flashover::train::{TrainConfig, train};
use flashover_parallel::pipeline::{Costs, Schedule, ScheduleKind, simulate};
use serde::Serialize;

/// One layout's measurement.
#[derive(Debug, Clone, Serialize)]
pub struct PipelineBenchRecord {
    /// Schedule name.
    pub schedule: String,
    /// Pipeline ranks, micro-batches, chunks per rank.
    pub pp: usize,
    /// Micro-batches.
    pub micro_batches: usize,
    /// Chunks per rank.
    pub chunks: usize,
    /// Mean over ranks of the schedule's idle time / its wall time.
    pub measured: f64,
    /// The simulated idle fraction of the same schedule (forward 1, backward 2).
    pub simulated: f64,
    /// The textbook formula: (p-1)/(m+p-1), or for interleaved (p-1)/(v m) over busy time
    /// converted to a fraction of the step.
    pub formula: f64,
    /// Most micro-batches rank 0 held at once.
    pub peak_in_flight: usize,
    /// Mean over the timed steps of the slowest rank's schedule wall time, in milliseconds:
    /// what compares schedules of the same p and m.
    pub schedule_ms: f64,
}

/// Runs `base` (its model, data and steps) with each schedule at each `pp` and micro-batch
/// count, one replica, untied head.
pub fn run(
    base: &TrainConfig,
    pps: &[usize],
    micro: &[usize],
    schedules: &[String],
) -> Result<Vec<PipelineBenchRecord>, String> {
    let mut out = vec![];
    for &p in pps {
        for &m in micro {
            for name in schedules {
                let kind: ScheduleKind = name.parse()?;
                let chunks = if kind == ScheduleKind::Interleaved1F1B {
                    2
                } else {
                    1
                };
                let Ok(schedule) = Schedule::build(kind, p, m, chunks) else {
                    continue; // e.g. interleaved with m not a multiple of p
                };
                let mut c = base.clone();
                c.parallel.mesh = format!("pp={p}");
                c.parallel.pp_schedule = kind;
                c.parallel.pp_chunks = chunks;
                c.model.tie_embeddings = false;
                c.run.micro_batches = m;
                c.run.global_batch = m * (c.run.global_batch / c.run.micro_batches.max(1)).max(1);
                c.run.log_jsonl = None;
                c.run.trace = None;
                let report = train(&c, &|_| {})?;
                let timed = &report.steps[1..];
                let ranks = timed[0].ranks.len();
                let measured = (0..ranks)
                    .map(|r| {
                        let idle: f64 = timed.iter().map(|s| s.ranks[r].bubble_s).sum();
                        let wall: f64 = timed.iter().map(|s| s.ranks[r].pipeline_s).sum();
                        idle / wall
                    })
                    .sum::<f64>()
                    / ranks as f64;
                let schedule_ms = timed
                    .iter()
                    .map(|s| s.ranks.iter().map(|r| r.pipeline_s).fold(0.0, f64::max))
                    .sum::<f64>()
                    * 1e3
                    / timed.len() as f64;
                let timeline = simulate(&schedule, &Costs::default()).map_err(|e| e.to_string())?;
                let bubbles = timeline.bubbles();
                let simulated = bubbles.iter().sum::<f64>() / bubbles.len() as f64;
                let formula = if kind == ScheduleKind::Interleaved1F1B {
                    let over_busy = (p - 1) as f64 / (chunks * m) as f64;
                    over_busy / (1.0 + over_busy)
                } else {
                    (p - 1) as f64 / (m + p - 1) as f64
                };
                out.push(PipelineBenchRecord {
                    schedule: name.clone(),
                    pp: p,
                    micro_batches: m,
                    chunks,
                    measured,
                    simulated,
                    formula,
                    peak_in_flight: report.steps.last().map_or(0, |s| s.ranks[0].in_flight),
                    schedule_ms,
                });
            }
        }
    }
    Ok(out)
}
