//! Megatron's differentiable communication operators over the tensor-parallel group.
//!
//! Each is one backend-extension op whose forward and backward are host functions on the
//! tensor's values (Burn 0.22.1 has no autograd functions; see the project notes' custom-backward
//! recipe). Forward and backward are conjugate:
//!
//! | op | forward | backward |
//! |---|---|---|
//! | [`copy_to_tp`] (*f*) | identity | all-reduce |
//! | [`reduce_from_tp`] (*g*) | all-reduce | identity |
//! | [`gather_from_tp`] | all-gather along a dim | keep this rank's slice |
//! | [`scatter_to_tp`] | keep this rank's slice | all-gather |
//! | [`reduce_scatter_to_tp`] | reduce-scatter along a dim | all-gather |
//!
//! Sequence parallelism uses the last two pairs along the sequence dim; the plain all-reduce of
//! Burn is not a correct *g* (its backward would all-reduce again).
//!
//! The ops run host code on the tensor's values (`crate::host`): on Flex, and on the CubeCL
//! backend (wgpu, CUDA) with the `wgpu` / `cuda` features. A failed collective inside backward
//! panics with its `CommError` (the launcher reports it like a returned error).

use crate::host;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn::backend::Cube;
use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind, unary},
};
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension, tensor::FloatTensor};
use burn::tensor::{Tensor, TensorData};
use flashover_comm::{CommError, CommunicatorExt, Group, ReduceOp};
use std::sync::Arc;

/// A host function on a tensor's values (row-major f32 with its shape).
#[derive(Clone)]
pub struct HostFn(Arc<dyn Fn(TensorData) -> TensorData + Send + Sync>);

impl std::fmt::Debug for HostFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HostFn")
    }
}

/// The one op behind the operators: a host function forward and another backward.
#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub trait TpCommOps: Backend {
    /// Forward: `forward(x)`. Backward: `backward(grad)`.
    fn host_pair(x: FloatTensor<Self>, forward: HostFn, backward: HostFn) -> FloatTensor<Self>;
}

fn on_host<B: Backend>(x: FloatTensor<B>, f: &HostFn) -> FloatTensor<B> {
    host::map::<B>(x, |d| (f.0)(d))
}

impl TpCommOps for Flex {
    fn host_pair(x: FloatTensor<Self>, forward: HostFn, _: HostFn) -> FloatTensor<Self> {
        on_host::<Self>(x, &forward)
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl TpCommOps for Cube {
    fn host_pair(x: FloatTensor<Self>, forward: HostFn, _: HostFn) -> FloatTensor<Self> {
        on_host::<Self>(x, &forward)
    }
}

#[derive(Debug)]
struct HostPairBackward;

impl<B: Backend> Backward<B, 1> for HostPairBackward {
    type State = HostFn;

    fn backward(self, ops: Ops<HostFn, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let backward = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |g| on_host::<B>(g, &backward));
    }
}

impl<B: Backend, C: CheckpointStrategy> TpCommOps for Autodiff<B, C> {
    fn host_pair(x: FloatTensor<Self>, forward: HostFn, backward: HostFn) -> FloatTensor<Self> {
        let node = x.node();
        let out = on_host::<B>(x.into_primitive(), &forward);
        match HostPairBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(backward, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

pub(crate) fn host_pair<const D: usize, const E: usize>(
    x: Tensor<D>,
    forward: HostFn,
    backward: HostFn,
) -> Tensor<E> {
    Tensor::from_dispatch(<Dispatch as TpCommOps>::host_pair(
        x.into_dispatch(),
        forward,
        backward,
    ))
}

/// Unwraps a collective's result inside an op, where errors cannot be returned.
pub(crate) fn ok<T>(r: Result<T, CommError>) -> T {
    r.unwrap_or_else(|e| std::panic::panic_any(e))
}

pub(crate) fn values(data: TensorData) -> (Vec<f32>, Vec<usize>) {
    let shape = data.shape().to_vec();
    let data = data.convert::<f32>();
    (data.as_slice::<f32>().expect("f32").to_vec(), shape)
}

/// `(outer, len, inner)`: elements before `dim`, along it, and after it.
fn split_shape(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product();
    (outer, shape[dim], inner)
}

/// All-reduce (sum) of the values.
fn all_reduce(group: &Group, data: TensorData) -> TensorData {
    let (mut v, shape) = values(data);
    ok(group.all_reduce(&mut v, ReduceOp::Sum));
    TensorData::new(v, shape)
}

/// Every rank's tensor concatenated along `dim`, in rank order.
fn all_gather(group: &Group, data: TensorData, dim: usize) -> TensorData {
    let (v, mut shape) = values(data);
    let n = group.size();
    let gathered = ok(group.all_gather_vec(&v));
    let (outer, len, inner) = split_shape(&shape, dim);
    let row = len * inner;
    let mut out = Vec::with_capacity(gathered.len());
    for o in 0..outer {
        for r in 0..n {
            let block = &gathered[r * v.len()..(r + 1) * v.len()];
            out.extend_from_slice(&block[o * row..(o + 1) * row]);
        }
    }
    shape[dim] *= n;
    TensorData::new(out, shape)
}

/// Slice `rank` of `n` equal slices along `dim`.
fn take_slice(data: TensorData, dim: usize, rank: usize, n: usize) -> TensorData {
    let (v, mut shape) = values(data);
    let (outer, len, inner) = split_shape(&shape, dim);
    let part = len / n;
    let mut out = Vec::with_capacity(v.len() / n);
    for o in 0..outer {
        let start = (o * len + rank * part) * inner;
        out.extend_from_slice(&v[start..start + part * inner]);
    }
    shape[dim] = part;
    TensorData::new(out, shape)
}

/// Rank `r` gets slice `r` along `dim` of the sum over ranks.
fn reduce_scatter(group: &Group, data: TensorData, dim: usize) -> TensorData {
    let (v, shape) = values(data);
    let n = group.size();
    // Rank-major blocks: slice r of every outer row, laid end to end.
    let mut send = Vec::with_capacity(v.len());
    for r in 0..n {
        let slice = take_slice(TensorData::new(v.clone(), shape.clone()), dim, r, n);
        send.extend(values(slice).0);
    }
    let mut own = vec![0.0; v.len() / n];
    ok(group.reduce_scatter(&send, &mut own, ReduceOp::Sum));
    let mut out_shape = shape;
    out_shape[dim] /= n;
    TensorData::new(own, out_shape)
}

pub(crate) fn host(f: impl Fn(TensorData) -> TensorData + Send + Sync + 'static) -> HostFn {
    HostFn(Arc::new(f))
}

/// Megatron's *f*: identity forward, all-reduce of the gradient over `group` backward. Put it
/// where a replicated activation enters a column-parallel region.
pub fn copy_to_tp<const D: usize>(x: Tensor<D>, group: &Group) -> Tensor<D> {
    let g = group.clone();
    host_pair(x, host(|d| d), host(move |d| all_reduce(&g, d)))
}

/// Megatron's *g*: all-reduce forward, identity backward. Put it where partial sums leave a
/// row-parallel region.
pub fn reduce_from_tp<const D: usize>(x: Tensor<D>, group: &Group) -> Tensor<D> {
    let g = group.clone();
    host_pair(x, host(move |d| all_reduce(&g, d)), host(|d| d))
}

/// All-gather along `dim` forward; backward keeps this rank's slice of the gradient.
pub fn gather_from_tp<const D: usize>(x: Tensor<D>, dim: usize, group: &Group) -> Tensor<D> {
    let (g, rank, n) = (group.clone(), group.rank(), group.size());
    host_pair(
        x,
        host(move |d| all_gather(&g, d, dim)),
        host(move |d| take_slice(d, dim, rank, n)),
    )
}

/// Keeps this rank's slice along `dim` forward; backward all-gathers the gradient.
pub fn scatter_to_tp<const D: usize>(x: Tensor<D>, dim: usize, group: &Group) -> Tensor<D> {
    let (g, rank, n) = (group.clone(), group.rank(), group.size());
    host_pair(
        x,
        host(move |d| take_slice(d, dim, rank, n)),
        host(move |d| all_gather(&g, d, dim)),
    )
}

/// `f`, a layer defined on whole sequences (a mixture of experts: routing, capacity and the
/// balancing loss are per sequence), under sequence parallelism: every `tp` rank's positions of
/// `x: [batch, seq / tp, d]` gathered along the sequence, `f` applied alike on every rank, and
/// this rank's positions of its output kept. Neither collective's backward sums the gradient,
/// as every rank computed the same.
pub fn on_whole_sequences(
    x: Tensor<3>,
    group: &Group,
    f: impl FnOnce(Tensor<3>) -> Tensor<3>,
) -> Tensor<3> {
    scatter_to_tp(f(gather_from_tp(x, 1, group)), 1, group)
}

/// Reduce-scatter along `dim` forward (sequence parallel's exit from a row-parallel region);
/// backward all-gathers the gradient.
pub fn reduce_scatter_to_tp<const D: usize>(x: Tensor<D>, dim: usize, group: &Group) -> Tensor<D> {
    let (g, g2) = (group.clone(), group.clone());
    host_pair(
        x,
        host(move |d| reduce_scatter(&g, d, dim)),
        host(move |d| all_gather(&g2, d, dim)),
    )
}

/// All-gather along `dim` forward (sequence parallel's entry into a column-parallel region);
/// backward reduce-scatters the gradient.
pub fn gather_from_sp<const D: usize>(x: Tensor<D>, dim: usize, group: &Group) -> Tensor<D> {
    let (g, g2) = (group.clone(), group.clone());
    host_pair(
        x,
        host(move |d| all_gather(&g, d, dim)),
        host(move |d| reduce_scatter(&g2, d, dim)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_tile_the_tensor_along_any_dim() {
        let data = TensorData::new((0..24).map(|i| i as f32).collect::<Vec<_>>(), [2, 3, 4]);
        let s = take_slice(data.clone(), 2, 1, 2);
        assert_eq!(s.shape().to_vec(), vec![2, 3, 2]);
        assert_eq!(
            values(s).0,
            vec![2., 3., 6., 7., 10., 11., 14., 15., 18., 19., 22., 23.]
        );
        let s = take_slice(data, 0, 1, 2);
        assert_eq!(values(s).0, (12..24).map(|i| i as f32).collect::<Vec<_>>());
    }
}
