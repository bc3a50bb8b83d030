//! The differentiable gather behind fully sharded units, a backend-extension op with a
//! hand-written backward (Burn 0.22.1 has no autograd functions; see the project notes'
//! custom-backward recipe): forward returns the already all-gathered full buffer as a function
//! of the rank's shard; backward hands the full buffer's gradient to a host function (the
//! reduce-scatter) and gives the shard its result. Host work goes through [`crate::host`], so
//! it runs on Flex and (with the `wgpu` / `cuda` features) the CubeCL backend. A unit's recomputation in backward is activation checkpointing's
//! [`crate::activation_checkpointing::recompute`] op.

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn::backend::Cube;
use burn::backend::TensorMetadata;
use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind, unary},
};
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension, tensor::FloatTensor};
use burn::tensor::{Tensor, TensorData};
use std::sync::Arc;

/// Host function of [`gather_shard`]'s backward: the full buffer's gradient in, the shard's
/// gradient out (a reduce-scatter).
pub type ScatterFn = dyn Fn(Vec<f32>) -> Vec<f32> + Send + Sync;

/// [`ScatterFn`] as an op state (states must be `Debug`).
#[derive(Clone)]
pub struct ScatterHook(pub Arc<ScatterFn>);

impl std::fmt::Debug for ScatterHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScatterHook")
    }
}

#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub trait ShardOps: Backend {
    /// Forward: `full`, as a function of `shard`. Backward: `hook` maps `full`'s gradient to
    /// `shard`'s.
    fn gather_shard(
        shard: FloatTensor<Self>,
        full: FloatTensor<Self>,
        hook: ScatterHook,
    ) -> FloatTensor<Self>;
}

impl ShardOps for Flex {
    fn gather_shard(
        _: FloatTensor<Self>,
        full: FloatTensor<Self>,
        _: ScatterHook,
    ) -> FloatTensor<Self> {
        full
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl ShardOps for Cube {
    fn gather_shard(
        _: FloatTensor<Self>,
        full: FloatTensor<Self>,
        _: ScatterHook,
    ) -> FloatTensor<Self> {
        full
    }
}

fn to_f32<B: Backend>(t: FloatTensor<B>) -> Vec<f32> {
    let data = crate::host::read::<B>(t).convert::<f32>();
    data.as_slice::<f32>().expect("f32 after convert").to_vec()
}

#[derive(Debug)]
struct GatherBackward;

impl<B: Backend> Backward<B, 1> for GatherBackward {
    type State = ScatterHook;

    fn backward(self, ops: Ops<ScatterHook, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let hook = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |g| {
            let device = g.device();
            let shard = (hook.0)(to_f32::<B>(g));
            let len = shard.len();
            crate::host::write::<B>(TensorData::new(shard, [len]), &device)
        });
    }
}

impl<B: Backend, C: CheckpointStrategy> ShardOps for Autodiff<B, C> {
    fn gather_shard(
        shard: FloatTensor<Self>,
        full: FloatTensor<Self>,
        hook: ScatterHook,
    ) -> FloatTensor<Self> {
        let node = shard.node();
        match GatherBackward
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(hook, full.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(full.into_primitive()),
        }
    }
}

/// `full` (the gathered parameters, untracked) as a differentiable function of `shard`.
pub fn gather_shard(shard: Tensor<1>, full: Tensor<1>, hook: ScatterHook) -> Tensor<1> {
    Tensor::from_dispatch(<Dispatch as ShardOps>::gather_shard(
        shard.into_dispatch(),
        full.into_dispatch(),
        hook,
    ))
}
