//! The context-parallel group's differentiable exchanges: the ring pass of key/value blocks
//! and Ulysses' sequence/head all-to-alls. Each is a forward host function and its conjugate
//! backward (the tensor-parallel operators' mechanism, so Flex only).

use crate::tensor_parallel::comm::{host, host_pair, ok, values};
use burn::tensor::{Tensor, TensorData};
use flashover_comm::{CommunicatorExt, Group};
use std::sync::{Arc, Mutex};

/// Sends `data` to the rank `hops` after this one on the ring and returns what the rank
/// `hops` before sent (`hops` may be negative). One all-to-all with a single non-empty
/// segment each way, so every engine (NCCL's blocking send included) runs it as one call.
pub(crate) fn ring_shift(group: &Group, data: TensorData, hops: isize) -> TensorData {
    let (v, shape) = values(data);
    let n = group.size();
    if n == 1 {
        return TensorData::new(v, shape);
    }
    let r = group.rank();
    let step = hops.rem_euclid(n as isize) as usize;
    let (dst, src) = ((r + step) % n, (r + n - step) % n);
    let mut send_counts = vec![0; n];
    let mut recv_counts = vec![0; n];
    send_counts[dst] = v.len();
    recv_counts[src] = v.len();
    let mut out = vec![0.0f32; v.len()];
    ok(group.all_to_all_v(&v, &send_counts, &mut out, &recv_counts));
    TensorData::new(out, shape)
}

/// The previous ring rank's `x`; backward sends the gradient back to it. `x` goes to the next
/// rank.
pub fn ring_pass<const D: usize>(x: Tensor<D>, group: &Group) -> Tensor<D> {
    let (g, g2) = (group.clone(), group.clone());
    host_pair(
        x,
        host(move |d| ring_shift(&g, d, 1)),
        host(move |d| ring_shift(&g2, d, -1)),
    )
}

/// [`ring_pass`] whose forward exchange already ran (on a helper thread, overlapped with the
/// previous block's attention): `received` is what it returned for `x`.
pub(crate) fn ring_passed<const D: usize>(
    x: Tensor<D>,
    received: TensorData,
    group: &Group,
) -> Tensor<D> {
    let g = group.clone();
    let received = Arc::new(Mutex::new(Some(received)));
    host_pair(
        x,
        host(move |_| {
            received
                .lock()
                .expect("ring pass")
                .take()
                .expect("a prefetched ring pass runs its forward once")
        }),
        host(move |d| ring_shift(&g, d, -1)),
    )
}

/// `[batch, heads, local_seq, hd]` -> `[batch, heads / n, n x local_seq, hd]`: rank `j` gets
/// head group `j` of every rank's positions, in rank order along the sequence.
fn sequence_to_heads_host(group: &Group, data: TensorData) -> TensorData {
    let (v, shape) = values(data);
    let n = group.size();
    let [b, h, t, hd] = [shape[0], shape[1], shape[2], shape[3]];
    let hc = h / n;
    let block = hc * t * hd;
    let mut send = Vec::with_capacity(v.len());
    for j in 0..n {
        for bi in 0..b {
            let start = (bi * h + j * hc) * t * hd;
            send.extend_from_slice(&v[start..start + block]);
        }
    }
    let counts = vec![b * block; n];
    let mut recv = vec![0.0f32; v.len()];
    ok(group.all_to_all_v(&send, &counts, &mut recv, &counts));
    // recv: per source rank j, [b, hc, t, hd] of j's positions.
    let mut out = vec![0.0f32; v.len()];
    for j in 0..n {
        for bi in 0..b {
            for hh in 0..hc {
                let from = ((j * b + bi) * hc + hh) * t * hd;
                let to = ((bi * hc + hh) * n * t + j * t) * hd;
                out[to..to + t * hd].copy_from_slice(&recv[from..from + t * hd]);
            }
        }
    }
    TensorData::new(out, [b, hc, n * t, hd])
}

/// The inverse of [`sequence_to_heads_host`].
fn heads_to_sequence_host(group: &Group, data: TensorData) -> TensorData {
    let (v, shape) = values(data);
    let n = group.size();
    let (b, hc, hd) = (shape[0], shape[1], shape[3]);
    let t = shape[2] / n;
    let mut send = Vec::with_capacity(v.len());
    for j in 0..n {
        for bi in 0..b {
            for hh in 0..hc {
                let start = ((bi * hc + hh) * n * t + j * t) * hd;
                send.extend_from_slice(&v[start..start + t * hd]);
            }
        }
    }
    let counts = vec![b * hc * t * hd; n];
    let mut recv = vec![0.0f32; v.len()];
    ok(group.all_to_all_v(&send, &counts, &mut recv, &counts));
    // recv: per source rank j, its head group's [b, hc, t, hd] for this rank's positions.
    let h = hc * n;
    let mut out = vec![0.0f32; v.len()];
    for j in 0..n {
        for bi in 0..b {
            let from = j * b * hc * t * hd + bi * hc * t * hd;
            let to = (bi * h + j * hc) * t * hd;
            out[to..to + hc * t * hd].copy_from_slice(&recv[from..from + hc * t * hd]);
        }
    }
    TensorData::new(out, [b, h, t, hd])
}

/// Ulysses' first all-to-all: `[batch, heads, local_seq, hd]` with this rank's positions ->
/// `[batch, heads / cp, seq, hd]` with head group `rank` of the whole sequence (rank-major
/// positions). Backward is [`heads_to_sequence`]'s exchange.
pub fn sequence_to_heads(x: Tensor<4>, group: &Group) -> Tensor<4> {
    let (g, g2) = (group.clone(), group.clone());
    host_pair(
        x,
        host(move |d| sequence_to_heads_host(&g, d)),
        host(move |d| heads_to_sequence_host(&g2, d)),
    )
}

/// Ulysses' second all-to-all, the inverse of [`sequence_to_heads`].
pub fn heads_to_sequence(x: Tensor<4>, group: &Group) -> Tensor<4> {
    let (g, g2) = (group.clone(), group.clone());
    host_pair(
        x,
        host(move |d| heads_to_sequence_host(&g, d)),
        host(move |d| sequence_to_heads_host(&g2, d)),
    )
}
