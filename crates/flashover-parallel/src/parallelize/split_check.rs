//! A plan's split checked against the whole model before training: one forward and backward of
//! the user's loss on this rank's data, on the parallelized model and on the whole model
//! gathered on this rank. What the plan cannot see (an attention that reshapes by the head
//! count of its configuration rather than its split projection's width, a layer that
//! computes on part of a split value as if it were whole) shows here as a loss or a gradient
//! that differs, and the first parameter whose gradient differs names the layer.

use super::Parallelized;
use crate::dropout::draws::{self, Scope};
use crate::error::ParallelError;
use crate::params::{ParamLayout, accumulate_grads, checked_f32, zero_grads};
use crate::placement::Placement;
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use flashover_comm::ReduceOp;
use flashover_runtime::transfers::{Cause, read_scalar};
use flashover_runtime::{Axis, RankContext, TensorCollectives};

/// What [`Parallelized::check_split`] measured on this rank.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitCheck {
    /// The loss of this rank's data on the parallelized model.
    pub split_loss: f32,
    /// The same loss on the whole model.
    pub whole_loss: f32,
    /// Parameters whose gradients were compared: each rank's part of a split one with the
    /// same part of the whole model's (for a parameter sharded over `fsdp`, whose gradient
    /// sums the `fsdp` ranks' data, of the whole model's summed over `fsdp` too).
    pub compared: usize,
    /// The largest difference of a compared gradient from the whole model's, relative to the
    /// whole gradient's largest element (at least a thousandth of the whole model's largest).
    pub max_gradient_difference: f32,
}

impl Parallelized {
    /// Checks, before training, that the plan's split computes what the whole model computes:
    /// `loss(m)` on this rank's data (the same data for both) on `model` and on the whole
    /// model gathered on this rank ([`ShardedModel::whole`](super::ShardedModel::whole)), then every gradient this rank holds (a
    /// `tp` or `fsdp` part against the same part of the whole model's, summed over `fsdp`
    /// where the part's is). Fails,
    /// naming the first parameter whose gradient differs by more than `tolerance` (relative
    /// to the whole gradient's largest element, or to a thousandth of the whole model's
    /// largest when that is larger; 1e-4 catches a misread split in f32), or the
    /// losses when they differ by more than `tolerance` relative.
    ///
    /// For the layouts a rank computes the whole forward of its data on: `dp`, `fsdp`, `tp`
    /// (with sequence parallelism, its sequence-parallel parameters are not compared);
    /// refused under a pipeline, `cp`, `ep` and mixed precision. The whole model takes a
    /// whole model's memory on every rank, once. Nothing is stepped, reduced or recorded:
    /// the first training step is unchanged. Collective: every rank calls it.
    pub fn check_split<M: Module + Clone>(
        &self,
        model: &M,
        loss: impl Fn(&M) -> Tensor<1>,
        tolerance: f32,
        ctx: &RankContext,
    ) -> Result<SplitCheck, ParallelError> {
        let unsupported = [
            (self.stages.is_some(), "a pipeline (a rank runs one stage)"),
            (
                self.sequences.is_split(),
                "cp (a rank holds part of each sequence)",
            ),
            (self.experts_split, "ep (a rank runs part of the experts)"),
            (
                self.precision.policy().param_dtype != crate::precision::Precision::F32,
                "mixed precision (the whole model computes in f32)",
            ),
        ];
        if let Some((_, why)) = unsupported.iter().find(|(refused, _)| *refused) {
            return Err(ParallelError::Invalid(format!(
                "check_split compares one rank's whole forward with the whole model's; the \
                 plan has {why}"
            )));
        }
        let whole = self.sharded.whole(model.clone())?;
        // Both forwards drop what this rank's dropout draws would drop next.
        let draws = draws::current_draws();
        let (split_loss, split_grads) = draws::in_scope(draws.as_ref(), Scope::Before, || {
            loss_and_flat_grads(model, &loss)
        });
        let (whole_loss, whole_grads) = draws::in_scope(draws.as_ref(), Scope::Before, || {
            loss_and_flat_grads(&whole, &loss)
        });
        let partial = self.reducer.replica_check.as_ref().map(|c| &c.partial);
        let whole_layout = ParamLayout::of(&whole);
        let mut check = SplitCheck {
            split_loss,
            whole_loss,
            compared: 0,
            max_gradient_difference: 0.0,
        };
        // A parameter sharded over fsdp gets its gradient reduce-scattered in backward: the
        // sum over the fsdp ranks' data, which the whole model's gradients summed over fsdp
        // are too.
        let fsdp = ctx.group(Axis::Fsdp);
        let summed = match fsdp.size() {
            1 => None,
            _ => Some(checked_f32(
                fsdp.all_reduce_tensor(whole_grads.clone(), ReduceOp::Sum)?,
            )),
        };
        // Each flat gradient read to the host once: the comparison is the host's.
        let (split_grads, whole_grads) = (checked_f32(split_grads), checked_f32(whole_grads));
        let summed = summed.as_ref().unwrap_or(&whole_grads);
        let largest = whole_grads
            .iter()
            .fold(0f32, |m, g| m.max(g.abs()))
            .max(1e-12);
        let entries = self.sharded.placements.entries_of(model)?;
        // The split parameters first: their gradients are their own layer's doing, while a
        // whole parameter's also carries whatever the split layers after it got wrong.
        let mut order: Vec<usize> = (0..entries.len()).collect();
        order.sort_by_key(|&i| entries[i].1.on(Axis::Tp) == Placement::Replicate);
        for i in order {
            let ((slot, entry), whole_slot) = (&entries[i], &whole_layout.slots[i]);
            if partial.is_some_and(|p| p.contains(&slot.id)) {
                continue;
            }
            let reference = match entry.on(Axis::Fsdp) {
                Placement::Replicate => &whole_grads,
                _ => summed,
            };
            let held = entry.held(|axis| ctx.coord(axis));
            let mine = &split_grads[slot.offset..slot.offset + slot.numel];
            let all = &reference[whole_slot.offset..whole_slot.offset + whole_slot.numel];
            // A gradient that is zero in exact arithmetic (a key bias under softmax) is
            // rounding on both sides: measured against the model's largest gradient too.
            let scale = all
                .iter()
                .fold(0f32, |m, g| m.max(g.abs()))
                .max(1e-3 * largest);
            let difference = box_difference(mine, &slot.shape, all, &whole_slot.shape, &held);
            check.compared += 1;
            check.max_gradient_difference = check.max_gradient_difference.max(difference / scale);
            if difference > tolerance * scale {
                return Err(ParallelError::Invalid(format!(
                    "check_split: `{}`'s gradient on this rank differs from the whole model's \
                     by {difference:e} (of {scale:e}) on the same data: the layer holding it \
                     does not compute what it computes whole. A layer split over tp must \
                     compute with its part (flashover::nn::Linear, not Burn's Linear) and take \
                     its sizes from the split (attention heads from the query projection's \
                     width on this rank, not from the configuration); losses {split_loss} \
                     split, {whole_loss} whole",
                    slot.name
                )));
            }
        }
        let loss_scale = whole_loss.abs().max(1e-12);
        if (split_loss - whole_loss).abs() > tolerance * loss_scale {
            return Err(ParallelError::Invalid(format!(
                "check_split: this rank's loss is {split_loss} split and {whole_loss} whole on \
                 the same data: a layer does not compute what it computes whole (its \
                 parameters' gradients agreed, so it holds none this check compares: one \
                 sharded over fsdp, or a whole layer reading a split value)"
            )));
        }
        Ok(check)
    }
}

/// `loss(model)` and the gradients of every parameter of `model` laid end to end (zero where a
/// parameter has none), on the host's terms: the loss read once.
fn loss_and_flat_grads<M: Module>(model: &M, loss: &impl Fn(&M) -> Tensor<1>) -> (f32, Tensor<1>) {
    let value = loss(model);
    let read = read_scalar(value.clone(), Cause::SetUp);
    let device = value.device().inner();
    let grads = GradientsParams::from_grads(value.backward(), model);
    let (flat, _) = accumulate_grads(model, &grads, zero_grads(model, &device), &[]);
    (read, flat)
}

/// The largest absolute difference between `part` (shape `part_shape`, this rank's piece,
/// padding rows included) and the box of `whole` (shape `whole_shape`) that `held` places it
/// at, over the box's real extents.
fn box_difference(
    part: &[f32],
    part_shape: &[usize],
    whole: &[f32],
    whole_shape: &[usize],
    held: &crate::placement::Held,
) -> f32 {
    let strides = |shape: &[usize]| {
        let mut s = vec![1; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            s[d] = s[d + 1] * shape[d + 1];
        }
        s
    };
    let (part_strides, whole_strides) = (strides(part_shape), strides(whole_shape));
    let count: usize = held.extents.iter().product();
    let mut worst = 0f32;
    for i in 0..count {
        // `i`'s coordinates in the box, row-major.
        let (mut rest, mut at_part, mut at_whole) = (i, 0, 0);
        for d in (0..held.extents.len()).rev() {
            let c = rest % held.extents[d];
            rest /= held.extents[d];
            at_part += c * part_strides[d];
            at_whole += (held.offsets[d] + c) * whole_strides[d];
        }
        worst = worst.max((part[at_part] - whole[at_whole]).abs());
    }
    worst
}
