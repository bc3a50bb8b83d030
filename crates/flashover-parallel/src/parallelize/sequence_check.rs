//! Under sequence parallelism, a whole parameter that runs on this rank's positions must be
//! named in the plan's `sequence_parallel` (its gradient is then summed over `tp`); one that is
//! not would silently train a different model on each `tp` rank. Every other whole parameter
//! computes on the same values on every `tp` rank, so its gradients agree there: the first
//! step compares them over `tp` and refuses, naming the parameter, where they do not.

use crate::error::ParallelError;
use crate::params::{ParamSlot, part, to_f32};
use crate::placement::{ParamPlacement, Placement};
use burn::module::ParamId;
use burn::tensor::Tensor;
use flashover_comm::{Group, ReduceOp};
use flashover_runtime::{Axis, TensorCollectives};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};

/// The first-step check (see the module docs).
pub(super) struct SequenceCheck {
    /// The `tp` group.
    pub(super) tp: Group,
    /// The parameters the plan marks as running on sequence shards.
    pub(super) partial: HashSet<ParamId>,
    done: AtomicBool,
}

impl SequenceCheck {
    pub(super) fn new(tp: Group, partial: HashSet<ParamId>) -> Self {
        SequenceCheck {
            tp,
            partial,
            done: AtomicBool::new(false),
        }
    }

    /// On the first call: compares over `tp` the local gradients `flat` (before any
    /// reduction) of the whole parameters among `entries` the plan does not mark, and fails
    /// naming the first that differs. Collective over `tp` on that call only.
    pub(super) fn first_step(
        &self,
        entries: &[(ParamSlot, &ParamPlacement)],
        flat: &Tensor<1>,
    ) -> Result<(), ParallelError> {
        if self.done.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let whole: Vec<&(ParamSlot, &ParamPlacement)> = entries
            .iter()
            .filter(|(slot, entry)| {
                entry.on(Axis::Tp) == Placement::Replicate && !self.partial.contains(&slot.id)
            })
            .collect();
        if whole.is_empty() {
            return Ok(());
        }
        let local = Tensor::cat(
            (whole.iter())
                .map(|(slot, _)| part(flat, slot.offset, slot.numel))
                .collect(),
            0,
        );
        // The verdict is the host's: both extremes are read back once, on the first step.
        let max = to_f32(self.tp.all_reduce_tensor(local.clone(), ReduceOp::Max)?);
        let min = to_f32(self.tp.all_reduce_tensor(local, ReduceOp::Min)?);
        let mut at = 0;
        for (slot, _) in whole {
            let range = at..at + slot.numel;
            at += slot.numel;
            let scale = max[range.clone()]
                .iter()
                .chain(&min[range.clone()])
                .fold(0f32, |m, g| m.max(g.abs()));
            let spread = range.map(|i| max[i] - min[i]).fold(0f32, f32::max);
            if spread > 1e-4 * scale.max(1e-12) {
                return Err(ParallelError::Invalid(format!(
                    "sequence parallelism: `{}` is whole on every tp rank, but its gradient \
                     differs between them (by {spread:e}): it runs on this rank's positions \
                     only, so name its module in the plan's sequence_parallel (norms, \
                     position embeddings: everything whole between the split layers)",
                    slot.name
                )));
            }
        }
        Ok(())
    }
}
