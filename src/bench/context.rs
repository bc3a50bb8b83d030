//! `flashover bench cp`: per-rank working memory and step time against sequence length at
//! several context-parallel degrees, and each rank's share of the causal attention work with
//! and without load balancing.
//!
//! Memory is measured, not estimated ([`super::working_memory`]). The ranks are threads of one
//! process sharing the heap counter, so the per-rank figure is the process figure divided by
//! the ranks, which step in lockstep.

use super::working_memory::measure;
use flashover::train::TrainConfig;
use serde::Serialize;

/// One (sequence length, cp, layout) measurement.
#[derive(Debug, Clone, Serialize)]
pub struct ContextBenchRecord {
    /// Positions per sequence.
    pub seq_len: usize,
    /// Context-parallel degree.
    pub cp: usize,
    /// Whether ranks held head-and-tail chunks.
    pub load_balanced: bool,
    /// Peak working heap bytes per rank over the measured steps.
    pub working_bytes_per_rank: f64,
    /// Median step time over the measured steps (seconds).
    pub step_s: f64,
    /// Attention scores computed: most-loaded rank over the mean (1: even).
    pub work_imbalance: f64,
    /// Attention compute time: slowest rank over the mean.
    pub time_imbalance: f64,
}

fn max_over_mean(values: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = values.collect();
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    if mean > 0.0 {
        v.iter().cloned().fold(0.0, f64::max) / mean
    } else {
        1.0
    }
}

/// Runs `config` (its model, batch and `steps`, at least 2: the first warms up) for every
/// sequence length and cp degree; cp > 1 both with and without load balancing.
pub fn run(
    config: &TrainConfig,
    seq_lens: &[usize],
    cps: &[usize],
) -> Result<Vec<ContextBenchRecord>, String> {
    let mut out = vec![];
    for &seq_len in seq_lens {
        for &cp in cps {
            let layouts: &[bool] = if cp > 1 { &[true, false] } else { &[true] };
            for &load_balanced in layouts {
                let mut c = config.clone();
                c.data.seq_len = seq_len;
                c.parallel.mesh = format!("cp={cp}");
                c.parallel.cp_load_balance = load_balanced;
                let m = measure(&c)?;
                let ranks = &m.report.steps.last().expect("a measured step").ranks;
                out.push(ContextBenchRecord {
                    seq_len,
                    cp,
                    load_balanced,
                    working_bytes_per_rank: m.working_bytes as f64 / cp as f64,
                    step_s: m.step_s,
                    work_imbalance: max_over_mean(ranks.iter().map(|r| r.attention_scores as f64)),
                    time_imbalance: max_over_mean(ranks.iter().map(|r| r.attention_s)),
                });
            }
        }
    }
    Ok(out)
}
