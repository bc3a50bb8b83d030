//! The differentiable operation behind recomputation, a backend-extension op with a
//! hand-written backward (Burn 0.22.1 has no autograd functions; see the project notes'
//! custom-backward recipe): forward returns an output computed outside the graph as a function
//! of the input and a flat parameter vector; backward calls a function on tensors (of the inner
//! backend, on the device) that recomputes the forward with a graph and returns the gradients
//! of both. Implemented for Flex and (with the `wgpu` / `cuda` features) the CubeCL backend.

use crate::collective_op::{from_tensor, to_tensor};
use burn::backend::TensorMetadata;
use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension, tensor::FloatTensor};
use burn::tensor::{DType, Tensor};
use burn_dispatch::{DispatchKindConversion, DispatchTensor};
use std::sync::Arc;

/// [`recompute`]'s backward: (input, output gradient) in, (input gradient, flat parameter
/// gradient in f32) out; untracked tensors of the inner backend, rank-erased.
pub(crate) type RecomputeFn =
    dyn Fn(DispatchTensor, DispatchTensor) -> (DispatchTensor, Tensor<1>) + Send + Sync;

/// `RecomputeFn` as an op state (states must be `Debug`).
#[derive(Clone)]
pub(crate) struct RecomputeHook(pub Arc<RecomputeFn>);

impl std::fmt::Debug for RecomputeHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecomputeHook")
    }
}

#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub(crate) trait RecomputeOps: Backend {
    /// Forward: `y`, as a function of `x` and `params`. Backward: `hook` recomputes and returns
    /// the gradients of `x` and `params`.
    fn recompute(
        x: FloatTensor<Self>,
        params: FloatTensor<Self>,
        y: FloatTensor<Self>,
        hook: RecomputeHook,
    ) -> FloatTensor<Self>;
}

crate::collective_op::for_inner_backends! {
    impl RecomputeOps {
        fn recompute(
            _: FloatTensor<Self>,
            _: FloatTensor<Self>,
            y: FloatTensor<Self>,
            _: RecomputeHook,
        ) -> FloatTensor<Self> {
            y
        }
    }
}

#[derive(Debug)]
struct RecomputeBackward;

impl<B: Backend> Backward<B, 2> for RecomputeBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    /// The hook, the input, and the parameters' dtype (their gradient is computed in f32).
    type State = (RecomputeHook, FloatTensor<B>, DType);

    fn backward(
        self,
        ops: Ops<(RecomputeHook, FloatTensor<B>, DType), 2>,
        grads: &mut Gradients,
        _: &mut Checkpointer,
    ) {
        let (hook, x, params_dtype) = ops.state;
        let x_dtype = x.dtype();
        let grad_y = grads.consume::<B>(&ops.node);
        let (grad_x, grad_params) = (hook.0)(
            to_tensor::<B, 1>(x).into_dispatch(),
            to_tensor::<B, 1>(grad_y).into_dispatch(),
        );
        let [x_node, params_node] = ops.parents;
        if let Some(node) = x_node {
            let grad_x = Tensor::<1>::from_dispatch(grad_x).cast(x_dtype);
            grads.register::<B>(node.id, from_tensor::<B, 1>(grad_x));
        }
        if let Some(node) = params_node {
            grads.register::<B>(node.id, from_tensor::<B, 1>(grad_params.cast(params_dtype)));
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> RecomputeOps for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn recompute(
        x: FloatTensor<Self>,
        params: FloatTensor<Self>,
        y: FloatTensor<Self>,
        hook: RecomputeHook,
    ) -> FloatTensor<Self> {
        let nodes = [x.node(), params.node()];
        let params_dtype = params.dtype();
        match RecomputeBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                prep.finish((hook, x.into_primitive(), params_dtype), y.into_primitive())
            }
            OpsKind::UnTracked(prep) => prep.finish(y.into_primitive()),
        }
    }
}

/// `y` (computed untracked from `x`) as a differentiable function of `x` and `params` (a flat
/// vector of the parameters `y` was computed with); `hook` recomputes in backward.
pub(crate) fn recompute<const D: usize, const E: usize>(
    x: Tensor<D>,
    params: Tensor<1>,
    y: Tensor<E>,
    hook: RecomputeHook,
) -> Tensor<E> {
    Tensor::from_dispatch(<Dispatch as RecomputeOps>::recompute(
        x.into_dispatch(),
        params.into_dispatch(),
        y.into_dispatch(),
        hook,
    ))
}
