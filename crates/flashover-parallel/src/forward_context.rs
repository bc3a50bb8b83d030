//! What a forward knows about where it runs, and the dispatch points through which parallelism
//! strategies change how it computes.
//!
//! A [`ForwardContext`] travels with every forward of the reference model. Its offsets and
//! positions say where this rank's tensors sit in the logical ones (what a single rank would
//! hold), so dropout masks and rotary tables are those of one rank. Its hooks are the places a
//! strategy installs itself without the model knowing which strategies run: a linear layer
//! ([`LinearOp`], zero-bubble weight-gradient deferral, a plan's tensor-parallel layers), the
//! embedding and loss ([`VocabOp`], a table split by vocabulary), attention's core ([`AttentionOp`],
//! context parallelism), a block ([`CheckpointHook`], activation checkpointing), a
//! mixture-of-experts layer's experts ([`crate::moe::MoeHook`], expert parallelism), and the
//! sequences split across ranks that such a layer routes whole ([`SequenceShare`], context
//! parallelism).
//!
//! Beside it, what the context computes with and names no model of: the output head and its
//! loss ([`OutputHead`], [`next_token_loss`]) and the rotary tables ([`rope_tables_at`]). With
//! the mixture of experts (`crate::moe`, its SwiGLU experts included) this module is what a
//! parallelism library needs of a model's forward, so both can move below the reference
//! transformer (which then depends on the library, not the reverse).

use crate::activation_checkpointing::BlockRecompute;
use crate::dropout::{Coords, Dropout, Site};
use burn::module::Module;
use burn::nn::{Embedding, Linear};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use std::sync::Arc;

/// Where a forward runs: its dropout, where its local tensors sit in the logical ones, and who
/// computes its linear layers.
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
    /// Computes the blocks' linear layers in place of [`Linear::forward`] when set.
    pub linear: Option<LinearHook>,
    /// Embeds tokens and computes the loss in place of the local embedding and head when set.
    pub vocab: Option<VocabHook>,
    /// Runs mixture-of-experts layers' experts and collects their auxiliary losses when set
    /// (without it, experts run locally and auxiliary losses are not added).
    pub moe: Option<crate::moe::MoeHook>,
    /// Computes whole mixture-of-experts layers in place of [`crate::moe::Moe::forward_with`] when
    /// set (a plan's layers, which find their experts' placement themselves).
    pub moe_layer: Option<MoeLayerHook>,
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
    /// Every rank's `rows` (`[batch, local_seq, width]`, row-major: this rank's positions of
    /// each sequence) as the whole sequences, `[batch, seq_len, width]` in position order
    /// (collective).
    fn gather(&self, rows: &[f32], batch: usize, width: usize) -> Vec<f32>;
    /// `value` summed over the ranks (collective).
    fn sum(&self, value: f64) -> f64;
}

shared_hook!(SequenceHook, SequenceShare);

/// A block's forward as a function of the block, its input and the context it runs in
/// (everything else captured). Activation checkpointing may run it in a context of its own: a
/// recomputed mixture-of-experts block records its auxiliary losses elsewhere.
pub type BlockFn<B> = Arc<dyn Fn(&B, Tensor<3>, &ForwardContext) -> Tensor<3> + Send + Sync>;

/// Runs a model's blocks under a [`crate::activation_checkpointing::CheckpointPolicy`]: the
/// blocks it names keep only their input and run again in backward.
#[derive(Clone)]
pub struct CheckpointHook(pub Arc<BlockRecompute>);

impl std::fmt::Debug for CheckpointHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CheckpointHook")
    }
}

impl PartialEq for CheckpointHook {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
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

/// Computes a linear layer in place of [`Linear::forward`]: how a strategy changes the way a
/// weight's gradient is produced (a zero-bubble pipeline defers it to a later action) or how a
/// split layer computes (a plan's tensor-parallel layers).
pub trait LinearOp: Send + Sync {
    /// `linear` applied to `x: [batch, seq, d_in]`.
    fn apply(&self, linear: &Linear, x: Tensor<3>) -> Tensor<3>;

    /// `layers` applied to one input `x` (attention's query, key and value; SwiGLU's gate and
    /// up), in order: by default one by one, and an op may share work between them (one entry
    /// into a tensor-parallel region).
    fn apply_shared(&self, layers: &[&Linear], x: Tensor<3>) -> Vec<Tensor<3>> {
        layers.iter().map(|l| self.apply(l, x.clone())).collect()
    }
}

shared_hook!(LinearHook, LinearOp);

/// The model's two vocabulary ends in place of the local ones: how tokens are embedded and how
/// the last hidden states become the loss, as a table split by vocabulary over
/// tensor-parallel ranks computes them.
pub trait VocabOp: Send + Sync {
    /// `table` looked up at `tokens: [batch, seq]`: `[batch, seq, d]`, or the rows of this
    /// rank's positions when the op splits sequences.
    fn embed(&self, table: &Embedding, tokens: Tensor<2, Int>) -> Tensor<3>;

    /// The mean next-token cross-entropy of the normed hidden states `h: [batch, seq, d]`
    /// through `head` against `targets: [batch, seq]`.
    fn loss(&self, head: OutputHead<'_>, h: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1>;
}

shared_hook!(VocabHook, VocabOp);

/// Computes a mixture-of-experts layer in place of [`crate::moe::Moe::forward_with`]: how a layer
/// whose experts a plan placed (spread over ranks, sharded) routes its tokens.
pub trait MoeLayerOp: Send + Sync {
    /// `moe` on normed `x: [batch, seq, d_model]` as layer `layer`, its auxiliary losses added
    /// to `ctx`'s [`crate::moe::MoeHook`] when it has one.
    fn apply(
        &self,
        moe: &crate::moe::Moe,
        x: Tensor<3>,
        ctx: &ForwardContext,
        layer: usize,
    ) -> Tensor<3>;
}

shared_hook!(MoeLayerHook, MoeLayerOp);

impl ForwardContext {
    /// `linear` applied to `x`, by the context's [`LinearOp`] if it has one.
    pub fn linear(&self, linear: &Linear, x: Tensor<3>) -> Tensor<3> {
        match &self.linear {
            Some(hook) => hook.0.apply(linear, x),
            None => linear.forward(x),
        }
    }

    /// `layers` applied to one input `x` (see [`LinearOp::apply_shared`]), by the context's
    /// [`LinearOp`] if it has one.
    pub fn linears<const N: usize>(&self, layers: [&Linear; N], x: Tensor<3>) -> [Tensor<3>; N] {
        match &self.linear {
            Some(hook) => match hook.0.apply_shared(&layers, x).try_into() {
                Ok(outputs) => outputs,
                Err(outputs) => panic!(
                    "a LinearOp's apply_shared returned {} outputs for {N} layers",
                    outputs.len()
                ),
            },
            None => layers.map(|l| l.forward(x.clone())),
        }
    }

    /// `table` looked up at `tokens`, by the context's [`VocabOp`] if it has one.
    pub fn embed(&self, table: &Embedding, tokens: Tensor<2, Int>) -> Tensor<3> {
        match &self.vocab {
            Some(hook) => hook.0.embed(table, tokens),
            None => table.forward(tokens),
        }
    }

    /// The mean next-token loss of the normed hidden states `h` through `head`, by the
    /// context's [`VocabOp`] if it has one ([`next_token_loss`] of the head's logits
    /// otherwise).
    pub fn loss(&self, head: OutputHead<'_>, h: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        match &self.vocab {
            Some(hook) => hook.0.loss(head, h, targets),
            None => next_token_loss(head.logits(h), targets),
        }
    }

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
            Some(hook) => hook
                .0
                .run(layer, block, x, self, aux_losses, Arc::new(forward)),
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

/// The transformer's LM head: a layer of its own, or the token embedding's table (tied).
#[derive(Debug, Clone, Copy)]
pub enum OutputHead<'a> {
    /// The embedding table `[vocab, d]`, read transposed.
    Tied(&'a Embedding),
    /// A linear layer `[d, vocab]`.
    Untied(&'a Linear),
}

impl OutputHead<'_> {
    /// Logits of normed hidden states: `[batch, seq, d_model]` -> `[batch, seq, vocab]`.
    pub fn logits(&self, h: Tensor<3>) -> Tensor<3> {
        match self {
            OutputHead::Untied(head) => head.forward(h),
            OutputHead::Tied(embed) => {
                let [b, t, d] = h.dims();
                let w = embed.weight.val(); // [vocab, d]
                let v = w.dims()[0];
                h.reshape([b * t, d])
                    .matmul(w.transpose())
                    .reshape([b, t, v])
            }
        }
    }
}

/// Mean next-token cross-entropy (nats): `logits: [batch, seq, vocab]`, `targets: [batch, seq]`.
/// Computed in f32 whatever the logits' dtype (a reduced-precision softmax over a large
/// vocabulary loses the loss's low digits).
pub fn next_token_loss(logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
    let [b, t, v] = logits.dims();
    let logits = logits.cast(burn::tensor::FloatDType::F32);
    let logp = log_softmax(logits.reshape([b * t, v]), 1);
    let picked = logp.gather(1, targets.reshape([b * t, 1]));
    picked.mean().neg()
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
