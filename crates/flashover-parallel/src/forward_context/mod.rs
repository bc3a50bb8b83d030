//! What a forward knows about where it runs, and the dispatch points through which parallelism
//! strategies change how it computes.
//!
//! A [`ForwardContext`] travels with the forward of a model whose layers take one (the
//! reference transformer). Its offsets and positions say where this rank's tensors sit in the
//! logical ones (what a single rank would hold), so dropout masks and rotary tables
//! ([`rope_tables_at`]) are those of one rank. Its hooks are the places a strategy computes
//! what the layers' own types cannot: attention's core over keys and values on other ranks
//! ([`AttentionOp`], context parallelism), a block run again in backward ([`CheckpointHook`],
//! activation checkpointing), a mixture-of-experts layer's experts and auxiliary losses
//! ([`MoeHook`]; a plan's layers find their experts' placement themselves,
//! `crate::expert_parallel::MoeForward`), and the
//! sequences split across ranks that such a layer routes whole ([`SequenceShare`], context
//! parallelism). Linear layers, embeddings and the loss need none: `crate::nn`'s layers
//! compute as the plan placed them.

mod moe_record;

pub use moe_record::{MoeHook, MoeStats};

use crate::dropout::{Coords, Dropout, Site};
use burn::module::Module;
use burn::tensor::{Device, Tensor, TensorData};
use std::sync::Arc;

/// Where a forward runs: its dropout, where its local tensors sit in the logical ones, and the
/// strategies' hooks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ForwardContext {
    /// Dropout, if any.
    pub dropout: Option<Dropout>,
    /// Global index of the first sample of the local batch.
    pub sample_offset: usize,
    /// First attention head held locally (tensor parallelism).
    pub head_offset: usize,
    /// First sequence position held locally in the residual stream (sequence parallelism).
    pub seq_offset: usize,
    /// The global sequence positions of the local sequence, when they are not `0..seq`
    /// (context parallelism: a rank holds chunks of every sequence). Rotary embeddings and
    /// dropout masks use them; `None` means `seq_offset..`.
    pub positions: Option<Arc<[usize]>>,
    /// Collects mixture-of-experts layers' auxiliary losses and routing statistics when set
    /// (without it, auxiliary losses are not added).
    pub moe: Option<MoeHook>,
    /// Computes attention's core (softmax of scores times values) in place of the local causal
    /// attention when set: context parallelism, whose keys and values live on other ranks too.
    pub core_attention: Option<AttentionHook>,
    /// Runs the transformer blocks when set: activation checkpointing recomputes some of them
    /// in backward instead of keeping their activations.
    pub checkpointing: Option<CheckpointHook>,
    /// The sequences split across ranks when set (context parallelism, with
    /// [`ForwardContext::positions`]): what a layer defined on whole sequences gathers over.
    pub sequence: Option<SequenceHook>,
}

/// `$hook`: a shared `$op` in the forward context; two hooks are equal when they are the same
/// object (the context compares hooks, not what they compute).
macro_rules! shared_hook {
    ($hook:ident, $op:ident) => {
        #[doc = concat!("A shared [`", stringify!($op), "`]; two hooks are equal when they are the same object.")]
        #[derive(Clone)]
        pub struct $hook(pub Arc<dyn $op>);

        impl std::fmt::Debug for $hook {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(stringify!($hook))
            }
        }

        impl PartialEq for $hook {
            fn eq(&self, other: &Self) -> bool {
                Arc::ptr_eq(&self.0, &other.0)
            }
        }
    };
}

/// Sequences split across ranks (context parallelism), as a layer that needs whole sequences sees them (a mixture-of-experts layer:
/// routing, capacity, drops and the load-balancing loss are defined per whole sequence, so it
/// routes the whole sequences, as one rank would, and keeps its own tokens' part).
pub trait SequenceShare: Send + Sync {
    /// Ranks sharing each sequence.
    fn ranks(&self) -> usize;
    /// Every rank's `rows` (`[batch, local_seq, width]`: this rank's positions of each
    /// sequence) as the whole sequences, `[batch, seq_len, width]` in position order
    /// (collective).
    fn gather(&self, rows: Tensor<3>) -> Tensor<3>;
}

shared_hook!(SequenceHook, SequenceShare);

/// A block's forward as a function of the block, its input and the context it runs in
/// (everything else captured). Activation checkpointing may run it in a context of its own: a
/// recomputed mixture-of-experts block records its auxiliary losses elsewhere.
pub type BlockFn<B> = Arc<dyn Fn(&B, Tensor<3>, &ForwardContext) -> Tensor<3> + Send + Sync>;

/// Runs a model's blocks, each plainly or recomputed in backward (activation checkpointing:
/// `crate::activation_checkpointing::BlockRecompute` picks the blocks a policy names).
pub trait BlockCheckpoint: Send + Sync {
    /// `block`'s forward as block `layer` on `x`. `aux_losses`: whether the block adds
    /// auxiliary losses to `ctx`'s `moe` hook (a mixture-of-experts block), which a
    /// recomputation must carry out of its function.
    fn run(
        &self,
        layer: usize,
        block: &dyn RecomputableBlock,
        x: Tensor<3>,
        ctx: &ForwardContext,
        aux_losses: bool,
    ) -> Tensor<3>;
}

shared_hook!(CheckpointHook, BlockCheckpoint);

/// A block's forward given its input and context, as a [`BlockRun`] calls it: over the
/// parameters the run at hand reads (the recomputation's own in backward).
pub type BlockForward<'a> = &'a dyn Fn(Tensor<3>, &ForwardContext) -> Tensor<3>;

/// What a checkpointed block runs, each time (in forward, and again in backward): its
/// forward and input -> its output. Where the context differs between the runs, the run picks
/// it.
pub type BlockRun = Arc<dyn Fn(BlockForward<'_>, Tensor<3>) -> Tensor<3> + Send + Sync>;

/// One of a model's blocks and its forward, type-erased for a [`BlockCheckpoint`].
pub trait RecomputableBlock {
    /// The forward, run plainly.
    fn forward(&self, x: Tensor<3>, ctx: &ForwardContext) -> Tensor<3>;

    /// `run` on the block, keeping only `x` for backward and calling `run` again there
    /// (`crate::activation_checkpointing::checkpoint` of the block).
    fn checkpointed(&self, x: Tensor<3>, run: BlockRun) -> Tensor<3>;
}

/// A Burn module and its [`BlockFn`] as a [`RecomputableBlock`].
struct ModuleBlock<'a, B> {
    block: &'a B,
    forward: BlockFn<B>,
}

impl<B: Module + Send + Sync + 'static> RecomputableBlock for ModuleBlock<'_, B> {
    fn forward(&self, x: Tensor<3>, ctx: &ForwardContext) -> Tensor<3> {
        (self.forward)(self.block, x, ctx)
    }

    fn checkpointed(&self, x: Tensor<3>, run: BlockRun) -> Tensor<3> {
        let forward = self.forward.clone();
        crate::recompute::checkpoint(self.block, x, move |block: &B, x: Tensor<3>| {
            run(&|x, ctx| forward(block, x, ctx), x)
        })
    }
}

/// Computes causal attention over a sequence that is split across ranks.
pub trait AttentionOp: Send + Sync {
    /// `q`, `k`, `v`: `[batch, heads, seq, head_dim]` of this rank's positions
    /// ([`ForwardContext::positions`]), rotary embeddings applied. Returns this rank's rows of
    /// `softmax(q K^T / sqrt(head_dim) + causal mask) V` over the *whole* sequence's keys `K`
    /// and values `V`, `[batch, heads, seq, head_dim]`, with `ctx`'s dropout on the
    /// probabilities of layer `layer`.
    fn attend(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        ctx: &ForwardContext,
        layer: usize,
    ) -> Tensor<4>;
}

shared_hook!(AttentionHook, AttentionOp);

impl ForwardContext {
    /// Block `layer`'s forward, `forward(block, x, self)`, through the context's
    /// [`CheckpointHook`] if it has one. `aux_losses`: whether the block adds auxiliary losses
    /// to the context's `moe` hook (a mixture-of-experts block), which a recomputation must
    /// carry out of its function.
    pub fn block<B: Module + Send + Sync + 'static>(
        &self,
        layer: usize,
        block: &B,
        x: Tensor<3>,
        aux_losses: bool,
        forward: impl Fn(&B, Tensor<3>, &ForwardContext) -> Tensor<3> + Send + Sync + 'static,
    ) -> Tensor<3> {
        match &self.checkpointing {
            Some(hook) => {
                let forward = Arc::new(forward);
                let block = ModuleBlock { block, forward };
                hook.0.run(layer, &block, x, self, aux_losses)
            }
            None => forward(block, x, self),
        }
    }

    /// Dropout at `(layer, site)` on a `[batch, seq, d]` residual-stream tensor.
    pub fn hidden(&self, x: Tensor<3>, layer: usize, site: Site) -> Tensor<3> {
        let Some(d) = &self.dropout else { return x };
        let seq = match &self.positions {
            Some(p) => Coords::At(&p[self.seq_offset..]),
            None => Coords::From(self.seq_offset),
        };
        d.apply_at(
            x,
            layer,
            site,
            [Coords::From(self.sample_offset), seq, Coords::From(0)],
        )
    }

    /// Rotary tables `(cos, sin)` for a local sequence of `len` positions: `0..len`, or
    /// [`ForwardContext::positions`] when set.
    pub fn rope_tables(
        &self,
        len: usize,
        head_dim: usize,
        theta: f64,
        device: &Device,
    ) -> (Tensor<2>, Tensor<2>) {
        match &self.positions {
            Some(p) => rope_tables_at(p, head_dim, theta, device),
            None => rope_tables_at(&(0..len).collect::<Vec<_>>(), head_dim, theta, device),
        }
    }

    /// Dropout on a block of attention probabilities `[batch, heads, q, k]` whose heads start
    /// at `head_offset` (of the whole model's heads) and whose queries and keys sit at global
    /// positions `q_positions` and `k_positions`.
    pub fn attention_at(
        &self,
        probs: Tensor<4>,
        layer: usize,
        head_offset: usize,
        q_positions: &[usize],
        k_positions: &[usize],
    ) -> Tensor<4> {
        match &self.dropout {
            Some(d) => d.apply_at(
                probs,
                layer,
                Site::AttentionProbs,
                [
                    Coords::From(self.sample_offset),
                    Coords::From(head_offset),
                    Coords::At(q_positions),
                    Coords::At(k_positions),
                ],
            ),
            None => probs,
        }
    }

    /// Whether attention on `device` under this context runs as the fused op (no score
    /// tensor): where the kernels are used (`flashover_kernels::uses_kernels`) and no dropout
    /// applies to the probabilities, which the kernels do not draw.
    pub fn takes_fused_attention(&self, device: &Device) -> bool {
        self.dropout.is_none() && crate::attention_op::fuses(device)
    }

    /// Dropout on `[batch, heads, seq, seq]` attention probabilities.
    pub fn attention(&self, probs: Tensor<4>, layer: usize) -> Tensor<4> {
        match &self.dropout {
            Some(d) => d.apply(
                probs,
                layer,
                Site::AttentionProbs,
                [self.sample_offset, self.head_offset, 0, 0],
            ),
            None => probs,
        }
    }
}

/// Rotary position tables `(cos, sin)`, each `[len, head_dim / 2]`, for positions
/// `start .. start + len`.
pub fn rope_tables(
    start: usize,
    len: usize,
    head_dim: usize,
    theta: f64,
    device: &Device,
) -> (Tensor<2>, Tensor<2>) {
    rope_tables_at(
        &(start..start + len).collect::<Vec<_>>(),
        head_dim,
        theta,
        device,
    )
}

/// Rotary position tables `(cos, sin)`, each `[positions.len(), head_dim / 2]`, for the given
/// positions (a context-parallel rank's chunks of the sequence).
pub fn rope_tables_at(
    positions: &[usize],
    head_dim: usize,
    theta: f64,
    device: &Device,
) -> (Tensor<2>, Tensor<2>) {
    let half = head_dim / 2;
    let len = positions.len();
    let mut cos = Vec::with_capacity(len * half);
    let mut sin = Vec::with_capacity(len * half);
    for &pos in positions {
        for i in 0..half {
            let freq = theta.powf(-(2.0 * i as f64) / head_dim as f64);
            let angle = pos as f64 * freq;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (
        Tensor::from_data(TensorData::new(cos, [len, half]), device),
        Tensor::from_data(TensorData::new(sin, [len, half]), device),
    )
}
