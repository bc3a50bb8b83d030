//! Megatron's asynchronous tensor parallelism in backward, for column-parallel layers: the
//! layer's backward computes its input's gradient first, hands the gradient's collective over
//! `tp` to the group's communication stream, computes its weight's gradient while that runs,
//! and only then waits. Forward it is what the region's entry followed by the product
//! computes, in one op:
//! - without sequence parallelism *f*: `x W` on the whole input, the input's gradient
//!   all-reduced;
//! - with it, the input `[batch, seq / tp, d_in]` all-gathered along the sequence first, the
//!   gradient reduce-scattered back.
//!
//! Every rank's backward submits the same collectives in the same order, and waits for each
//! before its next collective on `tp`, so the stream and the computing thread never use the
//! group at once.

use crate::collective_op::{from_tensor, matmul, ok, to_tensor};
use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension, tensor::FloatTensor};
use burn::tensor::Tensor;
use burn_dispatch::{DispatchKindConversion, DispatchTensor};
use flashover_comm::ReduceOp;
use flashover_runtime::{CommStream, TensorCollectives};
use std::sync::Arc;

/// How activations enter the region: the op's argument besides its tensors.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    /// The `tp` group's communication stream.
    stream: Arc<CommStream>,
    /// Whether the input holds this rank's positions of each sequence (`[batch, seq / tp,
    /// d_in]`), gathered along dim 1 before the product.
    sequence_parallel: bool,
}

/// What one product keeps for its backward: its whole input as rows, its weight (untracked
/// tensors of the inner backend), the input's shape as given, and how it entered.
#[derive(Clone, Debug)]
struct Saved {
    rows: Tensor<2>,
    weight: Tensor<2>,
    whole: [usize; 3],
    entry: Entry,
}

#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub(crate) trait ColwiseOps: Backend {
    /// Forward: the entry's gather (with sequence parallelism), then `x W` as rows (`x:
    /// [batch, seq, d_in]`, `W: [d_in, d_out / tp]`, the result `[batch x whole seq, d_out /
    /// tp]`). Backward: `dx = dy W^T`, all-reduced (reduce-scattered along the sequence) on
    /// the stream while `dW = x^T dy` is computed.
    fn colwise_matmul(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        entry: Entry,
    ) -> FloatTensor<Self>;
}

/// The entry's forward: `x` (`[batch, seq, d_in]`) as rows of the whole sequences, gathered
/// over `tp` with sequence parallelism; and the whole input's shape. A failed gather panics
/// with its `CommError`, as inside every op.
fn whole_rows<B: Backend>(x: FloatTensor<B>, entry: &Entry) -> (Tensor<2>, [usize; 3])
where
    DispatchTensor: DispatchKindConversion<B>,
{
    let mut x = to_tensor::<B, 3>(x);
    if entry.sequence_parallel {
        x = ok(entry.stream.group().all_gather_tensor(x, 1));
    }
    let whole = x.dims();
    (x.reshape([whole[0] * whole[1], whole[2]]), whole)
}

/// The forward of the op without autodiff.
fn forward<B: Backend>(x: FloatTensor<B>, w: FloatTensor<B>, entry: &Entry) -> FloatTensor<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    let (rows, _) = whole_rows::<B>(x, entry);
    matmul::<B>(from_tensor::<B, 2>(rows), w)
}

crate::collective_op::for_inner_backends! {
    impl ColwiseOps {
        fn colwise_matmul(
            x: FloatTensor<Self>,
            w: FloatTensor<Self>,
            e: Entry,
        ) -> FloatTensor<Self> {
            forward::<Self>(x, w, &e)
        }
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
        // The input's gradient first: its collective runs while the weight's is computed.
        let reduced = input_node.as_ref().map(|_| {
            let partial = (dy.clone().matmul(saved.weight.transpose())).reshape(saved.whole);
            let sequence_parallel = saved.entry.sequence_parallel;
            (saved.entry.stream).submit(move |tp| match sequence_parallel {
                true => tp.reduce_scatter_tensor(partial, 1, ReduceOp::Sum),
                false => tp.all_reduce_tensor(partial, ReduceOp::Sum),
            })
        });
        if let Some(node) = weight_node {
            let dw = saved.rows.transpose().matmul(dy);
            grads.register::<B>(node.id, from_tensor::<B, 2>(dw));
        }
        if let (Some(node), Some(reduced)) = (input_node, reduced) {
            grads.register::<B>(node.id, from_tensor::<B, 3>(ok(reduced.wait())));
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
        entry: Entry,
    ) -> FloatTensor<Self> {
        let nodes = [x.node(), weight.node()];
        let (input, weight) = (x.into_primitive(), weight.into_primitive());
        let (rows, whole) = whole_rows::<B>(input, &entry);
        let out = matmul::<B>(from_tensor::<B, 2>(rows.clone()), weight.clone());
        match ColwiseBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                Saved {
                    rows,
                    weight: to_tensor::<B, 2>(weight),
                    whole,
                    entry,
                },
                out,
            ),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

/// `x W` for `x: [.., d_in]` entering a column-parallel region of the `tp` group whose stream
/// is `stream` (with `sequence_parallel`, `x` is `[batch, seq / tp, d_in]`, this rank's
/// positions) and `weight` the layer's part: the input's gradient all-reduced
/// (reduce-scattered) on the stream while the weight's is computed. `None` for a sequence
/// split of a tensor that is not `[batch, seq, d_in]`.
pub(crate) fn colwise_product<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    stream: &Arc<CommStream>,
    sequence_parallel: bool,
) -> Option<Tensor<D>> {
    if sequence_parallel && D != 3 {
        return None;
    }
    let mut dims = x.dims();
    let d_in = dims[D - 1];
    let rows: usize = dims[..D - 1].iter().product();
    let x = match sequence_parallel {
        true => x.reshape([dims[0], dims[1], d_in]),
        false => x.reshape([1, rows, d_in]),
    };
    let entry = Entry {
        stream: stream.clone(),
        sequence_parallel,
    };
    dims[D - 1] = weight.dims()[1];
    if sequence_parallel {
        dims[1] *= stream.group().size();
    }
    let y: Tensor<2> = Tensor::from_dispatch(<Dispatch as ColwiseOps>::colwise_matmul(
        x.into_dispatch(),
        weight.into_dispatch(),
        entry,
    ));
    Some(y.reshape(dims))
}
