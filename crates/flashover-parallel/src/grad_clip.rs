//! Global-norm gradient clipping over (possibly sharded) flat gradients.

use crate::error::ParallelError;
use crate::params::{ParamLayout, to_f32};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use flashover_comm::{CommunicatorExt, Group, ReduceOp};

/// The global L2 norm of a gradient whose pieces are spread over `shard_group` (each rank
/// holds a disjoint part; `None` when every rank holds the whole gradient, as in DDP), and the
/// gradient scaled in place so its norm is at most `max_norm`. Returns the norm before clipping.
///
/// The squared norm is accumulated in f64 and reduced with one all-reduce of one element.
pub fn clip_global_norm(
    local: &mut [f32],
    max_norm: Option<f32>,
    shard_group: Option<&Group>,
) -> Result<f32, ParallelError> {
    clip_global_norm_parts(&mut [local], max_norm, shard_group)
}

/// [`clip_global_norm`] over a gradient held in several pieces (e.g. one per parameter),
/// accumulated in the order given.
pub fn clip_global_norm_parts(
    parts: &mut [&mut [f32]],
    max_norm: Option<f32>,
    shard_group: Option<&Group>,
) -> Result<f32, ParallelError> {
    let mut sq = [parts
        .iter()
        .flat_map(|p| p.iter())
        .map(|&g| g as f64 * g as f64)
        .sum::<f64>()];
    if let Some(group) = shard_group {
        group.all_reduce(&mut sq, ReduceOp::Sum)?;
    }
    let norm = sq[0].sqrt() as f32;
    if let Some(scale) = clip_scale(norm, max_norm)? {
        parts
            .iter_mut()
            .for_each(|p| p.iter_mut().for_each(|g| *g *= scale));
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

/// Global-norm clipping of a module's gradients when some parameters are split over
/// `split_group` (tensor parallel: each rank holds a disjoint part) and others replicated on it
/// (`replicated(name)`, e.g. norms, counted once). Returns the clipped gradients and the norm
/// before clipping.
pub fn clip_module_grads<M: Module>(
    module: &M,
    mut grads: GradientsParams,
    max_norm: Option<f32>,
    split_group: &Group,
    replicated: impl Fn(&str) -> bool,
) -> Result<(GradientsParams, f32), ParallelError> {
    let layout = ParamLayout::of(module);
    struct SumSquares<'a> {
        grads: &'a GradientsParams,
        /// (split, replicated) sums of squares.
        sums: [f64; 2],
        replicated: Vec<bool>,
        index: usize,
    }
    impl ModuleVisitor for SumSquares<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                let sq: f64 = to_f32(g).iter().map(|&x| x as f64 * x as f64).sum();
                self.sums[self.replicated[self.index] as usize] += sq;
            }
            self.index += 1;
        }
    }
    let mut v = SumSquares {
        grads: &grads,
        sums: [0.0; 2],
        replicated: layout.slots.iter().map(|s| replicated(&s.name)).collect(),
        index: 0,
    };
    module.visit(&mut v);
    let mut split = [v.sums[0]];
    split_group.all_reduce(&mut split, ReduceOp::Sum)?;
    let norm = (split[0] + v.sums[1]).sqrt() as f32;
    if let Some(scale) = clip_scale(norm, max_norm)? {
        struct Scale<'a> {
            grads: &'a mut GradientsParams,
            scale: f32,
        }
        impl ModuleVisitor for Scale<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(g) = self.grads.remove::<D>(param.id) {
                    self.grads.register::<D>(param.id, g.mul_scalar(self.scale));
                }
            }
        }
        module.visit(&mut Scale {
            grads: &mut grads,
            scale,
        });
    }
    Ok((grads, norm))
}
