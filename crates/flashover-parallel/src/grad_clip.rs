//! Global-norm gradient clipping on the device: a gradient's norm ([`GradNorm`], a
//! one-element tensor), the factor that brings a gradient to its limit, and the one-device
//! version of what a plan's reduction does on many ranks ([`clip_global_norm`]). Nothing here
//! reads the host: a step reads its norm once, with its loss, after the optimizer step is
//! queued ([`GradNorm::value`]).

use crate::error::ParallelError;
use burn::tensor::{DType, Tensor};
use flashover_runtime::transfers::{Cause, read_scalar};

/// A gradient's global L2 norm, on the gradient's device: a one-element f32 tensor. On a GPU
/// reading it to the host waits for the device queue, so clipping and loss-scale-free steps
/// use it where it is ([`Self::clip_factor`]), and a report reads it once ([`Self::value`]).
#[derive(Debug, Clone)]
pub struct GradNorm(Tensor<1>);

impl GradNorm {
    /// The norm of squared sums `squares` (one element, f64 or f32, already summed over every
    /// rank that holds part of the gradient): their square root, in the sums' precision, as f32.
    pub(crate) fn from_squares(squares: Tensor<1>) -> Self {
        GradNorm(squares.sqrt().cast(DType::F32))
    }

    /// A norm already computed (one element, f32), as a tensor.
    pub fn from_tensor(norm: Tensor<1>) -> Self {
        GradNorm(norm)
    }

    /// The norm as a one-element f32 tensor on the gradient's device.
    pub fn into_tensor(self) -> Tensor<1> {
        self.0
    }

    /// The norm on the host: one read, which on a GPU waits for the device queue (counted as
    /// a metric read). A step that also reports its loss reads both in one go instead (the
    /// trainer's step scalars).
    pub fn value(&self) -> f32 {
        self.read(Cause::Metrics)
    }

    /// The norm on the host, read for `cause`.
    pub(crate) fn read(&self, cause: Cause) -> f32 {
        read_scalar(self.0.clone(), cause)
    }

    /// The factor, on the device, that brings a gradient of this norm down to `max_norm`:
    /// `max_norm / (norm + 1e-6)` where the norm exceeds it, else exactly 1 (a gradient
    /// multiplied by it keeps its bits). Fails on a limit that is not positive.
    pub fn clip_factor(&self, max_norm: f32) -> Result<Tensor<1>, ParallelError> {
        if max_norm.is_nan() || max_norm <= 0.0 {
            return Err(ParallelError::Invalid(format!(
                "gradient clipping needs a positive max norm, got {max_norm}"
            )));
        }
        let device = self.0.device();
        let within = self.0.clone().lower_equal_elem(max_norm);
        let factor = Tensor::<1>::full([1], max_norm, &device).div(self.0.clone().add_scalar(1e-6));
        // A NaN norm compares false both ways: left unclipped, as the host rule left it.
        let within = within.bool_or(self.0.clone().is_nan());
        Ok(factor.mask_fill(within, 1.0))
    }
}

/// The sum of squares of `parts` (flat gradients on one device), on the device: each part's
/// squares summed in f64 where the device has it (so the sum barely depends on how the
/// gradient is cut into parts: ZeRO-1's rows give DDP's bits), else in f32; zero without any.
pub(crate) fn squared_sum(
    parts: impl IntoIterator<Item = Tensor<1>>,
    device: &burn::tensor::Device,
) -> Tensor<1> {
    let dtype = match device.supports_dtype(DType::F64) {
        true => DType::F64,
        false => DType::F32,
    };
    let sums: Vec<Tensor<1>> = (parts.into_iter())
        .map(|g| {
            let g = g.cast(dtype);
            (g.clone() * g).sum()
        })
        .collect();
    match sums.is_empty() {
        true => Tensor::<1>::zeros([1], device).cast(dtype),
        false => Tensor::cat(sums, 0).sum(),
    }
}

/// `grads` scaled so its norm is at most `max_norm` by `norm`'s factor (unchanged without a
/// limit).
pub(crate) fn clipped(
    grads: Tensor<1>,
    norm: &GradNorm,
    max_norm: Option<f32>,
) -> Result<Tensor<1>, ParallelError> {
    match max_norm {
        None => Ok(grads),
        Some(max) => {
            let factor = norm.clip_factor(max)?;
            let n = grads.dims()[0];
            Ok(grads * factor.expand([n]))
        }
    }
}

/// The L2 norm of a whole gradient on one device (`grads`: flat, as
/// [`crate::params::accumulate_grads`] lays it out), and the gradient scaled so its norm is at
/// most `max_norm`, as `Parallelized::gradients` clips on many ranks (a single-device
/// reference loop's clipping), all on the device. Returns the gradient and its norm before
/// clipping.
pub fn clip_global_norm(
    grads: Tensor<1>,
    max_norm: Option<f32>,
) -> Result<(Tensor<1>, GradNorm), ParallelError> {
    let norm = GradNorm::from_squares(squared_sum([grads.clone()], &grads.device()));
    Ok((clipped(grads, &norm, max_norm)?, norm))
}
