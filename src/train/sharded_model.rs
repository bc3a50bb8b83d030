//! The reference transformer under ZeRO-3 / FSDP with the policy "every block": one fully
//! sharded unit per block and one for the rest (embedding, final norm, LM head), as TorchTitan
//! applies `fully_shard` to each block and then to the root.
//!
//! The root unit stays gathered for the whole step (its embedding is used first and its head
//! last); each block is gathered just before its forward and, with `reshard_after_forward`,
//! released right after and gathered again for its backward. The next block's all-gather is
//! prefetched while the current block computes, in forward and in backward.
//!
//! Under tensor parallelism ([`ShardedTransformer::tensor_parallel`]) the units hold this tp
//! rank's shares, each cut again over fsdp by rows (FSDP over TP, TorchTitan's 2-D layout): the
//! gathered shares run the tensor-parallel forward, and the placements record both splits.

use super::tp_model::{TpTransformer, tp_block_forward, tp_context};
use burn::module::Module;
use burn::tensor::{Int, Tensor};
use flashover_models::{Block, ForwardContext, Transformer};
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::TensorParallelParts;
use flashover_parallel::params::{ParamLayout, ParamSlot};
use flashover_parallel::placement::{ParamPlacement, PlacementTable};
use flashover_parallel::precision::MixedPrecision;
use flashover_parallel::tensor_parallel::TensorParallel;
use flashover_parallel::zero::{FullyShardConfig, FullyShardedUnit, ShardGroup};
use flashover_runtime::Axis;
use std::sync::Arc;

/// [`Transformer`] as fully sharded units; see the module docs.
///
/// ```
/// use burn::tensor::{Device, Int, Tensor};
/// use flashover::train::ShardedTransformer;
/// use flashover::{Axis, launch};
/// use flashover_models::{ForwardContext, TransformerConfig, next_token_loss};
/// use flashover_parallel::precision::MixedPrecision;
/// use flashover_parallel::zero::{FullyShardConfig, ShardGroup};
///
/// let config = TransformerConfig::tiny(16);
/// let losses = launch("fsdp=2", |ctx| {
///     let device = Device::flex().autodiff();
///     let units = ShardGroup::new(ctx.group(Axis::Fsdp));
///     let model = ShardedTransformer::new(config.init(3, &device), &FullyShardConfig::new(), &units)?;
///     assert!(model.largest_unit() > 0);
///     let tokens = Tensor::<2, Int>::from_ints([[1, 2, 3, 4, 5]], &device);
///     let (fwd, f32_compute) = (ForwardContext::default(), MixedPrecision::default());
///     let logits = model.forward(tokens.clone().narrow(1, 0, 4), &fwd, f32_compute)?;
///     let loss = next_token_loss(logits, tokens.narrow(1, 1, 4));
///     let whole = model.gather_full()?; // the whole model, outside any graph (collective)
///     assert_eq!(whole.blocks.len(), 2);
///     Ok::<f32, flashover_parallel::ParallelError>(loss.into_scalar())
/// })
/// .unwrap();
/// assert_eq!(losses[0], losses[1]);
/// ```
#[derive(Module, Debug)]
pub struct ShardedTransformer {
    /// Embedding, final norm and head (a `Transformer` without blocks).
    pub root: FullyShardedUnit<Transformer>,
    /// One unit per block.
    pub blocks: Vec<FullyShardedUnit<Block>>,
    /// Per-head dimension (for the rotary tables).
    pub head_dim: usize,
    /// Attention heads of the whole model (a tp rank holds its share of them).
    pub heads: usize,
    /// Where every (unsharded) parameter lives before the fsdp split, by its original id.
    #[module(skip)]
    placements: PlacementTable,
    /// With tensor parallelism: the plan and how the units' parts turn back whole.
    #[module(skip)]
    tp: Option<(TensorParallel, TensorParallelParts)>,
}

impl ShardedTransformer {
    /// Shards `model` over `shard_group` (collective).
    pub fn new(
        model: Transformer,
        config: &FullyShardConfig,
        shard_group: &Arc<ShardGroup>,
    ) -> Result<Self, ParallelError> {
        let placements = PlacementTable::whole(&model);
        Self::units(model, config, shard_group, placements, None)
    }

    /// A tensor-parallel rank's shares in units over `shard_group` (collective): FSDP over TP.
    pub fn tensor_parallel(
        model: TpTransformer,
        config: &FullyShardConfig,
        shard_group: &Arc<ShardGroup>,
    ) -> Result<Self, ParallelError> {
        let (local, tp, parts, placements) = model.into_parts();
        Self::units(local, config, shard_group, placements, Some((tp, parts)))
    }

    fn units(
        mut model: Transformer,
        config: &FullyShardConfig,
        shard_group: &Arc<ShardGroup>,
        placements: PlacementTable,
        tp: Option<(TensorParallel, TensorParallelParts)>,
    ) -> Result<Self, ParallelError> {
        let head_dim = model.blocks.first().map_or(2, |b| b.attn.head_dim);
        let heads = model.blocks.first().map_or(0, |b| b.attn.n_heads);
        let blocks = std::mem::take(&mut model.blocks)
            .into_iter()
            .map(|block| config.init(block, shard_group))
            .collect::<Result<Vec<_>, _>>()?;
        // The root is needed at both ends of the step: keeping it gathered saves a gather.
        let root_config = FullyShardConfig::new().with_reshard_after_forward(false);
        Ok(ShardedTransformer {
            root: root_config.init(model, shard_group)?,
            blocks,
            head_dim,
            heads,
            placements,
            tp,
        })
    }

    /// This rank's shards laid end to end (as the model's flat parameter vector) as pieces
    /// of the whole model's parameters: each with its placement, rows split over fsdp.
    pub fn shard_entries(&self) -> Result<Vec<(ParamSlot, ParamPlacement)>, ParallelError> {
        let offsets: Vec<usize> = ParamLayout::of(self)
            .slots
            .iter()
            .map(|s| s.offset)
            .collect();
        let table = &self.placements;
        let mut entries = self.root.placed(table, Axis::Fsdp, offsets[0])?;
        for (block, &base) in self.blocks.iter().zip(&offsets[1..]) {
            entries.extend(block.placed(table, Axis::Fsdp, base)?);
        }
        Ok(entries)
    }

    /// The mean next-token loss of `tokens` against `targets` ([`ShardedTransformer::forward`]'s
    /// logits, or with tensor parallelism the vocabulary-parallel loss).
    pub fn forward_loss(
        &self,
        tokens: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        ctx: &ForwardContext,
        precision: MixedPrecision,
    ) -> Result<Tensor<1>, ParallelError> {
        let (root, h, ctx) = self.hidden_states(tokens, ctx, precision)?;
        Ok(root.head_loss(h, targets, &ctx))
    }

    /// `tokens: [batch, seq]` -> logits `[batch, seq, vocab]`, with `ctx`'s dropout (replayed
    /// exactly when a block is recomputed in backward), each gathered unit computing in
    /// `precision`'s dtype. Without tensor parallelism (split logits are only ever reduced in
    /// the loss, [`ShardedTransformer::forward_loss`]).
    pub fn forward(
        &self,
        tokens: Tensor<2, Int>,
        ctx: &ForwardContext,
        precision: MixedPrecision,
    ) -> Result<Tensor<3>, ParallelError> {
        if self.tp.is_some() {
            return Err(ParallelError::Invalid(
                "a tensor-parallel model's logits are split by vocabulary: take its loss \
                 (forward_loss)"
                    .into(),
            ));
        }
        let (root, h, _) = self.hidden_states(tokens, ctx, precision)?;
        Ok(root.logits(h))
    }

    /// The gathered root unit (embedding, final norm, head), the last block's output on
    /// `tokens`, and the context it ran in (with tensor parallelism, this rank's offsets and
    /// the plan's layer hooks).
    fn hidden_states(
        &self,
        tokens: Tensor<2, Int>,
        ctx: &ForwardContext,
        precision: MixedPrecision,
    ) -> Result<(Transformer, Tensor<3>, ForwardContext), ParallelError> {
        if let Some(first) = self.blocks.first() {
            first.prefetch();
        }
        let root = precision.compute_view(self.root.gather()?);
        let t = tokens.dims()[1];
        let ctx = match &self.tp {
            Some((tp, _)) => tp_context(ctx, tp, self.heads, t),
            None => ctx.clone(),
        };
        let h = ctx.embed(&root.embed, tokens);
        let rope = ctx.rope_tables(t, self.head_dim, root.rope_theta, &h.device());
        let tp = self.tp.as_ref().map(|(tp, _)| tp);
        let h = self.blocks_forward(h, &ctx, rope, precision, tp)?;
        Ok((root, h, ctx))
    }

    /// Every block unit in turn on `h`, each gathered just before use with the next one
    /// prefetched, computing in `precision`'s dtype, through the tensor-parallel block forward
    /// when `tp` is given.
    fn blocks_forward(
        &self,
        mut h: Tensor<3>,
        ctx: &ForwardContext,
        rope: (Tensor<2>, Tensor<2>),
        precision: MixedPrecision,
        tp: Option<&TensorParallel>,
    ) -> Result<Tensor<3>, ParallelError> {
        for (i, block) in self.blocks.iter().enumerate() {
            if let Some(next) = self.blocks.get(i + 1) {
                next.prefetch();
            }
            // In backward, blocks run in reverse: this one's start prefetches the one before.
            let before = i.checked_sub(1).map(|j| self.blocks[j].prefetch_handle());
            let (rope, mut ctx, tp) = (rope.clone(), ctx.clone(), tp.cloned());
            // A unit that reshards after forward recomputes its block in backward already.
            if block.recomputes() {
                ctx.checkpointing = None;
            }
            let forward = move |b: &Block, h| {
                let (rope, tp) = (rope.clone(), tp.clone());
                // Each gathered block computes in the policy's dtype (its f32 gradient then
                // goes to the reduce-scatter).
                let b = precision.compute_view(b.clone());
                ctx.block(i, &b, h, move |b, h, ctx| match &tp {
                    Some(tp) => tp_block_forward(b, h, &rope, ctx, i, tp),
                    None => b.forward_with(h, &rope, ctx, i),
                })
            };
            h = block.forward_prefetching(h, forward, before)?;
        }
        Ok(h)
    }

    /// The whole model, gathered outside any graph (collective).
    pub fn gather_full(&self) -> Result<Transformer, ParallelError> {
        let this = self.valid();
        let mut model = this.root.gather()?;
        model.blocks = this
            .blocks
            .iter()
            .map(|b| b.gather())
            .collect::<Result<_, _>>()?;
        match &self.tp {
            Some((_, parts)) => Ok(parts.whole(model).valid()),
            None => Ok(model),
        }
    }

    /// Elements in the largest unit (unpadded).
    pub fn largest_unit(&self) -> usize {
        self.blocks
            .iter()
            .map(|b| b.numel())
            .chain([self.root.numel()])
            .max()
            .unwrap_or(0)
    }
}
