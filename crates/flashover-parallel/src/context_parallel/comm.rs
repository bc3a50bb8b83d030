//! The context-parallel group's differentiable exchanges: the ring pass of key/value blocks
//! and Ulysses' sequence/head all-to-alls. Each is a [`crate::collective_op`] pair: an
//! all-to-all on the tensor (through [`flashover_runtime::TensorCollectives`]) between Burn
//! ops that lay its blocks out, and the conjugate exchange backward.

use crate::collective_op::{TensorFn, collective_pair, computed, ok, tensor_fn};
use burn::tensor::Tensor;
use flashover_comm::Group;
use flashover_runtime::TensorCollectives;

/// Sends `x` to the rank `hops` after this one on the ring and returns what the rank `hops`
/// before sent (`hops` may be negative). One all-to-all with a single non-empty segment each
/// way, so every engine (NCCL's blocking send included) runs it as one call. `x` is moved
/// whole: its dim 0 is one block of rows.
pub(crate) fn ring_shift<const D: usize>(group: &Group, x: Tensor<D>, hops: isize) -> Tensor<D> {
    let n = group.size();
    if n == 1 {
        return x;
    }
    let r = group.rank();
    let step = hops.rem_euclid(n as isize) as usize;
    let (dst, src) = ((r + step) % n, (r + n - step) % n);
    let rows = x.dims()[0];
    let (mut send, mut recv) = (vec![0; n], vec![0; n]);
    send[dst] = rows;
    recv[src] = rows;
    ok(group.all_to_all_tensor(x, &send, &recv))
}

/// [`ring_shift`] by `hops` as an op's function.
fn shift<const D: usize>(group: &Group, hops: isize) -> TensorFn {
    let g = group.clone();
    tensor_fn::<D>(move |t| ring_shift(&g, t, hops))
}

/// The previous ring rank's `x`; backward sends the gradient back to it. `x` goes to the next
/// rank.
pub fn ring_pass<const D: usize>(x: Tensor<D>, group: &Group) -> Tensor<D> {
    collective_pair(x, shift::<D>(group, 1), shift::<D>(group, -1))
}

/// [`ring_pass`] whose forward exchange already ran (on a communication stream, overlapped with the
/// previous block's attention): `received` is what it returned for `x`'s values (untracked).
pub(crate) fn ring_passed<const D: usize>(
    x: Tensor<D>,
    received: Tensor<D>,
    group: &Group,
) -> Tensor<D> {
    collective_pair(x, computed(received), shift::<D>(group, -1))
}

/// `[batch, heads, local_seq, hd]` -> `[batch, heads / n, n x local_seq, hd]`: rank `j` gets
/// head group `j` of every rank's positions, in rank order along the sequence.
fn sequence_to_heads_on(group: &Group, x: Tensor<4>) -> Tensor<4> {
    let n = group.size();
    let [b, h, t, hd] = x.dims();
    let hc = h / n;
    // Head group j of every batch row, laid end to end per destination rank j.
    let send = x.reshape([b, n, hc, t, hd]).swap_dims(0, 1);
    let counts = vec![1; n];
    let recv = ok(group.all_to_all_tensor(send, &counts, &counts));
    // recv: per source rank j, [b, hc, t, hd] of j's positions.
    recv.permute([1, 2, 0, 3, 4]).reshape([b, hc, n * t, hd])
}

/// The inverse of [`sequence_to_heads_on`].
fn heads_to_sequence_on(group: &Group, x: Tensor<4>) -> Tensor<4> {
    let n = group.size();
    let [b, hc, nt, hd] = x.dims();
    let t = nt / n;
    // Rank j's positions of this head group, per destination rank j.
    let send = x.reshape([b, hc, n, t, hd]).permute([2, 0, 1, 3, 4]);
    let counts = vec![1; n];
    let recv = ok(group.all_to_all_tensor(send, &counts, &counts));
    // recv: per source rank j, its head group's [b, hc, t, hd] for this rank's positions.
    recv.swap_dims(0, 1).reshape([b, n * hc, t, hd])
}

/// Ulysses' first all-to-all: `[batch, heads, local_seq, hd]` with this rank's positions ->
/// `[batch, heads / cp, seq, hd]` with head group `rank` of the whole sequence (rank-major
/// positions). Backward is [`heads_to_sequence`]'s exchange.
pub fn sequence_to_heads(x: Tensor<4>, group: &Group) -> Tensor<4> {
    let (g, g2) = (group.clone(), group.clone());
    collective_pair(
        x,
        tensor_fn::<4>(move |t| sequence_to_heads_on(&g, t)),
        tensor_fn::<4>(move |t| heads_to_sequence_on(&g2, t)),
    )
}

/// Ulysses' second all-to-all, the inverse of [`sequence_to_heads`].
pub fn heads_to_sequence(x: Tensor<4>, group: &Group) -> Tensor<4> {
    let (g, g2) = (group.clone(), group.clone());
    collective_pair(
        x,
        tensor_fn::<4>(move |t| heads_to_sequence_on(&g, t)),
        tensor_fn::<4>(move |t| sequence_to_heads_on(&g2, t)),
    )
}
