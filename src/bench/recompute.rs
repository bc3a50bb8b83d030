//! `flashover bench recompute`: working memory and step time of each activation-checkpointing
//! policy, one rank, at two model sizes ([`super::working_memory`] measures the heap).

use super::working_memory::measure;
use crate::train::TrainConfig;
use serde::Serialize;

/// One (model, policy) measurement.
#[derive(Debug, Clone, Serialize)]
pub struct RecomputeBenchRecord {
    /// `d_model x n_layers`.
    pub model: String,
    /// The policy.
    pub policy: String,
    /// Peak working heap of a step (bytes): activations kept for backward, recomputed ones and
    /// gradients.
    pub working_bytes: usize,
    /// Median step time (seconds).
    pub step_s: f64,
    /// Final loss (every policy must give the same).
    pub loss: f64,
}

/// Runs `config` on one rank for every `(d_model, n_layers)` in `sizes` and every policy.
pub fn run(
    config: &TrainConfig,
    sizes: &[(usize, usize)],
    policies: &[String],
) -> Result<Vec<RecomputeBenchRecord>, String> {
    let mut out = vec![];
    for &(d_model, n_layers) in sizes {
        for policy in policies {
            let mut c = config.clone();
            c.parallel.mesh = "dp=1".into();
            c.model.d_model = Some(d_model);
            c.model.n_layers = Some(n_layers);
            c.model.d_ff = Some(d_model * 8 / 3);
            c.parallel.activation_checkpointing = policy.clone();
            let errors = c.validate();
            if !errors.is_empty() {
                return Err(errors.join("; "));
            }
            let m = measure(&c)?;
            out.push(RecomputeBenchRecord {
                model: format!("{d_model} x {n_layers}"),
                policy: policy.clone(),
                working_bytes: m.working_bytes,
                step_s: m.step_s,
                loss: m.report.steps.last().map_or(f64::NAN, |s| s.loss),
            });
        }
    }
    Ok(out)
}
