//! What a training run measured: per-step records (the JSONL log) and the final summary.

use serde::Serialize;
use std::fmt;

/// Where one rank's time went in one step.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct RankTimes {
    /// Global rank.
    pub rank: usize,
    /// Wall time of the step on this rank.
    pub step_s: f64,
    /// Time the training thread computed: the step minus `exposed_comm_s`.
    pub compute_s: f64,
    /// Time the communication thread spent reducing gradients (hidden or not).
    pub comm_s: f64,
    /// Part of `comm_s` that overlapped backward.
    pub overlapped_s: f64,
    /// Time the training thread waited for gradient reductions after backward.
    pub exposed_comm_s: f64,
    /// Time this rank's collectives waited for slower peers to arrive (load imbalance); it is
    /// spent on the communication thread, inside `comm_s`, and shows in `exposed_comm_s` only
    /// when backward has already finished.
    pub idle_s: f64,
}

/// One optimizer step, as written to the JSONL log.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StepRecord {
    /// Step index (0-based).
    pub step: usize,
    /// Mean next-token loss over the global batch (nats).
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens per second over the whole job.
    pub tokens_per_s: f64,
    /// Wall time of the step (slowest rank).
    pub step_time_s: f64,
    /// Per-rank times.
    pub ranks: Vec<RankTimes>,
}

/// A finished run.
#[derive(Debug, Clone)]
pub struct TrainReport {
    /// Every step.
    pub steps: Vec<StepRecord>,
    /// Final parameters by name (rank 0's copy), in layout order.
    pub params: Vec<(String, Vec<f32>)>,
    /// The data's known loss floor, if any.
    pub loss_floor: Option<f64>,
    /// Parameters in the model.
    pub num_params: usize,
    /// The mesh, as written.
    pub mesh: String,
    /// Gradient buckets per step.
    pub buckets: usize,
    /// Whether gradient reduction overlapped backward.
    pub overlap: bool,
    /// Wall time of the whole run.
    pub wall_s: f64,
    /// Tokens processed.
    pub tokens: usize,
}

impl TrainReport {
    /// Final loss: the mean of the last `min(10, steps)` steps.
    pub fn final_loss(&self) -> f64 {
        let tail = &self.steps[self.steps.len().saturating_sub(10)..];
        tail.iter().map(|s| s.loss).sum::<f64>() / tail.len().max(1) as f64
    }

    /// Per-rank totals over the run (steps after the first, which includes warm-up).
    pub fn rank_totals(&self) -> Vec<RankTimes> {
        let n = self.steps.first().map_or(0, |s| s.ranks.len());
        let mut totals: Vec<RankTimes> = (0..n)
            .map(|rank| RankTimes {
                rank,
                ..Default::default()
            })
            .collect();
        for s in self.steps.iter().skip(1) {
            for (t, r) in totals.iter_mut().zip(&s.ranks) {
                t.step_s += r.step_s;
                t.compute_s += r.compute_s;
                t.comm_s += r.comm_s;
                t.overlapped_s += r.overlapped_s;
                t.exposed_comm_s += r.exposed_comm_s;
                t.idle_s += r.idle_s;
            }
        }
        totals
    }
}

impl fmt::Display for TrainReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "summary: mesh {}, {} parameters, {} steps in {:.2} s",
            self.mesh,
            self.num_params,
            self.steps.len(),
            self.wall_s
        )?;
        match self.loss_floor {
            Some(floor) => writeln!(
                f,
                "  final loss {:.4} nats (mean of last 10 steps); known floor {:.4}; gap {:.4}",
                self.final_loss(),
                floor,
                self.final_loss() - floor
            )?,
            None => writeln!(
                f,
                "  final loss {:.4} nats (mean of last 10 steps)",
                self.final_loss()
            )?,
        }
        writeln!(
            f,
            "  throughput {:.0} tokens/s ({} tokens)",
            self.tokens as f64 / self.wall_s,
            self.tokens
        )?;
        writeln!(
            f,
            "  gradient buckets per step: {}; reduction overlapped with backward: {}",
            self.buckets,
            if self.overlap {
                "yes (gradient hooks)"
            } else {
                "no (after backward)"
            }
        )?;
        writeln!(f, "  per rank, steps 2..{} (seconds):", self.steps.len())?;
        writeln!(
            f,
            "    rank    step  compute  comm(all)  overlapped  exposed   idle"
        )?;
        for t in self.rank_totals() {
            writeln!(
                f,
                "    {:>4} {:>7.3} {:>8.3} {:>10.3} {:>11.3} {:>8.3} {:>6.3}",
                t.rank, t.step_s, t.compute_s, t.comm_s, t.overlapped_s, t.exposed_comm_s, t.idle_s
            )?;
        }
        Ok(())
    }
}
