//! `flashover bench moe`: a mixture-of-experts job at several expert-parallel degrees and
//! capacity factors: step time, time in all-to-alls, drop rate, and the bytes of token rows sent
//! between ranks next to the formula.
//!
//! Formula: every kept assignment crosses the all-to-all four times per step (dispatch and
//! combine, forward and backward) as one row of `d_model` f32; with routing independent of the
//! sending rank, a share `(ep - 1) / ep` of them goes to another rank:
//! `4 * kept * (ep - 1) / ep * d_model * 4` bytes, `kept` summed over layers.

use flashover::train::{TrainConfig, train};
use serde::Serialize;

/// One layout's measurement (means over steps 2..N).
#[derive(Debug, Clone, Serialize)]
pub struct MoeBenchRecord {
    /// Expert-parallel ranks.
    pub ep: usize,
    /// Capacity factor (`None`: dropless).
    pub capacity_factor: Option<f64>,
    /// Milliseconds per step (slowest rank).
    pub step_ms: f64,
    /// Milliseconds per step in all-to-alls (slowest rank).
    pub a2a_ms: f64,
    /// Share of assignments dropped.
    pub drop_rate: f64,
    /// Max / mean assignments per expert (worst layer).
    pub imbalance: f64,
    /// Bytes of token rows sent between different ranks per step, measured.
    pub remote_bytes: f64,
    /// The same by the formula, from the kept assignments.
    pub formula_bytes: f64,
}

/// Runs `base` at each `ep` (mesh `ep=N`) and capacity factor (0: dropless).
pub fn run(
    base: &TrainConfig,
    eps: &[usize],
    capacity_factors: &[f64],
) -> Result<Vec<MoeBenchRecord>, String> {
    let model = base.transformer(base.vocab_size())?;
    let d = model.d_model as f64;
    let mut out = vec![];
    for &cf in capacity_factors {
        for &ep in eps {
            let mut c = base.clone();
            c.parallel.mesh = format!("ep={ep}");
            c.moe.capacity_factor = (cf > 0.0).then_some(cf);
            c.run.log_jsonl = None;
            c.run.trace = None;
            let report = train(&c, &|_| {})?;
            let timed = &report.steps[1.min(report.steps.len() - 1)..];
            let n = timed.len() as f64;
            let mean = |f: &dyn Fn(&flashover::train::StepRecord) -> f64| {
                timed.iter().map(f).sum::<f64>() / n
            };
            let moe = |s: &flashover::train::StepRecord| s.moe.clone().unwrap_or_default();
            let kept = mean(&|s| moe(s).tokens_per_expert.iter().flatten().sum::<u64>() as f64);
            let share = (ep - 1) as f64 / ep as f64;
            out.push(MoeBenchRecord {
                ep,
                capacity_factor: c.moe.capacity_factor,
                step_ms: mean(&|s| s.step_time_s) * 1e3,
                a2a_ms: mean(&|s| moe(s).a2a_s) * 1e3,
                drop_rate: mean(&|s| moe(s).drop_rate),
                imbalance: mean(&|s| moe(s).imbalance),
                remote_bytes: mean(&|s| moe(s).a2a_remote_bytes as f64),
                // `kept` already sums over layers.
                formula_bytes: 4.0 * kept * share * d * 4.0,
            });
        }
    }
    Ok(out)
}
