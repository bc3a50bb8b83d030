//! The vocabulary-parallel loss's per-row pieces from the fused CubeCL kernel
//! (`flashover_kernels::cross_entropy_pieces`: the maximum and the sum of shifted exponentials
//! over this rank's vocabulary shard in one pass) with the gradient attached by hand: the sum's
//! gradient with respect to the logits is `exp(logit - max) * d sum`, the maximum is a constant
//! (it only keeps the exponentials in range). The target logit stays an ordinary gather.

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{
    Autodiff, Backend, Dispatch, TensorMetadata, backend_extension, tensor::FloatTensor,
};
use burn::tensor::{DType, Shape, Tensor};

#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub trait SumExpGradOps: Backend {
    /// `sum` (`[rows]`, `Σ exp(logits - max)` computed outside the graph) as a differentiable
    /// function of `logits` (`[rows, v]`), with `max` (`[rows]`) a constant.
    fn with_sum_exp_grad(
        logits: FloatTensor<Self>,
        max: FloatTensor<Self>,
        sum: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

crate::collective_op::for_inner_backends! {
    impl SumExpGradOps {
        fn with_sum_exp_grad(
            _: FloatTensor<Self>,
            _: FloatTensor<Self>,
            sum: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            sum
        }
    }
}

#[derive(Debug)]
struct SumExpBackward;

impl<B: Backend> Backward<B, 1> for SumExpBackward {
    /// The logits and their row maxima.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (logits, max) = ops.state;
        let d = grads.consume::<B>(&ops.node);
        let [logits_node] = ops.parents;
        if let Some(node) = logits_node {
            let rows = max.shape().num_elements();
            let column = |x: FloatTensor<B>| B::float_reshape(x, Shape::new([rows, 1]));
            let exp = B::float_exp(B::float_sub(logits, column(max)));
            grads.register::<B>(node.id, B::float_mul(exp, column(d)));
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> SumExpGradOps for Autodiff<B, C> {
    fn with_sum_exp_grad(
        logits: FloatTensor<Self>,
        max: FloatTensor<Self>,
        sum: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let nodes = [logits.node()];
        match SumExpBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                (logits.into_primitive(), max.into_primitive()),
                sum.into_primitive(),
            ),
            OpsKind::UnTracked(prep) => prep.finish(sum.into_primitive()),
        }
    }
}

/// Whether [`max_and_sum_exp`] runs the fused kernel: f32 logits on a CubeCL device. Elsewhere
/// (Flex, where the tensor operations are as fast) the loss keeps its tensor operations.
pub(crate) fn fuses(logits: &Tensor<2>) -> bool {
    logits.dtype() == DType::F32 && flashover_kernels::uses_kernels(&logits.device())
}

/// Per row of `logits: [rows, v]` (pads already very negative, not `-inf`): the maximum (a
/// constant, outside the graph) and `Σ exp(logit - max)` (differentiable), from one kernel pass.
pub(crate) fn max_and_sum_exp(logits: Tensor<2>) -> (Tensor<1>, Tensor<1>) {
    let rows = logits.dims()[0];
    let no_targets = Tensor::<1>::full([rows], -1.0, &logits.device().inner());
    let (max, sum, _) = flashover_kernels::cross_entropy_pieces(logits.clone().inner(), no_targets);
    // Into the logits' autodiff context, as constants.
    let like = |t: Tensor<1>| crate::params::in_context_of(t, &logits);
    let (max, sum) = (like(max), like(sum));
    let sum = Tensor::from_dispatch(<Dispatch as SumExpGradOps>::with_sum_exp_grad(
        logits.into_dispatch(),
        max.clone().into_dispatch(),
        sum.into_dispatch(),
    ));
    (max, sum)
}
