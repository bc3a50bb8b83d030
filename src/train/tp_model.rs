//! The reference transformer under tensor parallelism (Megatron) and, optionally, sequence
//! parallelism, assembled from `flashover_parallel::tensor_parallel`.
//!
//! Each rank holds a [`Transformer`] of the same structure and parameter names whose weights are
//! its shares: q/k/v and gate/up by output columns (attention by whole heads), the attention
//! output and MLP down projection by input rows, the embedding (tied to the LM head) by
//! vocabulary rows, padded to a multiple of `tp`; norms replicated. The forward puts Megatron's
//! conjugate operators around the two parallel regions of every block: four all-reduces per
//! block per step (two forward, two backward), or all-gather / reduce-scatter pairs with
//! sequence parallelism.

use burn::module::{Module, Param};
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::tensor::{Int, Tensor};
use flashover_models::{Block, ForwardContext, Site, Transformer};
use flashover_parallel::ParallelError;
use flashover_parallel::placement::PlacementTable;
use flashover_parallel::tensor_parallel::comm::{copy_to_tp, gather_from_tp, scatter_to_tp};
use flashover_parallel::tensor_parallel::{
    TensorParallel, VocabShard, gather_parts, split_dim, vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
};

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
///     let model = TpTransformer::shard(config.init(3, &Device::flex().autodiff()), &plan)?;
///     // Where each share sits in the whole model, recorded as it was cut.
///     let norm = &model.local.blocks[0].attn_norm.gamma;
///     assert_eq!(model.placements().get(norm.id).unwrap().on(Axis::Tp), Placement::Replicate);
///     assert_eq!(model.vocab().rows, 8);
///     let (inputs, targets) = (tokens().narrow(1, 0, 4), tokens().narrow(1, 1, 4));
///     let loss = model.forward_loss(inputs, targets, &ForwardContext::default());
///     let whole = model.unshard()?; // every rank's shares gathered (collective)
///     assert_eq!(whole.blocks[0].attn.n_heads, 4);
///     Ok::<f32, flashover_parallel::ParallelError>(loss.into_scalar())
/// })
/// .unwrap();
/// assert!((losses[0] - one_rank).abs() < 1e-5 && losses[0] == losses[1]);
/// ```
#[derive(Module, Debug)]
pub struct TpTransformer {
    /// This rank's shares, in the full model's structure.
    pub local: Transformer,
    /// Per-head dimension (for the rotary tables).
    pub head_dim: usize,
    #[module(skip)]
    tp: TensorParallel,
    #[module(skip)]
    vocab: VocabShard,
    /// Where every parameter's share sits in the whole model.
    #[module(skip)]
    placements: PlacementTable,
}

fn linear_from(weight: Tensor<2>) -> Linear {
    Linear {
        weight: Param::from_tensor(weight),
        bias: None,
    }
}

/// `param` replaced by `share` (its rows or columns along `dim`), recorded in `table`.
fn record_share(
    table: &mut PlacementTable,
    param: &Param<Tensor<2>>,
    share: &Param<Tensor<2>>,
    dim: usize,
) -> Result<(), ParallelError> {
    let shape = share.val().dims().to_vec();
    table.shard(param.id, share.id, flashover_runtime::Axis::Tp, dim, &shape)
}

/// The columns (`dim = 1`) or rows (`dim = 0`) of `linear` this rank holds.
fn split_linear(
    linear: &Linear,
    dim: usize,
    tp: &TensorParallel,
    table: &mut PlacementTable,
) -> Result<Linear, ParallelError> {
    let (rank, n) = (tp.group.rank(), tp.group.size());
    let share = linear_from(split_dim(&linear.weight.val(), dim, rank, n)?);
    record_share(table, &linear.weight, &share.weight, dim)?;
    Ok(share)
}

/// Every rank's columns or rows of `linear`, concatenated (collective).
fn gather_linear(
    linear: &Linear,
    dim: usize,
    tp: &TensorParallel,
) -> Result<Linear, ParallelError> {
    Ok(linear_from(gather_parts(
        linear.weight.val(),
        dim,
        &tp.group,
        None,
    )?))
}

/// A norm whose weight's gradient is all-reduced over `tp` in backward: with sequence
/// parallelism each rank sees only part of the sequence, so its gradient is a partial sum.
fn sequence_parallel_norm(norm: &RmsNorm, tp: &TensorParallel) -> RmsNorm {
    RmsNorm {
        gamma: norm.gamma.clone().map(|g| copy_to_tp(g, &tp.group)),
        epsilon: norm.epsilon,
    }
}

impl TpTransformer {
    /// This rank's shares of `full` (every rank passes the same full model). Fails, naming
    /// the sizes, when heads or the MLP width do not divide by `tp`.
    pub fn shard(full: Transformer, tp: &TensorParallel) -> Result<Self, ParallelError> {
        let table = PlacementTable::whole(&full);
        Self::shard_placed(full, tp, table)
    }

    /// [`TpTransformer::shard`] of a model whose placements other transforms have recorded
    /// already (`table`: e.g. this rank's experts), extended with the tensor-parallel splits.
    pub fn shard_placed(
        full: Transformer,
        tp: &TensorParallel,
        mut table: PlacementTable,
    ) -> Result<Self, ParallelError> {
        let (rank, n) = (tp.group.rank(), tp.group.size());
        let heads = full.blocks.first().map_or(0, |b| b.attn.n_heads);
        if !heads.is_multiple_of(n) {
            return Err(ParallelError::Invalid(format!(
                "model.n_heads = {heads} does not divide by tp = {n}: attention is split by whole \
                 heads; choose a tp that divides the head count"
            )));
        }
        let head_dim = full.blocks.first().map_or(2, |b| b.attn.head_dim);
        let mut local = full;
        for block in &mut local.blocks {
            shard_block(block, tp, &mut table)?;
        }
        let rows = local.embed.weight.val();
        let vocab = VocabShard::new(rows.dims()[0], rank, n);
        let embed = Embedding {
            weight: Param::from_tensor(vocab.take_rows(&rows)),
        };
        record_share(&mut table, &local.embed.weight, &embed.weight, 0)?;
        local.embed = embed;
        if let Some(head) = &local.head {
            // The head is `[d, vocab]`: its vocabulary columns, padded like the embedding.
            let columns = vocab.take_rows(&head.weight.val().transpose());
            let split = linear_from(columns.transpose());
            record_share(&mut table, &head.weight, &split.weight, 1)?;
            local.head = Some(split);
        }
        Ok(TpTransformer {
            local,
            head_dim,
            tp: tp.clone(),
            vocab,
            placements: table,
        })
    }

    /// Where every parameter's share sits in the whole model.
    pub fn placements(&self) -> &PlacementTable {
        &self.placements
    }

    /// The shares and their table, for a later transform that records what it does to them
    /// (expert parallelism owning the experts).
    pub(crate) fn local_and_placements_mut(&mut self) -> (&Transformer, &mut PlacementTable) {
        (&self.local, &mut self.placements)
    }

    /// The full model, gathered from every rank's shares (collective; values only).
    pub fn unshard(&self) -> Result<Transformer, ParallelError> {
        unshard_model(self.local.clone(), &self.tp, &self.vocab)
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
        let (tp, model) = (&self.tp, &self.local);
        let t = tokens.dims()[1];
        let heads = model.blocks.first().map_or(0, |b| b.attn.n_heads);
        let ctx = tp_context(ctx, tp, heads, t);
        // [batch, seq, d], or [batch, seq / tp, d] with sequence parallelism.
        let mut h = vocab_parallel_embedding(model.embed.weight.val(), tokens, &self.vocab, tp);
        let rope = ctx.rope_tables(t, self.head_dim, model.rope_theta, &h.device());
        for (layer, block) in model.blocks.iter().enumerate() {
            let (rope, tp) = (rope.clone(), tp.clone());
            h = ctx.block(layer, block, h, move |b, h, ctx| {
                tp_block_forward(b, h, &rope, ctx, layer, &tp)
            });
        }
        let head = match &model.head {
            Some(head) => head.weight.val(),
            None => model.embed.weight.val().transpose(),
        };
        tp_loss(&model.norm, head, h, targets, &self.vocab, tp)
    }

    /// How activations enter and leave the parallel regions.
    pub fn plan(&self) -> &TensorParallel {
        &self.tp
    }

    /// This rank's shares, the plan, the vocabulary rows and the placements, taken apart (to
    /// wrap the shares in fully sharded units).
    pub fn into_parts(self) -> (Transformer, TensorParallel, VocabShard, PlacementTable) {
        (self.local, self.tp, self.vocab, self.placements)
    }

    /// This rank's vocabulary rows.
    pub fn vocab(&self) -> VocabShard {
        self.vocab
    }
}

/// `ctx` with this rank's first head and (with sequence parallelism) first sequence position.
pub(crate) fn tp_context(
    ctx: &ForwardContext,
    tp: &TensorParallel,
    local_heads: usize,
    seq: usize,
) -> ForwardContext {
    let rank = tp.group.rank();
    ForwardContext {
        head_offset: rank * local_heads,
        seq_offset: if tp.sequence_parallel {
            rank * seq / tp.group.size()
        } else {
            0
        },
        ..ctx.clone()
    }
}

fn maybe_sp_norm(norm: &RmsNorm, tp: &TensorParallel) -> RmsNorm {
    if tp.sequence_parallel {
        sequence_parallel_norm(norm, tp)
    } else {
        norm.clone()
    }
}

/// One block with its weights split over `tp`: the two parallel regions between Megatron's
/// operators, residual adds and dropout outside them.
pub(crate) fn tp_block_forward(
    block: &Block,
    h: Tensor<3>,
    rope: &(Tensor<2>, Tensor<2>),
    ctx: &ForwardContext,
    layer: usize,
    tp: &TensorParallel,
) -> Tensor<3> {
    let x = tp.enter(maybe_sp_norm(&block.attn_norm, tp).forward(h.clone()));
    let attn = tp.exit(block.attn.forward_with(x, rope, ctx, layer));
    let h = h + ctx.hidden(attn, layer, Site::AttentionOut);
    let x = maybe_sp_norm(&block.mlp_norm, tp).forward(h.clone());
    // A mixture of experts is not split over tp: every tp rank routes the same (replicated)
    // tokens through its ep group, so no operator surrounds it. With sequence parallelism the
    // tokens are gathered first (routing is per whole sequence), and each rank keeps its
    // positions of the output; both ops' backward passes the gradient without summing, as
    // every tp rank computed the same.
    let mlp = match &block.moe {
        Some(moe) if tp.sequence_parallel => {
            let whole = ForwardContext {
                seq_offset: 0,
                ..ctx.clone()
            };
            let x = gather_from_tp(x, 1, &tp.group);
            scatter_to_tp(moe.forward_with(x, &whole, layer), 1, &tp.group)
        }
        Some(moe) => moe.forward_with(x, ctx, layer),
        None => tp.exit(block.feed_forward(tp.enter(x), ctx, layer)),
    };
    h + ctx.hidden(mlp, layer, Site::MlpOut)
}

/// Final norm, the head's vocabulary columns (`head: [d, rows]`) and the vocabulary-parallel
/// loss.
pub(crate) fn tp_loss(
    norm: &RmsNorm,
    head: Tensor<2>,
    h: Tensor<3>,
    targets: Tensor<2, Int>,
    vocab: &VocabShard,
    tp: &TensorParallel,
) -> Tensor<1> {
    let h = tp.enter(maybe_sp_norm(norm, tp).forward(h));
    let [b, t, d] = h.dims();
    let rows = head.dims()[1];
    let logits = h.reshape([b * t, d]).matmul(head).reshape([b, t, rows]);
    vocab_parallel_cross_entropy(logits, targets, vocab, &tp.group)
}

/// `block` with its weights replaced by this rank's shares (recorded in `table`): q/k/v and
/// gate/up by output columns, the attention output and down projection by input rows; norms and
/// mixture-of-experts layers stay whole.
pub(crate) fn shard_block(
    block: &mut Block,
    tp: &TensorParallel,
    table: &mut PlacementTable,
) -> Result<(), ParallelError> {
    let attn = &mut block.attn;
    attn.wq = split_linear(&attn.wq, 1, tp, table)?;
    attn.wk = split_linear(&attn.wk, 1, tp, table)?;
    attn.wv = split_linear(&attn.wv, 1, tp, table)?;
    attn.wo = split_linear(&attn.wo, 0, tp, table)?;
    attn.n_heads /= tp.group.size();
    if let Some(mlp) = block.mlp.as_mut() {
        mlp.w_gate = split_linear(&mlp.w_gate, 1, tp, table)?;
        mlp.w_up = split_linear(&mlp.w_up, 1, tp, table)?;
        mlp.w_down = split_linear(&mlp.w_down, 0, tp, table)?;
    }
    Ok(())
}

/// The whole model from this rank's shares `local` (collective over tp; values only).
pub(crate) fn unshard_model(
    local: Transformer,
    tp: &TensorParallel,
    vocab: &VocabShard,
) -> Result<Transformer, ParallelError> {
    let mut full = local.valid();
    for block in &mut full.blocks {
        unshard_block(block, tp)?;
    }
    let rows = Some(vocab.vocab);
    full.embed = Embedding {
        weight: Param::from_tensor(gather_parts(full.embed.weight.val(), 0, &tp.group, rows)?),
    };
    if let Some(head) = &full.head {
        let columns = gather_parts(head.weight.val(), 1, &tp.group, rows)?;
        full.head = Some(linear_from(columns));
    }
    Ok(full)
}

/// `block` with every rank's shares gathered back (collective).
pub(crate) fn unshard_block(block: &mut Block, tp: &TensorParallel) -> Result<(), ParallelError> {
    let attn = &mut block.attn;
    attn.wq = gather_linear(&attn.wq, 1, tp)?;
    attn.wk = gather_linear(&attn.wk, 1, tp)?;
    attn.wv = gather_linear(&attn.wv, 1, tp)?;
    attn.wo = gather_linear(&attn.wo, 0, tp)?;
    attn.n_heads *= tp.group.size();
    if let Some(mlp) = block.mlp.as_mut() {
        mlp.w_gate = gather_linear(&mlp.w_gate, 1, tp)?;
        mlp.w_up = gather_linear(&mlp.w_up, 1, tp)?;
        mlp.w_down = gather_linear(&mlp.w_down, 0, tp)?;
    }
    Ok(())
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
                let model = TpTransformer::shard(full, &plan)?;
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
