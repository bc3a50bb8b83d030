//! A gradient hook: forward identity; backward hands the gradient (flat, on its device) to a
//! callback, which takes it over: the parameter never receives the gradient, so Burn's gradient
//! container stays free of it (the reducer's bucket is the only copy, which is what lets ZeRO-2
//! hold only a shard). This is how DDP learns, during backward, that a parameter's gradient is
//! final, so its bucket can be reduced while backward continues.
//!
//! Burn 0.22.1 has no tensor hooks; this is a backend-extension op with a hand-written backward
//! (see the project notes' custom-backward recipe). It is implemented for Flex and, with the
//! `wgpu` / `cuda` features, for the CubeCL backend; on other backends the strategies fall
//! back to reading gradients after backward.

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension, tensor::FloatTensor};
use burn::tensor::{Device, Tensor};
use burn_dispatch::{DispatchKindConversion, DispatchTensor};
use std::sync::Arc;

/// A function receiving a gradient, flattened (row-major), as a tensor of the inner backend
/// outside any graph, on the parameter's device and in the gradient's dtype.
pub type GradFn = dyn Fn(Tensor<1>) + Send + Sync;

/// The callback a hook calls with a gradient's values.
#[derive(Clone)]
pub struct GradCallback(pub Arc<GradFn>);

impl std::fmt::Debug for GradCallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GradCallback")
    }
}

#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub trait GradHookOps: Backend {
    /// Forward: identity. Backward: calls `callback` with the gradient, which does not reach
    /// `x` (the callback took it over).
    fn grad_hook(x: FloatTensor<Self>, callback: GradCallback) -> FloatTensor<Self>;
}

crate::collective_op::for_inner_backends! {
    impl GradHookOps {
        fn grad_hook(x: FloatTensor<Self>, _callback: GradCallback) -> FloatTensor<Self> {
            x
        }
    }
}

#[derive(Debug)]
struct HookBackward;

impl<B: Backend> Backward<B, 1> for HookBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = GradCallback;

    fn backward(
        self,
        ops: Ops<GradCallback, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let callback = ops.state;
        // Consumed, not registered for the parent: the parameter never receives it.
        let grad: Tensor<1> =
            crate::collective_op::to_tensor::<B, 1>(grads.consume::<B>(&ops.node));
        let numel = grad.shape().num_elements();
        (callback.0)(grad.reshape([numel]));
    }
}

impl<B: Backend, C: CheckpointStrategy> GradHookOps for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn grad_hook(x: FloatTensor<Self>, callback: GradCallback) -> FloatTensor<Self> {
        let node = x.node();
        match HookBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(callback, x.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(x.into_primitive()),
        }
    }
}

/// Whether gradient hooks and the other custom ops work on `device`: an autodiff device of a
/// backend they are built for (Flex; the CubeCL backend with the `wgpu` / `cuda` features).
pub fn hooks_supported(device: &Device) -> bool {
    device.is_autodiff()
        && (device.clone().inner() == Device::flex()
            || cfg!(any(feature = "wgpu", feature = "cuda")))
}

/// `x` with a gradient hook attached (see the module docs).
pub fn grad_hook<const D: usize>(x: Tensor<D>, callback: GradCallback) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as GradHookOps>::grad_hook(
        x.into_dispatch(),
        callback,
    ))
}
