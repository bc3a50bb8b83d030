//! Layer stacks that split their whole input by position themselves (a plan's
//! `sequence_split_stacks`): Burn's encoder and decoder take and return whole sequences, so the
//! drop-ins keep that contract and run their layers on this rank's positions in between: over
//! `tp` under sequence parallelism, as Megatron's blocks run on theirs, or over `cp` under a
//! `context_parallel` rule, their attention swapping positions for heads (all-to-all).
//!
//! While a stack's layers run, this rank's thread knows which positions it holds: its
//! dropout places masks by them, and a split layer of such a stack checks it runs inside one
//! (called outside, as a pipeline stage calls a layer, it would read whole sequences as its
//! positions).

use crate::placed::{ContextSplit, TpSplit, context_split, placed_name, tp_split};
use crate::tensor_parallel::comm::{
    gather_from_tp, gather_from_tp_scaled, scatter_to_tp, scatter_to_tp_scaled,
};
use burn::module::Param;
use burn::tensor::Tensor;
use flashover_comm::Group;
use std::cell::Cell;

/// How a stack splits its sequences.
#[derive(Clone, Copy)]
pub(crate) enum StackSplit<'a> {
    /// Over `tp`, between the split layers (sequence parallelism).
    Tensor(&'a Group),
    /// Over `cp` (context parallelism).
    Context(&'a ContextSplit),
}

impl StackSplit<'_> {
    /// The stack whose first layer computes with `weight` (a split layer's), if the plan
    /// makes it one that splits sequences.
    pub(crate) fn of(weight: &Param<Tensor<2>>) -> Option<StackSplit<'_>> {
        let sp = tp_split(weight).filter(|s| s.sequence_parallel && s.in_splitting_stack);
        match sp {
            Some(split) => Some(StackSplit::Tensor(&split.group)),
            None => context_split(weight).map(StackSplit::Context),
        }
    }

    fn group(&self) -> &Group {
        match self {
            StackSplit::Tensor(group) => group,
            StackSplit::Context(split) => &split.group,
        }
    }

    /// `x: [batch, seq, d]`, whole and the same on every rank of the group, cut to this rank's
    /// positions (a contiguous chunk; its gradient gathered whole in backward, as every rank
    /// computes the same upstream). Panics when the sequence does not split evenly.
    pub(crate) fn split(&self, x: Tensor<3>, what: &str) -> Tensor<3> {
        let [_, seq, _] = x.dims();
        let (group, n) = (self.group(), self.group().size());
        assert!(
            seq.is_multiple_of(n),
            "{what}: the plan splits each sequence over {n} ranks, and {seq} positions do not \
             split evenly: pad the sequences to a multiple of {n}"
        );
        match self {
            StackSplit::Tensor(_) => scatter_to_tp(x, 1, group),
            // The cp ranks' gradients inside are partial sums of the positions each holds,
            // which the reduction averages: scaled up inside, back down here.
            StackSplit::Context(_) => scatter_to_tp_scaled(x, 1, group, n as f32),
        }
    }

    /// The whole sequences of every rank's positions `x` (backward keeps this rank's part of
    /// the gradient, as every rank computes the same downstream).
    pub(crate) fn join(&self, x: Tensor<3>) -> Tensor<3> {
        let (group, n) = (self.group(), self.group().size());
        match self {
            StackSplit::Tensor(_) => gather_from_tp(x, 1, group),
            StackSplit::Context(_) => gather_from_tp_scaled(x, 1, group, n as f32),
        }
    }

    /// `f()` as the stack's layers run on this rank's positions of sequences `local` long.
    pub(crate) fn run<R>(&self, local: usize, f: impl FnOnce() -> R) -> R {
        let first = self.group().rank() * local;
        let over_cp = matches!(self, StackSplit::Context(_));
        let before = HELD.with(|p| p.replace(Some((first, over_cp))));
        let out = f();
        HELD.with(|p| p.set(before));
        out
    }
}

thread_local! {
    /// While a splitting stack's layers run: the first position this rank holds, and whether
    /// the stack splits over `cp` (inside `tp` regions the sequence is whole again under
    /// sequence parallelism, not under context parallelism).
    static HELD: Cell<Option<(usize, bool)>> = const { Cell::new(None) };
}

/// The first sequence position this rank's activations hold inside a splitting stack's
/// forward, and whether the stack splits over `cp`; `None` outside one.
pub(crate) fn held_positions() -> Option<(usize, bool)> {
    HELD.with(Cell::get)
}

/// Panics, naming the layer, when a split layer of a splitting stack runs outside the stack's
/// forward: its input would be whole sequences, which it would take for this rank's positions.
pub(crate) fn check_inside_stack(weight: &Param<Tensor<2>>, split: &TpSplit) {
    if split.in_splitting_stack {
        refuse_outside_stack(weight);
    }
}

/// Panics, naming `weight`'s layer, outside a splitting stack's forward.
pub(crate) fn refuse_outside_stack(weight: &Param<Tensor<2>>) {
    if held_positions().is_none() {
        panic!(
            "`{}` is in a sequence_split_stacks stack, but ran outside the stack's forward (a \
             pipeline stage calling its layers one by one does): only the stack splits whole \
             sequences by position. Call the stack's forward, or drop the stack from \
             sequence_split_stacks",
            placed_name(weight).unwrap_or("a linear layer")
        );
    }
}
