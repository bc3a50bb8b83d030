//! The one differentiable op behind the strategies' collectives on activations and gathered
//! parameters: a tensor function forward and its conjugate backward (Burn 0.22.1 has no autograd functions; see the
//! project notes' custom-backward recipe).
//!
//! Both functions take and return Burn tensors of the inner backend (untracked), so a collective
//! runs through [`flashover_runtime::TensorCollectives`], where the staging a (device, engine)
//! pair needs lives, and everything else (identity, slicing, permuting) is a Burn op on the
//! tensor's device with no transfer. The tensor keeps its dtype: bf16 travels as bf16.
//!
//! Megatron's conjugate operators ([`crate::tensor_parallel`]), the ring pass and Ulysses'
//! all-to-alls ([`crate::context_parallel`]), the expert all-to-alls
//! ([`crate::expert_parallel`]) and a ZeRO-3 unit's gathered reads and its reduce-scatter
//! (`parallelize::units`) are pairs of this op. A failed collective inside backward
//! panics with its `CommError` (the launcher reports it like a returned error).

use burn::backend::autodiff::{
    NodeId,
    checkpoint::{
        base::Checkpointer, retro_forward::RetroForward, state::BackwardStates,
        strategy::CheckpointStrategy,
    },
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension, tensor::FloatTensor};
use burn::tensor::Tensor;
use burn_dispatch::{BackendTensor, DispatchKindConversion, DispatchTensor};
use flashover_comm::CommError;
use std::marker::PhantomData;
use std::sync::Arc;

/// A function on a tensor, run in an op's forward or backward on the inner backend's (untracked)
/// tensor. It takes Burn's dispatch tensor, whatever its number of dimensions, so that one op
/// state type serves tensors of every shape.
#[derive(Clone)]
pub(crate) struct TensorFn(Arc<dyn Fn(DispatchTensor) -> DispatchTensor + Send + Sync>);

impl std::fmt::Debug for TensorFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TensorFn")
    }
}

/// `f` as an op's function, on tensors of rank `D`.
pub(crate) fn tensor_fn<const D: usize>(
    f: impl Fn(Tensor<D>) -> Tensor<D> + Send + Sync + 'static,
) -> TensorFn {
    TensorFn(Arc::new(move |t| {
        f(Tensor::from_dispatch(t)).into_dispatch()
    }))
}

/// The identity, for the side of a pair that moves nothing (Megatron's *f* forward, *g*
/// backward).
pub(crate) fn identity() -> TensorFn {
    TensorFn(Arc::new(|t| t))
}

/// A forward that ignores its input and returns `value` (untracked): a collective whose result
/// was computed ahead (a prefetched all-gather, a ring pass run on a communication stream),
/// made a differentiable function of the input it was computed from.
pub(crate) fn computed<const D: usize>(value: Tensor<D>) -> TensorFn {
    let value = value.inner();
    tensor_fn::<D>(move |_| value.clone())
}

#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub(crate) trait CollectiveOps: Backend {
    /// Forward: `forward(x)`. Backward: `backward(grad)`.
    fn collective_pair(
        x: FloatTensor<Self>,
        forward: TensorFn,
        backward: TensorFn,
    ) -> FloatTensor<Self>;

    /// [`Self::collective_pair`] marked memory bound: under Burn's balanced gradient
    /// checkpointing no backward state keeps its output; a backward op that needs the
    /// output gets `regather(x)` instead, computed when first asked.
    fn regathered_pair(
        x: FloatTensor<Self>,
        forward: TensorFn,
        backward: TensorFn,
        regather: TensorFn,
    ) -> FloatTensor<Self>;

    /// [`Self::collective_pair`] placed in the backward tape right after `after`: Burn runs
    /// backward by depth, and this op is as deep as `after` (whose value it ignores and to
    /// which it hands no gradient), not as shallow as `x`.
    fn collective_pair_after(
        x: FloatTensor<Self>,
        after: FloatTensor<Self>,
        forward: TensorFn,
        backward: TensorFn,
    ) -> FloatTensor<Self>;
}

/// A primitive of backend `B` as a Burn tensor (of that backend, untracked), for tensor code
/// inside an op's forward or backward.
pub(crate) fn to_tensor<B: Backend, const D: usize>(x: FloatTensor<B>) -> Tensor<D>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    Tensor::from_dispatch(<DispatchTensor as DispatchKindConversion<B>>::from_backend(
        BackendTensor::Float(x),
    ))
}

/// The inverse of [`to_tensor`]: `t` must be an untracked float tensor of backend `B`.
pub(crate) fn from_tensor<B: Backend, const D: usize>(t: Tensor<D>) -> FloatTensor<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    match <DispatchTensor as DispatchKindConversion<B>>::try_into_backend(t.into_dispatch()) {
        Ok(BackendTensor::Float(t)) => t,
        Ok(_) => panic!("an op's tensor function returned a tensor that is not float"),
        Err(why) => panic!(
            "an op's tensor function returned a tensor of another backend or a tracked one \
             ({why})"
        ),
    }
}

/// `x W` of two primitives of backend `B` (the forward, on the inner backend, of the ops
/// whose backward computes the product's gradients its own way).
pub(crate) fn matmul<B: Backend>(x: FloatTensor<B>, w: FloatTensor<B>) -> FloatTensor<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    from_tensor::<B, 2>(to_tensor::<B, 2>(x).matmul(to_tensor::<B, 2>(w)))
}

/// `f` applied to a primitive of backend `B`, as a Burn tensor of that backend.
fn apply<B: Backend>(x: FloatTensor<B>, f: &TensorFn) -> FloatTensor<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    let out = (f.0)(to_tensor::<B, 1>(x).into_dispatch());
    from_tensor::<B, 1>(Tensor::from_dispatch(out))
}

/// One impl of a backend extension for every inner backend: Flex, and with `wgpu` or `cuda`
/// the CubeCL backend. On an inner backend (no autodiff) an op is only its forward; the
/// `Autodiff` impl adds the backward.
macro_rules! for_inner_backends {
    (impl $extension:ident { $($body:tt)* }) => {
        impl $extension for burn::backend::Flex {
            $($body)*
        }
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        impl $extension for burn::backend::Cube {
            $($body)*
        }
    };
}
pub(crate) use for_inner_backends;

for_inner_backends! {
    impl CollectiveOps {
        fn collective_pair(
            x: FloatTensor<Self>,
            forward: TensorFn,
            _: TensorFn,
        ) -> FloatTensor<Self> {
            apply::<Self>(x, &forward)
        }

        fn regathered_pair(
            x: FloatTensor<Self>,
            forward: TensorFn,
            _: TensorFn,
            _: TensorFn,
        ) -> FloatTensor<Self> {
            apply::<Self>(x, &forward)
        }

        fn collective_pair_after(
            x: FloatTensor<Self>,
            _: FloatTensor<Self>,
            forward: TensorFn,
            _: TensorFn,
        ) -> FloatTensor<Self> {
            apply::<Self>(x, &forward)
        }
    }
}

/// How a [`CollectiveOps::regathered_pair`]'s output is computed again in backward.
#[derive(Debug)]
struct Regather<B> {
    input: NodeId,
    regather: TensorFn,
    _backend: PhantomData<fn() -> B>,
}

impl<B: Backend> RetroForward for Regather<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let input = states.get_state::<FloatTensor<B>>(&self.input);
        states.save(out_node, apply::<B>(input, &self.regather));
    }
}

/// The backward of every pair: `backward(grad)` for the first parent, `x`. Any other parent
/// (`after`, for [`CollectiveOps::collective_pair_after`]) only places the op in the tape and
/// gets no gradient.
#[derive(Debug)]
struct PairBackward;

impl<B: Backend, const N: usize> Backward<B, N> for PairBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = TensorFn;

    fn backward(self, ops: Ops<TensorFn, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let Some(x) = &ops.parents[0] {
            grads.register::<B>(x.id, apply::<B>(grad, &ops.state));
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> CollectiveOps for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn collective_pair(
        x: FloatTensor<Self>,
        forward: TensorFn,
        backward: TensorFn,
    ) -> FloatTensor<Self> {
        let node = x.node();
        let out = apply::<B>(x.into_primitive(), &forward);
        match PairBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(backward, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn collective_pair_after(
        x: FloatTensor<Self>,
        after: FloatTensor<Self>,
        forward: TensorFn,
        backward: TensorFn,
    ) -> FloatTensor<Self> {
        let nodes = [x.node(), after.node()];
        let out = apply::<B>(x.into_primitive(), &forward);
        match PairBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(backward, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn regathered_pair(
        x: FloatTensor<Self>,
        forward: TensorFn,
        backward: TensorFn,
        regather: TensorFn,
    ) -> FloatTensor<Self> {
        let retro = Regather::<B> {
            input: x.node().id(),
            regather,
            _backend: PhantomData,
        };
        let prep = (PairBackward.prepare::<C>([x.node()]))
            .memory_bound()
            .retro_forward(retro)
            .parents([&x]);
        let out = apply::<B>(x.into_primitive(), &forward);
        match prep.stateful() {
            OpsKind::Tracked(prep) => prep.finish(backward, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

/// `forward(x)`, whose backward maps the output's gradient through `backward`.
pub(crate) fn collective_pair<const D: usize>(
    x: Tensor<D>,
    forward: TensorFn,
    backward: TensorFn,
) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as CollectiveOps>::collective_pair(
        x.into_dispatch(),
        forward,
        backward,
    ))
}

/// [`collective_pair`] whose backward runs right after `after`'s consumers' (Burn runs the
/// tape by depth; this op is as deep as `after`, whose value it ignores and to which it hands
/// no gradient).
pub(crate) fn collective_pair_after<const D: usize, const E: usize>(
    x: Tensor<D>,
    after: Tensor<E>,
    forward: TensorFn,
    backward: TensorFn,
) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as CollectiveOps>::collective_pair_after(
        x.into_dispatch(),
        after.into_dispatch(),
        forward,
        backward,
    ))
}

/// [`collective_pair`] whose output no backward state keeps under balanced gradient
/// checkpointing (`Device::gradient_checkpointing`): a backward op that needs it gets
/// `regather(x)`, computed when first asked. On any other device, exactly
/// [`collective_pair`].
pub(crate) fn regathered_pair<const D: usize>(
    x: Tensor<D>,
    forward: TensorFn,
    backward: TensorFn,
    regather: TensorFn,
) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as CollectiveOps>::regathered_pair(
        x.into_dispatch(),
        forward,
        backward,
        regather,
    ))
}

/// Unwraps a collective's result inside an op, where errors cannot be returned.
pub(crate) fn ok<T>(r: Result<T, CommError>) -> T {
    r.unwrap_or_else(|e| std::panic::panic_any(e))
}
