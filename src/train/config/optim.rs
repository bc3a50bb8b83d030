//! `[optim]`: AdamW and the learning-rate schedule.

use serde::{Deserialize, Serialize};

/// `[optim]`: AdamW with linear warm-up and cosine decay to `min_lr_ratio x lr`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimSection {
    /// Peak learning rate.
    pub lr: f64,
    /// Warm-up steps.
    pub warmup_steps: usize,
    /// Final learning rate as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (none if absent or 0).
    pub clip: Option<f32>,
}

impl Default for OptimSection {
    fn default() -> Self {
        OptimSection {
            lr: 3e-3,
            warmup_steps: 10,
            min_lr_ratio: 0.1,
            weight_decay: 0.01,
            clip: Some(1.0),
        }
    }
}
