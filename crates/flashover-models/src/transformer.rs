//! The reference transformer ([`crate::Transformer`]) parallelized by a plan, as a user's model
//! is, from its own crate: the library knows no model. [`plan`] reads the model's own plan
//! ([`TransformerConfig::plan_toml`]), [`flashover_parallel::parallelize::parallelize`] applies
//! it, and the model computes what the plan placed: its layers are the library's
//! ([`flashover_parallel::nn::Linear`], [`flashover_parallel::nn::Embedding`] and its
//! [`flashover_parallel::nn::OutputHead`], the mixture of experts through [`forward_context`]'s
//! hook), the same a user's model declares. [`PipelineModel`] runs its stages.
//!
//! ```
//! use burn::tensor::{Device, Int, Tensor};
//! use flashover_models::{ForwardContext, TransformerConfig, transformer};
//! use flashover_parallel::parallelize::parallelize;
//! use flashover_runtime::launch;
//!
//! let config = TransformerConfig::tiny(16);
//! let tokens = |device: &Device| Tensor::<2, Int>::from_ints([[1, 2, 3, 4, 5]], device);
//! let device = Device::flex().autodiff();
//! let (inputs, targets) = (tokens(&device).narrow(1, 0, 4), tokens(&device).narrow(1, 1, 4));
//! let one_rank = config.init(3, &device).forward_loss(inputs, targets, &ForwardContext::default());
//! let one_rank: f32 = one_rank.into_scalar();
//! let losses = launch("tp=2", |ctx| {
//!     let plan = transformer::plan(&config)?; // tensor and sequence parallel
//!     let device = ctx.device().clone().autodiff();
//!     let (model, _par) = parallelize(config.init(3, &device), &plan, &ctx)?;
//!     let tokens = tokens(&device);
//!     let (inputs, targets) = (tokens.clone().narrow(1, 0, 4), tokens.narrow(1, 1, 4));
//!     let loss = model.forward_loss(inputs, targets, &transformer::forward_context());
//!     Ok::<f32, flashover_parallel::ParallelError>(loss.into_scalar())
//! })
//! .unwrap();
//! assert!((losses[0] - one_rank).abs() < 1e-5 && losses[0] == losses[1]);
//! ```

use crate::{Block, Dropout, ForwardContext, MoeHook, Transformer, TransformerConfig};
use burn::tensor::{Int, Tensor};
use flashover_comm::Group;
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::{
    ParallelizePlan, Parallelized, PipelineModel, PipelineRule, TpSplit, tp_split,
};
use flashover_parallel::pipeline::ScheduleKind;

/// The reference transformer's plan for `config` ([`TransformerConfig::plan_toml`]): Megatron's
/// tensor-parallel split with sequence parallelism (clear `sequence_parallel` to keep whole
/// sequences between the regions), a mixture-of-experts model's experts over `ep`. Add
/// `fully_shard` units and a pipeline ([`pipeline`]) as the job asks. Routing biases that
/// move during training (`bias_update_rate`) move by the whole batch's loads: the context's
/// `moe` hook counts every layer's routing, [`ExpertRouting::loads`](flashover_parallel::parallelize::ExpertRouting::loads) sums a
/// step's counts over the ranks, and [`update_routing_biases`] moves the biases.
pub fn plan(config: &TransformerConfig) -> Result<ParallelizePlan, ParallelError> {
    config.validate().map_err(ParallelError::Invalid)?;
    ParallelizePlan::from_toml(&config.plan_toml())
}

/// Moves every mixture-of-experts layer's routing bias of `model` by `loads` (per layer, the
/// whole batch's assignments per expert: [`ExpertRouting::loads`](flashover_parallel::parallelize::ExpertRouting::loads)), as
/// `Moe::update_bias` does on one device. Every rank moves every layer's bias, its stage's or
/// not, so they stay equal everywhere.
pub fn update_routing_biases(model: &mut Transformer, loads: &[Vec<u64>]) {
    for (block, routed) in model.blocks.iter_mut().zip(loads) {
        if let Some(moe) = block.moe.as_mut() {
            moe.update_bias(routed);
        }
    }
}

/// A pipeline over the reference transformer's blocks: the embedding on the first stage, the
/// final norm and the head on the last (the embedding table again when the head is tied).
pub fn pipeline(
    config: &TransformerConfig,
    schedule: ScheduleKind,
    micro_batches: usize,
) -> PipelineRule {
    let head = if config.tie_embeddings {
        "embed"
    } else {
        "head"
    };
    PipelineRule::new("blocks", schedule, micro_batches)
        .first(&["embed"])
        .last(&["norm", head])
}

/// The forward context in which the reference transformer computes with the parameters as a
/// plan placed them: its linear layers, embedding and head through [`flashover_parallel::nn`]'s functions
/// (Megatron's collectives around split layers, Burn's forward for whole ones), and its
/// mixture-of-experts layers through [`flashover_parallel::expert_parallel::MoeForward`], their auxiliary losses
/// collected in the context's `moe` hook ([`objective`] adds them). Without dropout
/// ([`dropout_context`] adds it).
pub fn forward_context() -> ForwardContext {
    flashover_parallel::nn::placed_context()
}

/// [`forward_context`] with `dropout` on the samples from global index `sample_offset` (this
/// rank's first: `Parallelized::data().batch_share(..).start`, or a pipeline micro-batch's first:
/// the start of the samples `micro_batch` receives), each of `seq` tokens: every rank draws
/// its part of the one-device masks, at its attention heads under tensor parallelism and its
/// positions under sequence parallelism, read from how the plan split `model`'s attention
/// (in the blocks this rank holds). A pipeline passes it to the layers in an [`LmBatch`].
pub fn dropout_context(
    model: &Transformer,
    dropout: Dropout,
    sample_offset: usize,
    seq: usize,
) -> ForwardContext {
    let mut ctx = forward_context();
    ctx.dropout = Some(dropout);
    ctx.sample_offset = sample_offset;
    // Under a pipeline the other stages' blocks are placeholders, with no split recorded.
    if let Some((heads, split)) = model.blocks.iter().find_map(attention_split) {
        set_tp_offsets(&mut ctx, &split.group, heads, seq, split.sequence_parallel);
    }
    ctx
}

/// The forward contexts of a parallelized reference transformer's micro-batches, worked out
/// once: what they all share (the plan's attention across the `cp` ranks, this rank's heads
/// and positions of the dropout masks), to which each micro-batch adds its dropout and first
/// sample. [`Self::of`] is [`split_sequences`] of [`dropout_context`] (or of
/// [`forward_context`] without dropout), without asking the model again.
#[derive(Clone, Debug)]
pub struct MicroBatchContexts {
    /// Without dropout: [`split_sequences`] of [`forward_context`].
    plain: ForwardContext,
    /// With dropout: the same, this rank's heads and positions of the masks placed.
    placed: ForwardContext,
}

impl MicroBatchContexts {
    /// The contexts of `model` under `par` for sequences of `seq` positions, each rank
    /// holding `local_seq` of them (fewer under context parallelism).
    pub fn new(
        par: &Parallelized,
        model: &Transformer,
        seq: usize,
        local_seq: usize,
    ) -> Result<Self, ParallelError> {
        let mut placed = forward_context();
        // Under a pipeline the other stages' blocks are placeholders, with no split recorded.
        if let Some((heads, split)) = model.blocks.iter().find_map(attention_split) {
            set_tp_offsets(
                &mut placed,
                &split.group,
                heads,
                local_seq,
                split.sequence_parallel,
            );
        }
        Ok(MicroBatchContexts {
            plain: split_sequences(par, model, forward_context(), seq)?,
            placed: split_sequences(par, model, placed, seq)?,
        })
    }

    /// The context of a micro-batch whose first sample has global index `sample_offset`,
    /// dropping with `dropout` when given; its own hook collects the auxiliary losses.
    pub fn of(&self, dropout: Option<Dropout>, sample_offset: usize) -> ForwardContext {
        // Without dropout the samples' offset stays 0, as forward_context's.
        let (shared, sample_offset) = match dropout {
            Some(_) => (&self.placed, sample_offset),
            None => (&self.plain, 0),
        };
        ForwardContext {
            sample_offset,
            dropout,
            moe: Some(MoeHook::new()),
            ..shared.clone()
        }
    }
}

/// `ctx` with the reference transformer's attention reaching across the `cp` ranks over
/// sequences of `seq` positions, when `par`'s plan splits them (its `context_parallel` rule
/// names no attention cores: the model's attention runs through the context): each rank then
/// computes its positions of every sequence (`par.sequence_share` of the tokens and targets).
/// `ctx` itself otherwise.
pub fn split_sequences(
    par: &Parallelized,
    model: &Transformer,
    ctx: ForwardContext,
    seq: usize,
) -> Result<ForwardContext, ParallelError> {
    // This rank's heads: the plan's tp split of the attention, in the blocks it holds.
    let heads = model
        .blocks
        .iter()
        .find_map(attention_split)
        .map(|(heads, split)| heads / split.group.size())
        .or_else(|| model.blocks.first().map(|b| b.attn.n_heads))
        .unwrap_or(1);
    par.sequences().forward_context(ctx, seq, heads)
}

/// The attention heads of `block` and how the plan split them over `tp` (read from its query
/// projection), when it did.
pub fn attention_split(block: &Block) -> Option<(usize, &TpSplit)> {
    Some((block.attn.n_heads, tp_split(&block.attn.wq.weight)?))
}

/// Sets where this `tp` rank's part of the model's `heads` attention heads starts in `ctx`
/// and, under sequence parallelism, its part of the `seq` positions: where its part of the
/// one-device dropout masks is drawn.
pub fn set_tp_offsets(
    ctx: &mut ForwardContext,
    tp: &Group,
    heads: usize,
    seq: usize,
    sequence_parallel: bool,
) {
    let (rank, n) = (tp.rank(), tp.size());
    ctx.head_offset = rank * heads / n;
    if sequence_parallel {
        ctx.seq_offset = rank * seq / n;
    }
}

/// What training minimizes on this rank: the next-token loss of `tokens` against `targets`
/// and, for a mixture-of-experts model, its layers' auxiliary losses (as `flashover train`
/// and one device with a `MoeHook` do), in [`forward_context`]. Run it in
/// [`Parallelized::forward`] to gather fully sharded blocks a unit at a time.
pub fn objective(
    model: &Transformer,
    tokens: Tensor<2, Int>,
    targets: Tensor<2, Int>,
) -> Tensor<1> {
    objective_in(model, tokens, targets, &forward_context())
}

/// [`objective`] in `ctx` ([`forward_context`] or [`dropout_context`]).
pub fn objective_in(
    model: &Transformer,
    tokens: Tensor<2, Int>,
    targets: Tensor<2, Int>,
    ctx: &ForwardContext,
) -> Tensor<1> {
    let loss = model.forward_loss(tokens, targets, ctx);
    with_aux_losses(loss, ctx)
}

/// `loss` plus the auxiliary losses `ctx`'s forwards collected, if any.
fn with_aux_losses(loss: Tensor<1>, ctx: &ForwardContext) -> Tensor<1> {
    match ctx.moe.as_ref().and_then(MoeHook::take_aux_loss) {
        Some(aux) => loss + aux,
        None => loss,
    }
}

/// One micro-batch of the reference transformer's pipeline stages: its inputs and targets
/// (`[batch, seq]` each) and the forward context its samples run in, which every stage reads:
/// [`forward_context`] for a pair (`(inputs, targets).into()`), or [`dropout_context`] at the
/// micro-batch's first sample for the one-device dropout masks.
pub struct LmBatch {
    /// Input tokens `[batch, seq]`.
    pub inputs: Tensor<2, Int>,
    /// Next-token targets `[batch, seq]`.
    pub targets: Tensor<2, Int>,
    /// What the embedding, the blocks and the head compute in.
    pub ctx: ForwardContext,
}

impl From<(Tensor<2, Int>, Tensor<2, Int>)> for LmBatch {
    fn from((inputs, targets): (Tensor<2, Int>, Tensor<2, Int>)) -> Self {
        LmBatch {
            inputs,
            targets,
            ctx: forward_context(),
        }
    }
}

/// The reference transformer's stages, each micro-batch an [`LmBatch`].
impl PipelineModel for Transformer {
    type Activation = Tensor<3>;
    type Batch = LmBatch;

    fn embed(&self, batch: &LmBatch) -> Tensor<3> {
        self.embed.forward(batch.inputs.clone())
    }

    fn layer(&self, index: usize, x: Tensor<3>) -> Tensor<3> {
        self.layer_with_aux(index, x).0
    }

    fn layer_with_aux(&self, index: usize, x: Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>) {
        block_in(self, index, x, &forward_context())
    }

    fn layer_for(
        &self,
        index: usize,
        x: Tensor<3>,
        batch: &LmBatch,
    ) -> (Tensor<3>, Option<Tensor<1>>) {
        block_in(self, index, x, &batch.ctx)
    }

    fn head_loss(&self, x: Tensor<3>, batch: &LmBatch) -> Tensor<1> {
        Transformer::head_loss(self, x, batch.targets.clone())
    }
}

/// Block `index` of `model` on `x` in `ctx`, and the auxiliary loss it added to `ctx`'s hook.
fn block_in(
    model: &Transformer,
    index: usize,
    x: Tensor<3>,
    ctx: &ForwardContext,
) -> (Tensor<3>, Option<Tensor<1>>) {
    let block = &model.blocks[index];
    // Under sequence parallelism `x` holds this rank's positions; attention sees them all.
    let parts = tp_split(&block.attn.wq.weight)
        .filter(|split| split.sequence_parallel)
        .map_or(1, |split| split.group.size());
    // This rank's positions under context parallelism (the context's), else 0..len.
    let (len, head_dim) = (x.dims()[1] * parts, block.attn.head_dim);
    let rope = ctx.rope_tables(len, head_dim, model.rope_theta, &x.device());
    let y = block.forward_with(x, &rope, ctx, index);
    (y, ctx.moe.as_ref().and_then(MoeHook::take_aux_loss))
}
