//! Global-norm gradient clipping: the scale that brings a gradient to its limit, and the one
//! device version of what a plan's reduction does on many ranks.

use crate::error::ParallelError;

/// The sum of the squares of `values`, accumulated in f64: the one place a gradient norm is
/// computed (a plan sums this rank's counted parts and all-reduces it,
/// [`crate::placement::global_grad_norm`]).
pub(crate) fn squared_norm<'a>(values: impl IntoIterator<Item = &'a f32>) -> f64 {
    values.into_iter().map(|&g| g as f64 * g as f64).sum()
}

/// The L2 norm of a whole gradient on one device, and the gradient scaled in place so its norm
/// is at most `max_norm`, as `Parallelized::gradients` clips on many ranks (a single-device
/// reference loop's clipping). Returns the norm before clipping.
pub fn clip_global_norm(grads: &mut [f32], max_norm: Option<f32>) -> Result<f32, ParallelError> {
    let norm = squared_norm(grads.iter()).sqrt() as f32;
    if let Some(scale) = clip_scale(norm, max_norm)? {
        grads.iter_mut().for_each(|g| *g *= scale);
    }
    Ok(norm)
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
