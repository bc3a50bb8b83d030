//! Global-norm gradient clipping over (possibly sharded) flat gradients.

use crate::error::ParallelError;
use crate::params::to_f32;
use crate::placement::{PlacementTable, global_grad_norm};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use flashover_comm::{CommunicatorExt, Group, ReduceOp};
use flashover_runtime::RankContext;

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

/// Global-norm clipping of a module's gradients (already reduced over the data axes) wherever
/// its parameters live: the norm comes from their `placements`
/// ([`crate::placement::global_grad_norm`]: tensor-parallel shares sum over tp, replicated
/// parameters count once). Returns the clipped gradients and the norm before clipping.
pub fn clip_module_grads<M: Module>(
    module: &M,
    mut grads: GradientsParams,
    max_norm: Option<f32>,
    placements: &PlacementTable,
    ctx: &RankContext,
) -> Result<(GradientsParams, f32), ParallelError> {
    let entries = placements.entries_of(module)?;
    struct Read<'a> {
        grads: &'a GradientsParams,
        values: Vec<Vec<f32>>,
    }
    impl ModuleVisitor for Read<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let g = self.grads.get::<D>(param.id).map(to_f32);
            self.values.push(g.unwrap_or_default());
        }
    }
    let mut read = Read {
        grads: &grads,
        values: vec![],
    };
    module.visit(&mut read);
    let parts = entries
        .iter()
        .zip(&read.values)
        .map(|((_, entry), g)| (*entry, g.as_slice()));
    let norm = global_grad_norm(parts, ctx)?;
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
