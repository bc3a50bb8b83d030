//! Equivalence between layouts: the same model, data and seed trained on one rank and on a
//! mesh must give the same loss and gradient norm at every step and the same final parameters.

use super::config::TrainConfig;
use super::report::{StepRecord, TrainReport};
use std::fmt;

/// The differences between a reference run and a candidate run.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// Largest `|a - b| / |b|` of the per-step losses.
    pub max_rel_loss_diff: f64,
    /// Largest `|a - b| / |b|` of the per-step gradient norms (catches wrong gradient scaling,
    /// to which AdamW's update is nearly blind).
    pub max_rel_grad_norm_diff: f64,
    /// Largest per-tensor `max|a - b| / max|b|` over the final parameters.
    pub max_rel_param_diff: f64,
    /// The parameter where that largest difference is.
    pub worst_param: String,
    /// Mixture of experts: the largest difference, over steps, layers and experts, in the
    /// number of assignments an expert processed (0: every layout routed and dropped the same
    /// tokens; `None` for dense models).
    pub max_routing_diff: Option<u64>,
    /// The tolerance used.
    pub tolerance: f64,
    /// Whether every difference is within the tolerance (and the runs have the same shape).
    pub pass: bool,
    /// Why the runs could not be compared, if they could not.
    pub structural: Option<String>,
}

/// `|a - b| / |b|`; infinite where either is not finite (a NaN must never pass).
fn rel(a: f64, b: f64) -> f64 {
    if !a.is_finite() || !b.is_finite() {
        f64::INFINITY
    } else if a == b {
        0.0
    } else {
        (a - b).abs() / b.abs().max(f64::MIN_POSITIVE)
    }
}

fn max_over(a: &[StepRecord], b: &[StepRecord], f: impl Fn(&StepRecord) -> f64) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| rel(f(x), f(y)))
        .fold(0.0, f64::max)
}

/// The largest difference in tokens per expert between two runs' steps (`None` if neither
/// routed; `u64::MAX` if only one did or their shapes differ).
fn routing_diff(a: &[StepRecord], b: &[StepRecord]) -> Option<u64> {
    let mut worst = None;
    for (x, y) in a.iter().zip(b) {
        let d = match (&x.moe, &y.moe) {
            (None, None) => continue,
            (Some(x), Some(y)) if x.tokens_per_expert.len() == y.tokens_per_expert.len() => x
                .tokens_per_expert
                .iter()
                .zip(&y.tokens_per_expert)
                .map(|(p, q)| {
                    if p.len() != q.len() {
                        return u64::MAX;
                    }
                    p.iter()
                        .zip(q)
                        .map(|(u, v)| u.abs_diff(*v))
                        .max()
                        .unwrap_or(0)
                })
                .max()
                .unwrap_or(0),
            _ => u64::MAX,
        };
        worst = Some(worst.map_or(d, |w: u64| w.max(d)));
    }
    worst
}

/// Compares `candidate` against `reference` with relative tolerance `tolerance`.
///
/// ```
/// use flashover::train::{TrainConfig, compare, train};
///
/// let mut config = TrainConfig::default();
/// config.run.steps = 2;
/// config.run.global_batch = 4;
/// let a = train(&config, &|_| {}).unwrap();
/// let b = train(&config, &|_| {}).unwrap();
/// // The same job twice is bit for bit the same.
/// assert!(compare(&a, &b, 0.0).pass);
/// ```
pub fn compare(reference: &TrainReport, candidate: &TrainReport, tolerance: f64) -> Comparison {
    let mut structural = None;
    if reference.steps.len() != candidate.steps.len() {
        structural = Some(format!(
            "{} steps vs {}",
            reference.steps.len(),
            candidate.steps.len()
        ));
    }
    let names_match = reference.params.len() == candidate.params.len()
        && reference
            .params
            .iter()
            .zip(&candidate.params)
            .all(|(a, b)| a.0 == b.0 && a.1.len() == b.1.len());
    if !names_match {
        structural = Some("the runs' parameters differ in names or sizes".into());
    }
    let mut worst = (0.0f64, String::new());
    for ((name, r), (_, c)) in reference.params.iter().zip(&candidate.params) {
        let scale = r.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
        let diff = r
            .iter()
            .zip(c)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs())) as f64;
        let finite = r.iter().chain(c).all(|v| v.is_finite());
        let d = if !finite {
            f64::INFINITY
        } else if diff == 0.0 {
            0.0
        } else {
            diff / scale.max(f64::MIN_POSITIVE)
        };
        if d > worst.0 || worst.1.is_empty() {
            worst = (d, name.clone());
        }
    }
    let loss = max_over(&candidate.steps, &reference.steps, |s| s.loss);
    let norm = max_over(&candidate.steps, &reference.steps, |s| s.grad_norm);
    let routing = routing_diff(&reference.steps, &candidate.steps);
    let pass = structural.is_none()
        && loss <= tolerance
        && norm <= tolerance
        && worst.0 <= tolerance
        && routing.is_none_or(|d| d == 0);
    Comparison {
        max_rel_loss_diff: loss,
        max_rel_grad_norm_diff: norm,
        max_rel_param_diff: worst.0,
        worst_param: worst.1,
        max_routing_diff: routing,
        tolerance,
        pass,
        structural,
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(why) = &self.structural {
            writeln!(f, "runs cannot be compared: {why}")?;
        }
        write!(
            f,
            "verify: {} max_rel_loss_diff={:.3e} max_rel_grad_norm_diff={:.3e} max_rel_param_diff={:.3e} worst_param={} tolerance={:.1e}",
            if self.pass { "PASS" } else { "FAIL" },
            self.max_rel_loss_diff,
            self.max_rel_grad_norm_diff,
            self.max_rel_param_diff,
            self.worst_param,
            self.tolerance
        )?;
        if let Some(d) = self.max_routing_diff {
            write!(f, " max_routing_diff={d}")?;
            if d > 0 {
                write!(
                    f,
                    "\n  (experts received different tokens: a routing decision closer than float rounding went the other way; see docs/expert_parallel.md)"
                )?;
            }
        }
        Ok(())
    }
}

/// Trains `config` on one rank (one micro-batch per step over the whole global batch) and as
/// configured, and compares the two.
///
/// ```
/// use flashover::train::{TrainConfig, verify};
///
/// let mut config = TrainConfig::default();
/// config.parallel.mesh = "dp=2,cp=2".into();
/// config.run.steps = 2;
/// config.run.global_batch = 4;
/// let (_, _, comparison) = verify(&config, 1e-5).unwrap();
/// assert!(comparison.pass, "{comparison}");
/// ```
pub fn verify(
    config: &TrainConfig,
    tolerance: f64,
) -> Result<(TrainReport, TrainReport, Comparison), String> {
    let mut reference = config.clone();
    reference.parallel.mesh = "dp=1".into();
    reference.parallel.zero = 0;
    reference.parallel.sequence_parallel = false;
    reference.parallel.pp_chunks = 1;
    reference.run.micro_batches = 1;
    reference.moe.replicate_hot = 0;
    reference.run.log_jsonl = None;
    reference.run.trace = None;
    let quiet = |_: &StepRecord| {};
    let r = super::train(&reference, &quiet)?;
    let c = super::train(config, &quiet)?;
    let cmp = compare(&r, &c, tolerance);
    Ok((r, c, cmp))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(losses: &[f64], param: Vec<f32>) -> TrainReport {
        TrainReport {
            steps: losses
                .iter()
                .enumerate()
                .map(|(step, &loss)| StepRecord {
                    step,
                    loss,
                    lr: 1e-3,
                    grad_norm: 1.0,
                    recomputed_blocks: 0,
                    tokens_per_s: 1.0,
                    step_time_s: 1.0,
                    ranks: vec![],
                    moe: None,
                    loss_scale: None,
                    skipped: false,
                })
                .collect(),
            params: vec![("w".into(), param)],
            loss_floor: None,
            num_params: 2,
            mesh: "dp=1".into(),
            buckets: 1,
            overlap: false,
            reduction: String::new(),
            memory: vec![],
            zero: 0,
            shard_degree: 1,
            expert_params: 0,
            expert_degree: 1,
            wall_s: 1.0,
            tokens: 1,
            host_transfers: Default::default(),
        }
    }

    #[test]
    fn identical_runs_pass_and_small_differences_are_measured() {
        let a = report(&[2.0, 1.0], vec![1.0, -2.0]);
        assert!(compare(&a, &a, 0.0).pass);
        let b = report(&[2.0, 1.000001], vec![1.0, -2.00001]);
        let c = compare(&a, &b, 1e-5);
        assert!(c.pass, "{c}");
        assert!((c.max_rel_loss_diff - 1e-6).abs() < 1e-9);
        assert!((c.max_rel_param_diff - 5e-6).abs() < 1e-6);
        assert!(!compare(&a, &b, 1e-7).pass);
    }

    #[test]
    fn a_nan_never_passes() {
        let a = report(&[2.0, 1.0], vec![1.0, 2.0]);
        assert!(!compare(&a, &report(&[2.0, f64::NAN], vec![1.0, 2.0]), 1.0).pass);
        assert!(!compare(&a, &report(&[2.0, 1.0], vec![f32::NAN, 2.0]), 1.0).pass);
        assert!(
            !compare(
                &report(&[f64::NAN], vec![1.0]),
                &report(&[f64::NAN], vec![1.0]),
                1.0
            )
            .pass
        );
    }

    #[test]
    fn runs_of_different_shapes_cannot_pass() {
        let a = report(&[2.0, 1.0], vec![1.0, 2.0]);
        let c = compare(&a, &report(&[2.0], vec![1.0, 2.0]), 1.0);
        assert!(!c.pass && c.structural.is_some());
    }
}
