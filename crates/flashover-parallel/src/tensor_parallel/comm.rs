//! Megatron's differentiable communication operators over the tensor-parallel group.
//!
//! Each is one pair of the crate's private `collective_op` module: a tensor function forward
//! and its conjugate backward, on the tensor's device, in its dtype.
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
//! Burn is not a correct *g* (its backward would all-reduce again). Identity and slicing are
//! Burn ops (no transfer); the collectives go through
//! [`flashover_runtime::TensorCollectives`], where any staging the engine needs happens.

use crate::collective_op::{TensorFn, collective_pair, identity, ok, tensor_fn};
use burn::tensor::Tensor;
use flashover_comm::{Group, ReduceOp};
use flashover_runtime::TensorCollectives;

/// All-reduce (sum) over `group`.
fn all_reduce<const D: usize>(group: &Group) -> TensorFn {
    let g = group.clone();
    tensor_fn::<D>(move |t| ok(g.all_reduce_tensor(t, ReduceOp::Sum)))
}

/// Every rank's tensor concatenated along `dim`, in rank order.
fn all_gather<const D: usize>(group: &Group, dim: usize) -> TensorFn {
    let g = group.clone();
    tensor_fn::<D>(move |t| ok(g.all_gather_tensor(t, dim)))
}

/// Rank `r` keeps slice `r` along `dim` of the sum over ranks.
fn reduce_scatter<const D: usize>(group: &Group, dim: usize) -> TensorFn {
    let g = group.clone();
    tensor_fn::<D>(move |t| ok(g.reduce_scatter_tensor(t, dim, ReduceOp::Sum)))
}

/// This rank's slice of `group.size()` equal slices along `dim`.
fn own_slice<const D: usize>(group: &Group, dim: usize) -> TensorFn {
    let (rank, n) = (group.rank(), group.size());
    tensor_fn::<D>(move |t| {
        let part = t.dims()[dim] / n;
        t.narrow(dim, rank * part, part)
    })
}

/// Megatron's *f*: identity forward, all-reduce of the gradient over `group` backward. Put it
/// where a replicated activation enters a column-parallel region.
pub fn copy_to_tp<const D: usize>(x: Tensor<D>, group: &Group) -> Tensor<D> {
    collective_pair(x, identity(), all_reduce::<D>(group))
}

/// Megatron's *g*: all-reduce forward, identity backward. Put it where partial sums leave a
/// row-parallel region.
pub fn reduce_from_tp<const D: usize>(x: Tensor<D>, group: &Group) -> Tensor<D> {
    collective_pair(x, all_reduce::<D>(group), identity())
}

/// All-gather along `dim` forward; backward keeps this rank's slice of the gradient.
pub fn gather_from_tp<const D: usize>(x: Tensor<D>, dim: usize, group: &Group) -> Tensor<D> {
    collective_pair(x, all_gather::<D>(group, dim), own_slice::<D>(group, dim))
}

/// Keeps this rank's slice along `dim` forward; backward all-gathers the gradient.
pub fn scatter_to_tp<const D: usize>(x: Tensor<D>, dim: usize, group: &Group) -> Tensor<D> {
    collective_pair(x, own_slice::<D>(group, dim), all_gather::<D>(group, dim))
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

/// [`scatter_to_tp`] whose backward divides the gathered gradient by `scale`, and
/// [`gather_from_tp`] whose backward multiplies its slice by `scale`: around a part of a model
/// whose ranks of `group` compute on different positions of the same samples, each a partial
/// gradient that the data-parallel reduction averages (over `cp`) rather than sums. Scaling
/// inside by the group's size makes the average the sum; outside, every rank computes the
/// whole, as the average expects.
pub(crate) fn scatter_to_tp_scaled<const D: usize>(
    x: Tensor<D>,
    dim: usize,
    group: &Group,
    scale: f32,
) -> Tensor<D> {
    let g = group.clone();
    let unscale = tensor_fn::<D>(move |t| ok(g.all_gather_tensor(t, dim)).div_scalar(scale));
    collective_pair(x, own_slice::<D>(group, dim), unscale)
}

/// See [`scatter_to_tp_scaled`].
pub(crate) fn gather_from_tp_scaled<const D: usize>(
    x: Tensor<D>,
    dim: usize,
    group: &Group,
    scale: f32,
) -> Tensor<D> {
    let (rank, n) = (group.rank(), group.size());
    let rescale = tensor_fn::<D>(move |t| {
        let part = t.dims()[dim] / n;
        t.narrow(dim, rank * part, part).mul_scalar(scale)
    });
    collective_pair(x, all_gather::<D>(group, dim), rescale)
}

/// Reduce-scatter along `dim` forward (sequence parallel's exit from a row-parallel region);
/// backward all-gathers the gradient.
pub fn reduce_scatter_to_tp<const D: usize>(x: Tensor<D>, dim: usize, group: &Group) -> Tensor<D> {
    collective_pair(
        x,
        reduce_scatter::<D>(group, dim),
        all_gather::<D>(group, dim),
    )
}

/// All-gather along `dim` forward (sequence parallel's entry into a column-parallel region);
/// backward reduce-scatters the gradient.
pub fn gather_from_sp<const D: usize>(x: Tensor<D>, dim: usize, group: &Group) -> Tensor<D> {
    collective_pair(
        x,
        all_gather::<D>(group, dim),
        reduce_scatter::<D>(group, dim),
    )
}
