//! A parameter the plan leaves whole on every `tp` rank is computed on the same values on each
//! of them, so its gradient agrees there, bit for bit in every exact layout. Where it does not,
//! the `tp` ranks are silently training different models, so the first step compares these
//! gradients over `tp` (before any is applied) and refuses, naming the first parameter that
//! differs. Two mistakes make them differ: under sequence parallelism, a whole parameter that
//! runs on this rank's positions but is not named in the plan's `sequence_parallel` (its
//! gradient must be summed over `tp`); and, with or without it, anything in the forward that
//! computes differently on each `tp` rank, such as Burn's `Dropout`, which draws every rank's
//! mask from its own device generator.

use crate::error::ParallelError;
use crate::params::{ParamSlot, checked_f32, part};
use crate::placement::{ParamPlacement, Placement};
use crate::precision::Precision;
use burn::module::ParamId;
use burn::tensor::Tensor;
use flashover_comm::{Group, ReduceOp};
use flashover_runtime::{Axis, TensorCollectives};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};

/// The first-step check (see the module docs).
pub(super) struct ReplicaCheck {
    /// The `tp` group.
    pub(super) tp: Group,
    /// Whether the plan runs sequence parallelism.
    pub(super) sequence_parallel: bool,
    /// The parameters the plan marks as running on sequence shards.
    pub(super) partial: HashSet<ParamId>,
    /// The spread refused, relative to the gradient's largest element.
    tolerance: f32,
    done: AtomicBool,
}

impl ReplicaCheck {
    /// The check over `tp`, computing in `compute` (the plan's compute dtype).
    pub(super) fn new(
        tp: Group,
        sequence_parallel: bool,
        partial: HashSet<ParamId>,
        compute: Precision,
    ) -> Self {
        // What it looks for differs by a large part of a gradient (a tenth of the elements
        // dropped differently, a norm's gradient from part of the sequence); the ranks' own
        // rounding, where their devices pick different kernels, by far less: TF32 and f32
        // within 1e-2, bf16 and f16 within 5e-2.
        let tolerance = match compute {
            Precision::F32 => 1e-2,
            _ => 5e-2,
        };
        ReplicaCheck {
            tp,
            sequence_parallel,
            partial,
            tolerance,
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
        let max = checked_f32(self.tp.all_reduce_tensor(local.clone(), ReduceOp::Max)?);
        let min = checked_f32(self.tp.all_reduce_tensor(local, ReduceOp::Min)?);
        let mut at = 0;
        for (slot, _) in whole {
            let range = at..at + slot.numel;
            at += slot.numel;
            let scale = max[range.clone()]
                .iter()
                .chain(&min[range.clone()])
                .fold(0f32, |m, g| m.max(g.abs()));
            let spread = range.map(|i| max[i] - min[i]).fold(0f32, f32::max);
            if spread > self.tolerance * scale.max(1e-12) {
                let sequence = match self.sequence_parallel {
                    true => {
                        "if it runs on this rank's positions only (norms, position \
                         embeddings: everything whole between the split layers under sequence \
                         parallelism), name its module in the plan's sequence_parallel; "
                    }
                    false => "",
                };
                return Err(ParallelError::Invalid(format!(
                    "`{}` is whole on every tp rank, but its gradient differs between them \
                     (by {spread:e} of {scale:e}) on the first step, which is not applied: \
                     the tp ranks compute different models. {sequence}if something in the \
                     forward draws random numbers on each rank (Burn's Dropout draws every \
                     rank's mask from its own device generator), use flashover::nn::Dropout, \
                     whose masks every layout draws alike, or train with dropout 0",
                    slot.name
                )));
            }
        }
        Ok(())
    }
}
