//! Deferred weight gradients, what makes a zero-bubble schedule's split backward real.
//!
//! Zero-bubble schedules split a stage's backward in two: the input gradient, which the
//! previous stage is waiting for, and the weight gradient, which nobody waits for and can fill
//! a bubble later. Burn's backward computes both at once, so linear layers that should defer
//! their weight gradient run through [`deferred_linear`]: a matrix product whose backward
//! computes only `dx = dy W^T` and records `(x, dy)` in a [`WeightGradStore`]; the weight
//! gradient `dW = x^T dy` is computed when the schedule's weight-gradient action runs
//! ([`DeferredWeightGrad::compute`]). The weight never receives a gradient from autodiff.
//!
//! A backend-extension op with a hand-written backward (the project notes' custom-backward
//! recipe), implemented for Flex and for the CubeCL backend (wgpu, CUDA).

use crate::collective_op::{from_tensor, matmul, to_tensor};
use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension, tensor::FloatTensor};
use burn::module::ParamId;
use burn::nn::Linear;
use burn::tensor::{DType, Tensor};
use burn_dispatch::{DispatchKindConversion, DispatchTensor};
use std::sync::{Arc, Mutex};

/// A weight gradient whose computation was deferred: the layer's input and output gradient.
#[derive(Debug)]
pub struct DeferredWeightGrad {
    /// The weight it belongs to.
    pub param: ParamId,
    input: Tensor<2>,
    output_grad: Tensor<2>,
}

impl DeferredWeightGrad {
    /// The weight's gradient `x^T dy`, `[d_in, d_out]`, on the layer's device (untracked).
    pub fn compute(self) -> Tensor<2> {
        self.input.transpose().matmul(self.output_grad)
    }
}

/// Where [`deferred_linear`]'s backward records the weight gradients it did not compute.
/// Cloning shares the store.
#[derive(Clone, Default)]
pub struct WeightGradStore(Arc<Mutex<Vec<DeferredWeightGrad>>>);

impl std::fmt::Debug for WeightGradStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WeightGradStore")
    }
}

impl WeightGradStore {
    /// Everything recorded since the last call, in the order backward produced it.
    pub fn take(&self) -> Vec<DeferredWeightGrad> {
        std::mem::take(&mut *self.lock())
    }

    fn push(&self, grad: DeferredWeightGrad) {
        self.lock().push(grad);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<DeferredWeightGrad>> {
        // A panic elsewhere while holding the lock leaves the list itself intact.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// State of one deferred product: its input and weight (untracked tensors of the inner
/// backend), and where to record.
#[derive(Clone, Debug)]
struct Deferral {
    input: Tensor<2>,
    weight: Tensor<2>,
    param: ParamId,
    store: WeightGradStore,
}

#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub trait DeferredMatmulOps: Backend {
    /// Forward: `x W` (`x: [n, d_in]`, `W: [d_in, d_out]`). Backward: `dx = dy W^T` only;
    /// `(x, dy)` is recorded in `store` for `param`, whose gradient autodiff never sees.
    fn deferred_matmul(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        param: ParamId,
        store: WeightGradStore,
    ) -> FloatTensor<Self>;
}

crate::collective_op::for_inner_backends! {
    impl DeferredMatmulOps {
        fn deferred_matmul(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            _: ParamId,
            _: WeightGradStore,
        ) -> FloatTensor<Self> {
            matmul::<Self>(x, weight)
        }
    }
}

#[derive(Debug)]
struct DeferredMatmulBackward;

impl<B: Backend> Backward<B, 2> for DeferredMatmulBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = Deferral;

    fn backward(self, ops: Ops<Deferral, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [input_node, weight_node] = ops.parents;
        let d = ops.state;
        let dy = to_tensor::<B, 2>(grads.consume::<B>(&ops.node));
        if let Some(node) = weight_node {
            // Under a reduced-precision policy the weight is a cast of the f32 parameter, and
            // the cast's backward needs a gradient to pass on: zero here, the real one is
            // added from the store by parameter id.
            if d.weight.dtype() != DType::F32 {
                grads.register::<B>(node.id, from_tensor::<B, 2>(d.weight.zeros_like()));
            }
            d.store.push(DeferredWeightGrad {
                param: d.param,
                input: d.input,
                output_grad: dy.clone(),
            });
        }
        if let Some(node) = input_node {
            grads.register::<B>(
                node.id,
                from_tensor::<B, 2>(dy.matmul(d.weight.transpose())),
            );
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> DeferredMatmulOps for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn deferred_matmul(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        param: ParamId,
        store: WeightGradStore,
    ) -> FloatTensor<Self> {
        let nodes = [x.node(), weight.node()];
        let (input, weight) = (x.into_primitive(), weight.into_primitive());
        let out = matmul::<B>(input.clone(), weight.clone());
        match DeferredMatmulBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                Deferral {
                    input: to_tensor::<B, 2>(input),
                    weight: to_tensor::<B, 2>(weight),
                    param,
                    store,
                },
                out,
            ),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

thread_local! {
    /// The store a stage's forward on this thread defers plan-aware linear layers' weight
    /// gradients to ([`deferring_in`]).
    static FORWARD_STORE: std::cell::RefCell<Option<WeightGradStore>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `f`, a stage's forward or input-gradient backward (where recomputed layers run their
/// forward again), with the plan-aware linear layers it computes (`crate::nn::Linear`, and the
/// reference transformer through the plan's layer hooks) deferring their weight gradients to
/// `store`; the setting is this thread's and ends with `f`. The executor wraps both in it for
/// a zero-bubble step ([`super::PipelineExecutor::deferring_weight_grads`]), so a model needs
/// no store of its own.
pub(crate) fn deferring_in<T>(store: &WeightGradStore, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<WeightGradStore>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORWARD_STORE.with(|s| *s.borrow_mut() = self.0.take());
        }
    }
    let before = FORWARD_STORE.with(|s| s.borrow_mut().replace(store.clone()));
    let _restore = Restore(before);
    f()
}

/// The store of the [`deferring_in`] this thread runs in, if any.
pub(crate) fn forward_store() -> Option<WeightGradStore> {
    FORWARD_STORE.with(|s| s.borrow().clone())
}

/// Whether deferred weight gradients work on `device`: an autodiff device of Flex or of the
/// CubeCL backend (wgpu, CUDA) when the crate is built with it.
pub fn deferral_supported(device: &burn::tensor::Device) -> bool {
    crate::hook::hooks_supported(device)
}

/// `linear` applied to `x: [.., d_in]` with its weight gradient deferred to `store` (the bias,
/// if any, gets its gradient from autodiff as usual). On Flex and the CubeCL backend.
pub fn deferred_linear<const D: usize>(
    linear: &Linear,
    x: Tensor<D>,
    store: &WeightGradStore,
) -> Tensor<D> {
    let bias = linear.bias.as_ref().map(|b| b.val());
    deferred_product(x, linear.weight.val(), linear.weight.id, bias, store)
}

/// `x weight + bias` for `x: [.., d_in]` and the value `weight` of parameter `param`, its
/// gradient deferred to `store` (what [`deferred_linear`] computes, for a weight read
/// otherwise: a rank's tensor-parallel part). On Flex and the CubeCL backend.
pub(crate) fn deferred_product<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    param: ParamId,
    bias: Option<Tensor<1>>,
    store: &WeightGradStore,
) -> Tensor<D> {
    let mut dims = x.dims();
    let d_in = dims[D - 1];
    let rows = dims[..D - 1].iter().product();
    dims[D - 1] = weight.dims()[1];
    let y: Tensor<2> = Tensor::from_dispatch(<Dispatch as DeferredMatmulOps>::deferred_matmul(
        x.reshape([rows, d_in]).into_dispatch(),
        weight.into_dispatch(),
        param,
        store.clone(),
    ));
    let y = y.reshape(dims);
    match bias {
        Some(bias) => y + bias.unsqueeze(),
        None => y,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;
    use burn::tensor::{Device, TensorData};

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().unwrap()
    }

    #[test]
    fn the_deferred_gradients_equal_autodiff_and_the_weight_gets_none_until_computed() {
        let device = Device::flex().autodiff();
        let w: Vec<f32> = (0..12).map(|i| (i as f32 * 0.37).sin()).collect();
        let x: Vec<f32> = (0..2 * 3 * 4).map(|i| (i as f32 * 0.11).cos()).collect();
        let linear = |device: &Device| Linear {
            weight: Param::from_data(TensorData::new(w.clone(), [4, 3]), device),
            bias: Some(Param::from_data(
                TensorData::new(vec![0.1, 0.2, 0.3], [3]),
                device,
            )),
        };
        let input = || Tensor::<3>::from_data(TensorData::new(x.clone(), [2, 3, 4]), &device);

        let reference = linear(&device);
        let x_ref = input().require_grad();
        let grads = (reference.forward(x_ref.clone()).powi_scalar(2))
            .sum()
            .backward();
        let dw_ref = values(reference.weight.grad(&grads).unwrap());
        let db_ref = values(reference.bias.as_ref().unwrap().grad(&grads).unwrap());
        let dx_ref = values(x_ref.grad(&grads).unwrap());

        let deferred = linear(&device);
        let store = WeightGradStore::default();
        let x_def = input().require_grad();
        let y = deferred_linear(&deferred, x_def.clone(), &store);
        let grads = y.powi_scalar(2).sum().backward();
        assert!(
            deferred.weight.grad(&grads).is_none(),
            "autodiff got the weight gradient"
        );
        assert_eq!(values(x_def.grad(&grads).unwrap()), dx_ref);
        assert_eq!(
            values(deferred.bias.as_ref().unwrap().grad(&grads).unwrap()),
            db_ref
        );
        let pending = store.take();
        assert_eq!(pending.len(), 1);
        assert_eq!(pending[0].param, deferred.weight.id);
        let dw = values(pending.into_iter().next().unwrap().compute());
        for (a, b) in dw.iter().zip(&dw_ref) {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                "{dw:?} vs {dw_ref:?}"
            );
        }
        assert!(store.take().is_empty());
    }
}
