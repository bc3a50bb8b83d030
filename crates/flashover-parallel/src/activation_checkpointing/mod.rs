//! Activation checkpointing (recomputation): keep less of the forward for backward and compute
//! it again when backward needs it. Not to be confused with training checkpoints
//! (`flashover-checkpoint`).
//!
//! - **Block-level** ([`checkpoint`]): any Burn module's forward runs outside the autodiff
//!   graph; only its input is kept (its parameters are alive anyway). In backward the forward
//!   runs again with a graph, from that input, and its own backward gives the gradients of the
//!   input and of every parameter, which continue into the outer graph (so data-parallel
//!   gradient hooks, tensor-parallel operators and fully sharded gathers see them as usual).
//!   The equivalent of `torch.utils.checkpoint`. [`CheckpointPolicy`] picks the transformer
//!   blocks: all, every k-th, or a list.
//! - **Selective**: Burn's balanced checkpointing (`Device::gradient_checkpointing`), which keeps
//!   the outputs of compute-bound operations (matrix products) and recomputes memory-bound ones
//!   (norms, activations, softmax, elementwise) in backward.
//!
//! **Random numbers:** the model's dropout masks are a hash of (seed, step, site, logical
//! coordinates) (`crate::dropout::Dropout`), not a stream: a recomputed forward draws exactly
//! the masks the first one drew, so gradients equal those without recomputation.
//!
//! Block-level recomputation is a custom autodiff op whose backward reruns the forward on the
//! device, implemented for Flex and, with the `wgpu` / `cuda` features, the CubeCL backend. The
//! op and the scope of a checkpointed forward are a primitive the other mechanisms share
//! (`crate::recompute`); this module holds what picks the blocks: the policy's
//! [`BlockRecompute`], which a `ForwardContext`'s [`CheckpointHook`] runs the blocks through.

use crate::forward_context::{
    BlockCheckpoint, CheckpointHook, ForwardContext, MoeHook, RecomputableBlock,
};
pub use crate::plan::CheckpointPolicy;
use crate::recompute::Replays;
pub use crate::recompute::checkpoint;
use burn::tensor::{FloatDType, Tensor};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

impl CheckpointPolicy {
    /// What recomputes the blocks this policy names (`None` when it names none); its
    /// [`BlockRecompute::hook`] goes into the `ForwardContext`.
    pub fn block_recompute(&self) -> Option<Arc<BlockRecompute>> {
        self.is_block_level().then(|| {
            Arc::new(BlockRecompute {
                policy: self.clone(),
                recomputed: Arc::new(AtomicUsize::new(0)),
            })
        })
    }
}

/// Recomputes the blocks a [`CheckpointPolicy`] names, counting the recomputations.
pub struct BlockRecompute {
    policy: CheckpointPolicy,
    recomputed: Arc<AtomicUsize>,
}

impl BlockRecompute {
    /// The forward-context hook.
    pub fn hook(self: &Arc<Self>) -> CheckpointHook {
        CheckpointHook(self.clone())
    }

    /// Block forwards run again in backward so far.
    pub fn recomputed(&self) -> usize {
        self.recomputed.load(Ordering::Relaxed)
    }

    /// A counter of one checkpointed block's runs, adding its recomputations to this policy's.
    fn replays(&self) -> Replays {
        Replays::new(self.recomputed.clone())
    }
}

impl BlockCheckpoint for BlockRecompute {
    /// `block`'s forward as block `layer`: recomputed in backward from `x` alone when the
    /// policy names the layer (through [`ForwardContext::block`]).
    fn run(
        &self,
        layer: usize,
        block: &dyn RecomputableBlock,
        x: Tensor<3>,
        ctx: &ForwardContext,
        aux_losses: bool,
    ) -> Tensor<3> {
        if !self.policy.recomputes_block(layer) {
            return block.forward(x, ctx);
        }
        if let (Some(moe), true) = (&ctx.moe, aux_losses) {
            return self.run_with_aux_losses(block, x, ctx, moe);
        }
        let replays = self.replays();
        let ctx = ctx.clone();
        block.checkpointed(
            x,
            Arc::new(move |forward, x| {
                replays.next_is_replay();
                forward(x, &ctx)
            }),
        )
    }
}

impl BlockRecompute {
    /// A mixture-of-experts block, recomputed. Its router's auxiliary losses are a second
    /// output: they leave the checkpointed function as one more element after the block's
    /// output (in f32), so their gradient reaches the router through the recomputation, as the
    /// block output's does. The first run records the routing statistics; the run in backward
    /// records nothing (it would count twice).
    fn run_with_aux_losses(
        &self,
        block: &dyn RecomputableBlock,
        x: Tensor<3>,
        ctx: &ForwardContext,
        moe: &MoeHook,
    ) -> Tensor<3> {
        let (dims, dtype) = (x.dims(), x.dtype());
        let numel = dims.iter().product();
        let first = ForwardContext {
            moe: Some(moe.with_own_aux_losses()),
            ..ctx.clone()
        };
        let again = ForwardContext {
            moe: Some(moe.replaying()),
            ..ctx.clone()
        };
        let replays = self.replays();
        let output = block.checkpointed(
            x,
            Arc::new(move |forward, x| {
                let ctx = match replays.next_is_replay() {
                    false => &first,
                    true => &again,
                };
                let y = forward(x, ctx);
                let device = y.device();
                let aux = ctx.moe.as_ref().and_then(MoeHook::take_aux_loss);
                let aux = aux.unwrap_or_else(|| Tensor::zeros([1], &device));
                let y = y.cast(FloatDType::F32).reshape([numel]);
                let aux = aux.cast(FloatDType::F32).reshape([1]);
                Tensor::cat(vec![y, aux], 0).reshape([1, 1, numel + 1])
            }),
        );
        moe.push_aux_loss(output.clone().narrow(2, numel, 1).reshape([1]));
        output.narrow(2, 0, numel).reshape(dims).cast(dtype)
    }
}
