//! Global-norm gradient clipping: the scale that brings a gradient to its limit, and the one
//! device version of what a plan's reduction does on many ranks.

use crate::error::ParallelError;
use burn::tensor::Tensor;

/// The L2 norm of a whole gradient on one device (`grads`: flat, as
/// [`crate::params::accumulate_grads`] lays it out), and the gradient scaled so its norm is at
/// most `max_norm`, as `Parallelized::gradients` clips on many ranks (a single-device
/// reference loop's clipping). The squares are read to the host and accumulated in f64 (a
/// reference's norm as exact as it can be); the scaling runs on the device. Returns the
/// gradient and its norm before clipping.
pub fn clip_global_norm(
    grads: Tensor<1>,
    max_norm: Option<f32>,
) -> Result<(Tensor<1>, f32), ParallelError> {
    let values = crate::params::to_f32(grads.clone());
    let squares: f64 = values.iter().map(|&g| g as f64 * g as f64).sum();
    let norm = squares.sqrt() as f32;
    match clip_scale(norm, max_norm)? {
        Some(scale) => Ok((grads.mul_scalar(scale), norm)),
        None => Ok((grads, norm)),
    }
}

/// The factor that brings a gradient of global norm `norm` down to `max_norm` (`None` when it
/// is already within, or there is no limit); fails on a limit that is not positive.
pub fn clip_scale(norm: f32, max_norm: Option<f32>) -> Result<Option<f32>, ParallelError> {
    match max_norm {
        None => Ok(None),
        Some(max) if max.is_nan() || max <= 0.0 => Err(ParallelError::Invalid(format!(
            "gradient clipping needs a positive max norm, got {max}"
        ))),
        Some(max) => Ok((norm > max).then(|| max / (norm + 1e-6))),
    }
}
