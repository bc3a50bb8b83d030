//! Global-norm gradient clipping over (possibly sharded) flat gradients.

use crate::error::ParallelError;
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
    if let Some(max) = max_norm {
        if max.is_nan() || max <= 0.0 {
            return Err(ParallelError::Invalid(format!(
                "gradient clipping needs a positive max norm, got {max}"
            )));
        }
        if norm > max {
            let scale = max / (norm + 1e-6);
            parts
                .iter_mut()
                .for_each(|p| p.iter_mut().for_each(|g| *g *= scale));
        }
    }
    Ok(norm)
}
