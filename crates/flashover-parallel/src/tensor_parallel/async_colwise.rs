//! Megatron's asynchronous tensor parallelism in backward, for column-parallel layers: the
//! layer's backward computes its input's gradient first, hands the gradient's all-reduce over
//! `tp` to the group's communication stream, computes its weight's gradient while that runs,
//! and only then waits. Forward it is `x W` on the whole input, what *f* (identity forward,
//! all-reduce backward) followed by the product computes, in one op.
//!
//! Every rank's backward submits the same all-reduces in the same order, and waits for each
//! before its next collective on `tp`, so the stream and the computing thread never use the
//! group at once. Without sequence parallelism only: with it the entry is an all-gather whose
//! backward reduce-scatters, which stays [`super::TensorParallel::enter`]'s.

use crate::collective_op::{from_tensor, matmul, ok, to_tensor};
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn::backend::Cube;
use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension, tensor::FloatTensor};
use burn::tensor::Tensor;
use burn_dispatch::{DispatchKindConversion, DispatchTensor};
use flashover_comm::ReduceOp;
use flashover_runtime::{CommStream, TensorCollectives};
use std::sync::Arc;

/// The `tp` group's communication stream, as an op's argument.
#[derive(Clone, Debug)]
pub(crate) struct TpStream(pub(crate) Arc<CommStream>);

/// What one product keeps for its backward: its input and weight (untracked tensors of the
/// inner backend) and the stream.
#[derive(Clone, Debug)]
struct Saved {
    input: Tensor<2>,
    weight: Tensor<2>,
    stream: TpStream,
}

#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub(crate) trait ColwiseOps: Backend {
    /// Forward: `x W` (`x: [n, d_in]` whole on every rank, `W: [d_in, d_out / tp]`).
    /// Backward: `dx = dy W^T` all-reduced over `tp` on `stream` while `dW = x^T dy` is
    /// computed.
    fn colwise_matmul(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        stream: TpStream,
    ) -> FloatTensor<Self>;
}

impl ColwiseOps for Flex {
    fn colwise_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        _: TpStream,
    ) -> FloatTensor<Self> {
        matmul::<Self>(x, w)
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl ColwiseOps for Cube {
    fn colwise_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        _: TpStream,
    ) -> FloatTensor<Self> {
        matmul::<Self>(x, w)
    }
}

#[derive(Debug)]
struct ColwiseBackward;

impl<B: Backend> Backward<B, 2> for ColwiseBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = Saved;

    // Runs inside Burn's backward, which cannot return errors: a failed collective panics
    // with the `CommError` as payload, which the launcher reports like a returned error.
    fn backward(self, ops: Ops<Saved, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [input_node, weight_node] = ops.parents;
        let saved = ops.state;
        let dy = to_tensor::<B, 2>(grads.consume::<B>(&ops.node));
        // The input's gradient first: its all-reduce runs while the weight's is computed.
        let reduced = input_node.as_ref().map(|_| {
            let partial = dy.clone().matmul(saved.weight.transpose());
            (saved.stream.0).submit(move |tp| tp.all_reduce_tensor(partial, ReduceOp::Sum))
        });
        if let Some(node) = weight_node {
            let dw = saved.input.transpose().matmul(dy);
            grads.register::<B>(node.id, from_tensor::<B, 2>(dw));
        }
        if let (Some(node), Some(reduced)) = (input_node, reduced) {
            grads.register::<B>(node.id, from_tensor::<B, 2>(ok(reduced.wait())));
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> ColwiseOps for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn colwise_matmul(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        stream: TpStream,
    ) -> FloatTensor<Self> {
        let nodes = [x.node(), weight.node()];
        let (input, weight) = (x.into_primitive(), weight.into_primitive());
        let out = matmul::<B>(input.clone(), weight.clone());
        match ColwiseBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                Saved {
                    input: to_tensor::<B, 2>(input),
                    weight: to_tensor::<B, 2>(weight),
                    stream,
                },
                out,
            ),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

/// `x W` for `x: [.., d_in]` whole on every `tp` rank and `weight` a column-wise layer's
/// part, the input's gradient all-reduced on `stream` while the weight's is computed.
pub(crate) fn colwise_product<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    stream: &Arc<CommStream>,
) -> Tensor<D> {
    let mut dims = x.dims();
    let d_in = dims[D - 1];
    let rows = dims[..D - 1].iter().product();
    dims[D - 1] = weight.dims()[1];
    let y: Tensor<2> = Tensor::from_dispatch(<Dispatch as ColwiseOps>::colwise_matmul(
        x.reshape([rows, d_in]).into_dispatch(),
        weight.into_dispatch(),
        TpStream(stream.clone()),
    ));
    y.reshape(dims)
}
