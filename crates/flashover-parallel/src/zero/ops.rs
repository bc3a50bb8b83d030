//! The two differentiable operations behind fully sharded units, as backend-extension ops with
//! hand-written backward passes (Burn 0.22.1 has no autograd functions; see the project notes'
//! custom-backward recipe). Host work happens in Flex-specific code, so these run on Flex.
//!
//! - [`gather_shard`]: forward returns the already all-gathered full buffer as a function of
//!   the rank's shard; backward hands the full buffer's gradient to a host function (the
//!   reduce-scatter) and gives the shard its result.
//! - [`recompute_unit`]: forward returns a unit's output computed outside the graph; backward
//!   calls a host function that recomputes the unit (gathering its parameters again) and returns
//!   the gradients of the unit's input and of the rank's shard.

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind, unary},
};
use burn::backend::{
    Autodiff, Backend, Dispatch, Flex, backend_extension, flex::FlexTensor, tensor::FloatTensor,
};
use burn::tensor::{Tensor, TensorData};
use std::sync::Arc;

/// Host function of [`gather_shard`]'s backward: the full buffer's gradient in, the shard's
/// gradient out (a reduce-scatter).
pub type ScatterFn = dyn Fn(Vec<f32>) -> Vec<f32> + Send + Sync;

/// Host function of [`recompute_unit`]'s backward: (unit input, output gradient) in, (input
/// gradient, shard gradient) out.
pub type RecomputeFn = dyn Fn(TensorData, TensorData) -> (TensorData, Vec<f32>) + Send + Sync;

/// [`ScatterFn`] as an op state (states must be `Debug`).
#[derive(Clone)]
pub struct ScatterHook(pub Arc<ScatterFn>);

/// [`RecomputeFn`] as an op state, with the saved unit input.
#[derive(Clone)]
pub struct RecomputeHook(pub Arc<RecomputeFn>);

impl std::fmt::Debug for ScatterHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScatterHook")
    }
}

impl std::fmt::Debug for RecomputeHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecomputeHook")
    }
}

#[backend_extension(Flex, Autodiff)]
pub trait ShardOps: Backend {
    /// Forward: `full`, as a function of `shard`. Backward: `hook` maps `full`'s gradient to
    /// `shard`'s.
    fn gather_shard(
        shard: FloatTensor<Self>,
        full: FloatTensor<Self>,
        hook: ScatterHook,
    ) -> FloatTensor<Self>;

    /// Forward: `y`, as a function of `x` and `shard`. Backward: `hook` recomputes and returns
    /// the gradients of `x` and `shard`.
    fn recompute_unit(
        x: FloatTensor<Self>,
        shard: FloatTensor<Self>,
        y: FloatTensor<Self>,
        hook: RecomputeHook,
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

    fn recompute_unit(
        _: FloatTensor<Self>,
        _: FloatTensor<Self>,
        y: FloatTensor<Self>,
        _: RecomputeHook,
    ) -> FloatTensor<Self> {
        y
    }
}

fn to_f32(t: FlexTensor) -> Vec<f32> {
    let data = t.into_data().convert::<f32>();
    data.as_slice::<f32>().expect("f32 after convert").to_vec()
}

#[derive(Debug)]
struct GatherBackward;

impl Backward<Flex, 1> for GatherBackward {
    type State = ScatterHook;

    fn backward(self, ops: Ops<ScatterHook, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let hook = ops.state;
        unary::<Flex, _>(ops.parents, ops.node, grads, |g| {
            let shard = (hook.0)(to_f32(g));
            let len = shard.len();
            FlexTensor::from_data(TensorData::new(shard, [len]))
        });
    }
}

#[derive(Debug)]
struct RecomputeBackward;

impl Backward<Flex, 2> for RecomputeBackward {
    type State = (RecomputeHook, FlexTensor);

    fn backward(
        self,
        ops: Ops<(RecomputeHook, FlexTensor), 2>,
        grads: &mut Gradients,
        _: &mut Checkpointer,
    ) {
        let (hook, x) = ops.state;
        let grad_y = grads.consume::<Flex>(&ops.node);
        let (grad_x, grad_shard) = (hook.0)(x.into_data(), grad_y.into_data());
        let [x_node, shard_node] = ops.parents;
        if let Some(node) = x_node {
            grads.register::<Flex>(node.id, FlexTensor::from_data(grad_x));
        }
        if let Some(node) = shard_node {
            let len = grad_shard.len();
            let data = TensorData::new(grad_shard, [len]);
            grads.register::<Flex>(node.id, FlexTensor::from_data(data));
        }
    }
}

impl<C: CheckpointStrategy> ShardOps for Autodiff<Flex, C> {
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

    fn recompute_unit(
        x: FloatTensor<Self>,
        shard: FloatTensor<Self>,
        y: FloatTensor<Self>,
        hook: RecomputeHook,
    ) -> FloatTensor<Self> {
        let nodes = [x.node(), shard.node()];
        match RecomputeBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((hook, x.into_primitive()), y.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(y.into_primitive()),
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

/// `y` (computed untracked from `x`) as a differentiable function of `x` and `shard`.
pub fn recompute_unit<const D: usize, const E: usize>(
    x: Tensor<D>,
    shard: Tensor<1>,
    y: Tensor<E>,
    hook: RecomputeHook,
) -> Tensor<E> {
    Tensor::from_dispatch(<Dispatch as ShardOps>::recompute_unit(
        x.into_dispatch(),
        shard.into_dispatch(),
        y.into_dispatch(),
        hook,
    ))
}
