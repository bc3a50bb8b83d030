//! The reference transformer under tensor parallelism (Megatron) and, optionally, sequence
//! parallelism: its own plan (`TransformerConfig::plan_toml`, data in flashover-models) cut by
//! `flashover_parallel::parallelize::split_tensor_parallel`, and its own forward computing
//! through the plan's layer hooks, the cut and the operators a user's model gets from a plan.
//!
//! Each rank holds a [`Transformer`] of the same structure and parameter names whose weights are
//! its parts: q/k/v and gate/up by output columns (attention by whole heads), the attention
//! output and MLP down projection by input rows, the embedding (and an untied LM head) by
//! vocabulary rows, padded to a multiple of `tp`; norms replicated. The hooks put Megatron's
//! conjugate operators around the two parallel regions of every block: four all-reduces per
//! block per step (two forward, two backward), or all-gather / reduce-scatter pairs with
//! sequence parallelism.

use burn::module::Module;
use burn::tensor::{Int, Tensor};
use flashover_models::{Block, ForwardContext, Transformer, TransformerConfig};
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::transformer::{attention_split, layer_hooks, set_tp_offsets};
use flashover_parallel::parallelize::{
    FullyShardedUnits, ParallelizePlan, TensorParallelParts, split_and_shard,
};
use flashover_parallel::placement::PlacementTable;
use flashover_parallel::tensor_parallel::TensorParallel;
use flashover_parallel::tensor_parallel::comm::on_whole_sequences;
use flashover_parallel::zero::ShardGroup;
use std::sync::Arc;

/// [`Transformer`] split over the `tp` group; see the module docs.
///
/// ```
/// use burn::tensor::{Device, Int, Tensor};
/// use flashover::train::TpTransformer;
/// use flashover::{Axis, launch};
/// use flashover_models::{ForwardContext, TransformerConfig, next_token_loss};
/// use flashover_parallel::placement::Placement;
/// use flashover_parallel::tensor_parallel::TensorParallel;
///
/// let config = TransformerConfig::tiny(16);
/// let tokens = || Tensor::<2, Int>::from_ints([[1, 2, 3, 4, 5]], &Device::flex().autodiff());
/// let full = config.init(3, &Device::flex().autodiff());
/// let (inputs, targets) = (tokens().narrow(1, 0, 4), tokens().narrow(1, 1, 4));
/// let one_rank: f32 = next_token_loss(full.forward(inputs), targets).into_scalar();
/// let losses = launch("tp=2", |ctx| {
///     let plan = TensorParallel::new(ctx.group(Axis::Tp));
///     let model = TpTransformer::shard(config.init(3, &Device::flex().autodiff()), &config, &plan)?;
///     // Where each part sits in the whole model, recorded as it was cut.
///     let norm = &model.local.blocks[0].attn_norm.gamma;
///     assert_eq!(model.placements().get(norm.id).unwrap().on(Axis::Tp), Placement::Replicate);
///     assert_eq!(model.local.embed.weight.val().dims(), [8, 32]);
///     let (inputs, targets) = (tokens().narrow(1, 0, 4), tokens().narrow(1, 1, 4));
///     let loss = model.forward_loss(inputs, targets, &ForwardContext::default());
///     let whole = model.unshard()?; // every rank's parts gathered (collective)
///     assert_eq!(whole.embed.weight.val().dims(), [16, 32]);
///     Ok::<f32, flashover_parallel::ParallelError>(loss.into_scalar())
/// })
/// .unwrap();
/// assert!((losses[0] - one_rank).abs() < 1e-5 && losses[0] == losses[1]);
/// ```
#[derive(Module, Debug)]
pub struct TpTransformer {
    /// This rank's parts, in the full model's structure.
    pub local: Transformer,
    #[module(skip)]
    tp: TensorParallel,
    /// How the parts turn back into the whole model.
    #[module(skip)]
    parts: TensorParallelParts,
    /// Where every parameter's part sits in the whole model.
    #[module(skip)]
    placements: PlacementTable,
    /// Under ZeRO-3, the fully sharded units (every block, and the rest); none otherwise.
    #[module(skip)]
    units: FullyShardedUnits,
}

impl TpTransformer {
    /// This rank's parts of `full`, a model of `config` (every rank passes the same full
    /// model). Fails, naming the sizes, when heads or the MLP width do not divide by `tp`.
    pub fn shard(
        full: Transformer,
        config: &TransformerConfig,
        tp: &TensorParallel,
    ) -> Result<Self, ParallelError> {
        let table = PlacementTable::whole(&full);
        Self::shard_placed(full, config, tp, table)
    }

    /// [`TpTransformer::shard`] of a model whose placements other transforms have recorded
    /// already (`table`: e.g. this rank's experts), extended with the tensor-parallel splits.
    pub fn shard_placed(
        full: Transformer,
        config: &TransformerConfig,
        tp: &TensorParallel,
        table: PlacementTable,
    ) -> Result<Self, ParallelError> {
        let plan = reference_plan(config, tp.sequence_parallel)?;
        Self::shard_plan(full, &plan, tp, table, None)
    }

    /// `full` cut by `plan`'s `tensor_parallel` and `sequence_parallel` rules over `tp` and,
    /// with `fsdp`, by rows over its group in the units of `plan`'s `fully_shard` modules,
    /// which [`TpTransformer::units`] gathers: FSDP over TP, or FSDP alone on a `tp` group of
    /// one rank. Fails, naming the path, when the plan does not fit the model, and when it
    /// splits attention by other than whole heads.
    pub fn shard_plan(
        full: Transformer,
        plan: &ParallelizePlan,
        tp: &TensorParallel,
        mut table: PlacementTable,
        fsdp: Option<&Arc<ShardGroup>>,
    ) -> Result<Self, ParallelError> {
        let (local, parts, units) = split_and_shard(full, plan, &tp.group, fsdp, &mut table)?;
        if let Some((heads, _)) = local.blocks.first().and_then(attention_split) {
            let n = tp.group.size();
            if !heads.is_multiple_of(n) {
                return Err(ParallelError::Invalid(format!(
                    "model.n_heads = {heads} does not divide by tp = {n}: attention is split by \
                     whole heads; choose a tp that divides the head count"
                )));
            }
        }
        Ok(TpTransformer {
            local,
            tp: tp.clone(),
            parts,
            placements: table,
            units,
        })
    }

    /// The fully sharded units ([`TpTransformer::shard_plan`]): run the forward in their
    /// scope, [`FullyShardedUnits::forward`].
    pub fn units(&self) -> &FullyShardedUnits {
        &self.units
    }

    /// Where every parameter's part sits in the whole model.
    pub fn placements(&self) -> &PlacementTable {
        &self.placements
    }

    /// The full model, gathered from every rank's parts (collective; values only).
    pub fn unshard(&self) -> Result<Transformer, ParallelError> {
        Ok(self.parts.whole(self.local.clone()).valid())
    }

    /// Mean next-token loss of `tokens` against `targets` (both `[batch, seq]`, the same on
    /// every tp rank), computed without ever holding full logits. `ctx`'s dropout masks are the
    /// single-rank model's, restricted to this rank's heads and (with sequence parallelism)
    /// sequence positions.
    pub fn forward_loss(
        &self,
        tokens: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        ctx: &ForwardContext,
    ) -> Tensor<1> {
        self.forward_loss_of(&self.local, tokens, targets, ctx)
    }

    /// [`TpTransformer::forward_loss`] of `model`, a view of this rank's parts (the same ids
    /// and splits: a cast view of them).
    pub(crate) fn forward_loss_of(
        &self,
        model: &Transformer,
        tokens: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        ctx: &ForwardContext,
    ) -> Tensor<1> {
        let heads = split_heads(model.blocks.first());
        let ctx = tp_context(ctx, &self.tp, heads, tokens.dims()[1]);
        let tp = self.tp.clone();
        let h = model.hidden_states_with(tokens, &ctx, move |b, h, rope, ctx, layer| {
            tp_block_forward(b, h, rope, ctx, layer, &tp)
        });
        model.head_loss(h, targets, &ctx)
    }

    /// How activations enter and leave the parallel regions.
    pub fn plan(&self) -> &TensorParallel {
        &self.tp
    }

    /// This rank's parts, the plan, how they turn back whole and the placements, taken apart
    /// (to wrap the parts in fully sharded units or cut them into pipeline stages).
    pub fn into_parts(
        self,
    ) -> (
        Transformer,
        TensorParallel,
        TensorParallelParts,
        PlacementTable,
    ) {
        (self.local, self.tp, self.parts, self.placements)
    }
}

/// The reference model's own plan (`TransformerConfig::plan_toml`) as the trainer applies it:
/// without its `expert_parallel` rules (the trainer places experts itself,
/// `train::parallelize::expert_parallel`), and without its `sequence_parallel` ones unless
/// `sequence_parallel`.
pub(crate) fn reference_plan(
    config: &TransformerConfig,
    sequence_parallel: bool,
) -> Result<ParallelizePlan, ParallelError> {
    let mut plan = ParallelizePlan::from_toml(&config.plan_toml())?;
    plan.expert_parallel.clear();
    if !sequence_parallel {
        plan.sequence_parallel.clear();
    }
    Ok(plan)
}

/// The attention heads of `block` whose parts a `tp` rank's dropout offsets count: the
/// model's heads when the plan split its attention, none (offset 0) when it left it whole.
fn split_heads(block: Option<&Block>) -> usize {
    block
        .and_then(attention_split)
        .map_or(0, |(heads, _)| heads)
}

/// `ctx` with this rank's first head and (with sequence parallelism) first sequence position,
/// for a model of `heads` heads, and the plan's layer hooks where `ctx` has none (a pipeline
/// stage's context brings them already).
pub(crate) fn tp_context(
    ctx: &ForwardContext,
    tp: &TensorParallel,
    heads: usize,
    seq: usize,
) -> ForwardContext {
    let (linear, vocab) = layer_hooks();
    let mut ctx = ForwardContext {
        seq_offset: 0,
        linear: ctx.linear.clone().or(Some(linear)),
        vocab: ctx.vocab.clone().or(Some(vocab)),
        ..ctx.clone()
    };
    set_tp_offsets(&mut ctx, &tp.group, heads, seq, tp.sequence_parallel);
    ctx
}

/// One block with its weights split over `tp`, in a context from [`tp_context`]: the block's
/// own forward, whose split layers add Megatron's operators. A mixture of experts is not split
/// over tp: every tp rank routes the same (replicated) tokens through its ep group, so no
/// operator surrounds it; with sequence parallelism the tokens are gathered first (routing is
/// per whole sequence) and each rank keeps its positions of the output, both ops' backward
/// passing the gradient without summing, as every tp rank computed the same.
fn tp_block_forward(
    block: &Block,
    h: Tensor<3>,
    rope: &(Tensor<2>, Tensor<2>),
    ctx: &ForwardContext,
    layer: usize,
    tp: &TensorParallel,
) -> Tensor<3> {
    if block.moe.is_none() || !tp.sequence_parallel {
        return block.forward_with(h, rope, ctx, layer);
    }
    let h = block.attention_residual(h, rope, ctx, layer);
    let whole = ForwardContext {
        seq_offset: 0,
        ..ctx.clone()
    };
    block.feed_forward_residual(h, ctx, layer, |block, x| {
        on_whole_sequences(x, &tp.group, |x| block.feed_forward(x, &whole, layer))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Axis, launch};
    use flashover_models::TransformerConfig;
    use flashover_parallel::params::ParamLayout;
    use flashover_parallel::placement::Placement;

    #[test]
    fn the_placements_describe_what_sharding_does() {
        for tied in [true, false] {
            let mut config = TransformerConfig::new(31, 16, 2, 4, 24);
            config.tie_embeddings = tied;
            launch("tp=2", |ctx| {
                let full = config.init(3, ctx.device());
                let whole = ParamLayout::of(&full);
                let plan = TensorParallel::new(ctx.group(Axis::Tp));
                let model = TpTransformer::shard(full, &config, &plan)?;
                let entries = model.placements().entries_of(&model)?;
                assert_eq!(whole.slots.len(), entries.len());
                for (w, (local, entry)) in whole.slots.iter().zip(&entries) {
                    assert_eq!(entry.name, w.name);
                    assert_eq!(entry.global_shape, w.shape, "{}", w.name);
                    assert_eq!(entry.local_shape, local.shape, "{}", w.name);
                    let mut expected = w.shape.clone();
                    if let Placement::Shard { dim, chunk } = entry.on(Axis::Tp) {
                        assert_eq!(chunk, local.shape[dim]);
                        expected[dim] = w.shape[dim].div_ceil(2);
                    }
                    assert_eq!(local.shape, expected, "{}", w.name);
                    // Norms stay whole, every matrix is split.
                    let split = entry.on(Axis::Tp) != Placement::Replicate;
                    assert_eq!(split, w.shape.len() == 2, "{}", w.name);
                    // The last rank's vocabulary rows stop at the real vocabulary.
                    let held = entry.held(|a| ctx.coord(a));
                    let ends = held.offsets.iter().zip(&held.extents).map(|(o, e)| o + e);
                    assert!(ends.zip(&w.shape).all(|(e, s)| e <= *s), "{}", w.name);
                }
                Ok::<_, ParallelError>(())
            })
            .unwrap();
        }
    }
}
