//! `flashover bench pipeline`: measured pipeline bubbles next to the formulas and the
//! simulation of the same schedule.
//!
//! The measured bubble of a rank is the idle part of its schedule (wall time of the schedule
//! minus its forwards and backwards) divided by the schedule's wall time, over steps 2..N; the
//! optimizer step and the step's reductions are outside it. The peak of micro-batches in
//! flight is counted by the executor.
//!
//! Each schedule runs twice, side by side: as `flashover train` runs it (its own stage cut),
//! and through the reference model's plan (`parallelize` with a pipeline rule, then
//! `Parallelized::pipeline_step`, what a user's model runs), on the same model, batches and
//! schedule.

use crate::train::{TrainConfig, make_batch, token_source, train};
use burn::optim::AdamWConfig;
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::transformer::{self, LmBatch};
use flashover_parallel::parallelize::{ParallelizePlan, parallelize};
use flashover_parallel::pipeline::{Costs, PipelineStepReport, Schedule, ScheduleKind, simulate};
use flashover_runtime::Launch;
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
    /// `measured` of the same schedule through the reference model's plan.
    pub plan_measured: f64,
    /// `schedule_ms` of the same schedule through the reference model's plan.
    pub plan_schedule_ms: f64,
}

/// Per timed step, every rank's schedule report.
type StepReports = Vec<Vec<PipelineStepReport>>;

/// The mean over ranks of the schedule's idle fraction, and the mean over steps of the
/// slowest rank's schedule wall time in milliseconds.
fn bubble_and_wall(steps: &StepReports) -> (f64, f64) {
    let ranks = steps.first().map_or(0, Vec::len);
    let idle = |r: &PipelineStepReport| r.wall.saturating_sub(r.forward + r.backward).as_secs_f64();
    let bubble = (0..ranks)
        .map(|k| {
            let idle: f64 = steps.iter().map(|s| idle(&s[k])).sum();
            let wall: f64 = steps.iter().map(|s| s[k].wall.as_secs_f64()).sum();
            idle / wall
        })
        .sum::<f64>()
        / ranks.max(1) as f64;
    let slowest =
        |s: &Vec<PipelineStepReport>| s.iter().map(|r| r.wall.as_secs_f64()).fold(0.0, f64::max);
    let wall = steps.iter().map(slowest).sum::<f64>() * 1e3 / steps.len().max(1) as f64;
    (bubble, wall)
}

/// `config`'s job (its model, batches, steps and learning rate, one replica) through the
/// reference model's plan cut by `kind` over `p` ranks, `m` micro-batches and `chunks` stages
/// per rank: every timed step's schedule reports (the first step warms up).
fn plan_run(
    config: &TrainConfig,
    kind: ScheduleKind,
    p: usize,
    m: usize,
    chunks: usize,
) -> Result<StepReports, String> {
    let source = token_source(config)?;
    let model_config = config.transformer(source.vocab_size())?;
    let rule = transformer::pipeline(&model_config, kind, m).chunks(chunks);
    let plan = ParallelizePlan::new().pipeline(rule);
    let (batch, seq) = (config.run.global_batch, config.data.seq_len);
    let per_rank = Launch::new(format!("pp={p}").as_str())
        .map_err(|e| e.to_string())?
        .run(|ctx| {
            let device = ctx.device().clone().autodiff();
            let model = model_config.init(config.run.seed, &device);
            let (mut model, par) = parallelize(model, &plan, &ctx)?;
            let mut optim = AdamWConfig::new().init();
            let micro_batch = |samples: std::ops::Range<usize>| {
                let indices = samples.start as u64..samples.end as u64;
                LmBatch::from(make_batch(&*source, indices, seq, &device))
            };
            let mut reports = vec![];
            for step in 0..config.run.steps {
                let out = par.pipeline_step(&model, batch, step, &micro_batch, None, &ctx)?;
                model = optim.step(config.optim.lr, model, out.grads);
                if step > 0 {
                    reports.push(out.report);
                }
            }
            Ok::<_, ParallelError>(reports)
        })
        .map_err(|e| e.to_string())?;
    let steps = per_rank.first().map_or(0, Vec::len);
    Ok((0..steps)
        .map(|s| per_rank.iter().map(|r| r[s].clone()).collect())
        .collect())
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
                let (plan_measured, plan_schedule_ms) =
                    bubble_and_wall(&plan_run(&c, kind, p, m, chunks)?);
                let timed = &report.steps[1..];
                let ranks = timed[0].ranks.len();
                let measured = (0..ranks)
                    .map(|r| {
                        let idle: f64 = timed.iter().map(|s| s.ranks[r].exposed_comm_s).sum();
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
                    plan_measured,
                    plan_schedule_ms,
                });
            }
        }
    }
    Ok(out)
}
