//! Layer stacks that split their whole input by sequence themselves, under sequence
//! parallelism (a plan's `sequence_parallel_inputs`): Burn's encoder and decoder take and
//! return whole sequences, so the drop-ins keep that contract and run their layers on this
//! rank's positions in between, as Megatron's blocks run on theirs.
//!
//! While a stack's layers run, this rank's thread knows which positions it holds: its
//! dropout places masks by them, and a split layer of such a stack checks it runs inside one
//! (called outside, as a pipeline stage calls a layer, it would read whole sequences as its
//! positions).

use crate::parallelize::{TpSplit, placed_name};
use crate::tensor_parallel::comm::{gather_from_tp, scatter_to_tp};
use burn::module::Param;
use burn::tensor::Tensor;
use flashover_comm::Group;
use std::cell::Cell;

thread_local! {
    /// The first position this rank holds while a splitting stack's layers run.
    static FIRST_POSITION: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The first sequence position this rank's activations hold, inside a splitting stack's
/// forward; `None` outside one.
pub(crate) fn first_position() -> Option<usize> {
    FIRST_POSITION.with(Cell::get)
}

/// The `tp` group a stack whose first split layer has `split` splits its input over, when the
/// plan makes it a splitting stack.
pub(crate) fn splitting_group(split: Option<&TpSplit>) -> Option<&Group> {
    split
        .filter(|s| s.sequence_parallel && s.in_splitting_stack)
        .map(|s| &s.group)
}

/// `x: [batch, seq, d]`, whole and the same on every rank of `group`, cut to this rank's
/// positions (its gradient gathered whole in backward, as every rank computes the same
/// upstream). Panics when the sequence does not split evenly.
pub(crate) fn split(x: Tensor<3>, group: &Group, what: &str) -> Tensor<3> {
    let [_, seq, _] = x.dims();
    let n = group.size();
    assert!(
        seq.is_multiple_of(n),
        "{what}: sequence parallelism splits each sequence over tp={n}, and {seq} positions do \
         not split evenly: pad the sequences to a multiple of {n}"
    );
    scatter_to_tp(x, 1, group)
}

/// The whole sequences of every rank's positions `x` (backward keeps this rank's part of the
/// gradient, as every rank computes the same downstream).
pub(crate) fn join(x: Tensor<3>, group: &Group) -> Tensor<3> {
    gather_from_tp(x, 1, group)
}

/// `f()` as a splitting stack's layers run, on this rank's positions from `first`.
pub(crate) fn in_stack<R>(first: usize, f: impl FnOnce() -> R) -> R {
    let before = FIRST_POSITION.with(|p| p.replace(Some(first)));
    let out = f();
    FIRST_POSITION.with(|p| p.set(before));
    out
}

/// Panics, naming the layer, when a split layer of a splitting stack runs outside the stack's
/// forward: its input would be whole sequences, which it would take for this rank's positions.
pub(crate) fn check_inside_stack(weight: &Param<Tensor<2>>, split: &TpSplit) {
    if split.in_splitting_stack && first_position().is_none() {
        panic!(
            "`{}` is split over tp inside a sequence_parallel_inputs stack, but ran outside the \
             stack's forward (a pipeline stage calling its layers one by one does): only the \
             stack splits whole sequences by position. Call the stack's forward, or drop the \
             stack from sequence_parallel_inputs",
            placed_name(weight).unwrap_or("a linear layer")
        );
    }
}
