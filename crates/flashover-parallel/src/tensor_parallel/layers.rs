//! Tensor-parallel layers: Megatron's column- and row-parallel linear layers, the
//! vocabulary-parallel embedding and the vocabulary-parallel cross-entropy.
//!
//! Each layer holds this rank's slice of the full layer's weight and puts the conjugate
//! operators of [`super::comm`] where Megatron puts them, so a column layer followed by a row
//! layer costs one all-reduce forward and one backward.

use super::comm::{
    copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp, reduce_scatter_to_tp,
};
use super::shard::split_dim;
use crate::error::ParallelError;
use burn::module::{Module, Param};
use burn::nn::{Embedding, Linear};
use burn::tensor::module::{embedding, linear};
use burn::tensor::{Bool, FloatDType, Int, Tensor, TensorData};
use flashover_comm::{Group, ReduceOp};
use flashover_runtime::TensorCollectives;

/// How activations enter and leave the tensor-parallel regions.
#[derive(Debug, Clone)]
pub struct TensorParallel {
    /// The `tp` group.
    pub group: Group,
    /// Sequence parallel: outside the parallel regions activations are split along the
    /// sequence (dim 1 of `[batch, seq, features]`), and the all-reduces become all-gather /
    /// reduce-scatter pairs.
    pub sequence_parallel: bool,
}

impl TensorParallel {
    /// Plain tensor parallelism over `group`.
    pub fn new(group: &Group) -> Self {
        TensorParallel {
            group: group.clone(),
            sequence_parallel: false,
        }
    }

    /// With or without sequence parallelism.
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// Entry into a column-parallel region: *f* (identity forward, all-reduce backward), or
    /// with sequence parallelism an all-gather along the sequence (reduce-scatter backward).
    pub fn enter<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        if self.sequence_parallel {
            gather_from_sp(x, 1, &self.group)
        } else {
            copy_to_tp(x, &self.group)
        }
    }

    /// Exit from a row-parallel region: *g* (all-reduce forward, identity backward), or with
    /// sequence parallelism a reduce-scatter along the sequence (all-gather backward).
    pub fn exit<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        if self.sequence_parallel {
            reduce_scatter_to_tp(x, 1, &self.group)
        } else {
            reduce_from_tp(x, &self.group)
        }
    }
}

/// Part `rank` of `n` of a weight along `dim`, as a new parameter.
fn narrow_param(
    w: &Param<Tensor<2>>,
    dim: usize,
    rank: usize,
    n: usize,
) -> Result<Param<Tensor<2>>, ParallelError> {
    Ok(Param::from_tensor(split_dim(&w.val(), dim, rank, n)?))
}

/// Column-parallel linear layer: `y = x A + b` with `A = [A_1 .. A_n]` and `b` split by output
/// features; rank `r` holds `A_r`, `b_r` and computes `y_r = x A_r + b_r`.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear {
    /// This rank's `[d_in, d_out / tp]` weight.
    pub weight: Param<Tensor<2>>,
    /// This rank's `[d_out / tp]` part of the bias, if the layer has one.
    pub bias: Option<Param<Tensor<1>>>,
    /// All-gather the output features after the product (otherwise each rank keeps its part,
    /// to feed a row-parallel layer).
    pub gather_output: bool,
    #[module(skip)]
    tp: TensorParallel,
}

impl ColumnParallelLinear {
    /// This rank's share of `full` (weight columns and bias entries).
    pub fn from_full(
        full: &Linear,
        tp: &TensorParallel,
        gather_output: bool,
    ) -> Result<Self, ParallelError> {
        let (rank, n) = (tp.group.rank(), tp.group.size());
        let bias = match &full.bias {
            Some(b) => Some(Param::from_tensor(split_dim(&b.val(), 0, rank, n)?)),
            None => None,
        };
        Ok(ColumnParallelLinear {
            weight: narrow_param(&full.weight, 1, rank, n)?,
            bias,
            gather_output,
            tp: tp.clone(),
        })
    }

    /// `x: [.., d_in]` (replicated, or sequence-split with sequence parallelism) -> `[.., d_out
    /// / tp]`, or `[.., d_out]` with `gather_output`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let bias = self.bias.as_ref().map(|b| b.val());
        let y = linear(self.tp.enter(x), self.weight.val(), bias);
        if self.gather_output {
            gather_from_tp(y, D - 1, &self.tp.group)
        } else {
            y
        }
    }
}

/// Row-parallel linear layer: `y = X A + b` with `A` split by input features and `X` by
/// columns; rank `r` computes `X_r A_r`, the partial products are summed across ranks, and the
/// bias (whole on every rank) is added once, after the sum.
///
/// With sequence parallelism the sum is a reduce-scatter along the sequence, so each rank
/// adds the bias to its own positions: all-reduce the bias's gradient over `tp` (as for the
/// norms), since each rank then sees only its positions' share.
#[derive(Module, Debug)]
pub struct RowParallelLinear {
    /// This rank's `[d_in / tp, d_out]` weight.
    pub weight: Param<Tensor<2>>,
    /// The whole `[d_out]` bias, if the layer has one (replicated over `tp`).
    pub bias: Option<Param<Tensor<1>>>,
    #[module(skip)]
    tp: TensorParallel,
}

impl RowParallelLinear {
    /// This rank's share of `full` (weight rows; the bias whole).
    pub fn from_full(full: &Linear, tp: &TensorParallel) -> Result<Self, ParallelError> {
        let (rank, n) = (tp.group.rank(), tp.group.size());
        Ok(RowParallelLinear {
            weight: narrow_param(&full.weight, 0, rank, n)?,
            bias: full
                .bias
                .as_ref()
                .map(|b| Param::from_tensor(b.val().detach())),
            tp: tp.clone(),
        })
    }

    /// `x: [.., d_in / tp]` (this rank's features) -> `[.., d_out]`, summed over ranks
    /// (sequence-split with sequence parallelism).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let y = self.tp.exit(linear(x, self.weight.val(), None));
        match &self.bias {
            Some(b) => {
                let d = b.val().dims()[0];
                let mut shape = [1; D];
                shape[D - 1] = d;
                y + b.val().reshape(shape)
            }
            None => y,
        }
    }
}

/// Which rows of a vocabulary padded to a multiple of `tp` rank `r` holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VocabShard {
    /// Real vocabulary size.
    pub vocab: usize,
    /// First row this rank holds.
    pub start: usize,
    /// Rows per rank: `ceil(vocab / tp)`.
    pub rows: usize,
}

impl VocabShard {
    /// Rank `rank` of `n`.
    pub fn new(vocab: usize, rank: usize, n: usize) -> Self {
        let rows = vocab.div_ceil(n);
        VocabShard {
            vocab,
            start: rank * rows,
            rows,
        }
    }

    /// This rank's rows of a full `[vocab, d]` table, zero-padded past the vocabulary (a new
    /// leaf tensor, outside any graph).
    pub fn take_rows(&self, full: &Tensor<2>) -> Tensor<2> {
        let [_, d] = full.dims();
        let real = self.vocab.saturating_sub(self.start).min(self.rows);
        let device = full.device();
        let mut parts = vec![];
        if real > 0 {
            parts.push(full.clone().detach().narrow(0, self.start, real));
        }
        if real < self.rows {
            parts.push(Tensor::zeros([self.rows - real, d], &device));
        }
        Tensor::from_data(Tensor::cat(parts, 0).into_data(), &device)
    }

    /// Local row of every token (0 where the token is not this rank's), a `[batch, seq, 1]`
    /// 0/1 mask of the tokens this rank holds, and a `[batch * seq, 1]` mask of the others.
    fn localize(&self, tokens: &Tensor<2, Int>) -> (Tensor<2, Int>, Tensor<3>, Tensor<2, Bool>) {
        let [b, t] = tokens.dims();
        let device = tokens.device();
        let ids: Vec<i64> = tokens
            .clone()
            .into_data()
            .convert::<i64>()
            .try_to_vec()
            .expect("i64 tokens");
        let range = self.start as i64..(self.start + self.rows) as i64;
        let local: Vec<i64> = ids
            .iter()
            .map(|&i| {
                if range.contains(&i) {
                    i - range.start
                } else {
                    0
                }
            })
            .collect();
        let keep: Vec<f32> = ids.iter().map(|i| range.contains(i) as u8 as f32).collect();
        let other: Vec<bool> = ids.iter().map(|i| !range.contains(i)).collect();
        (
            Tensor::from_data(TensorData::new(local, [b, t]), &device),
            Tensor::from_data(TensorData::new(keep, [b, t, 1]), &device),
            Tensor::from_data(TensorData::new(other, [b * t, 1]), &device),
        )
    }
}

/// Embedding lookup with the table split by vocabulary rows: each rank looks up the tokens it
/// holds (zero elsewhere) and the partial results are summed across ranks (reduce-scattered
/// along the sequence with sequence parallelism).
pub fn vocab_parallel_embedding(
    weight: Tensor<2>,
    tokens: Tensor<2, Int>,
    shard: &VocabShard,
    tp: &TensorParallel,
) -> Tensor<3> {
    let (local, keep, _) = shard.localize(&tokens);
    let keep = keep.cast(weight.dtype());
    tp.exit(embedding(weight, local) * keep)
}

/// The vocabulary-parallel embedding as a module.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding {
    /// This rank's `[ceil(vocab / tp), d]` rows.
    pub weight: Param<Tensor<2>>,
    #[module(skip)]
    shard: VocabShard,
    #[module(skip)]
    tp: TensorParallel,
}

impl VocabParallelEmbedding {
    /// This rank's rows of `full` (padded when the vocabulary does not divide by `tp`).
    pub fn from_full(full: &Embedding, tp: &TensorParallel) -> Self {
        let w = full.weight.val();
        let shard = VocabShard::new(w.dims()[0], tp.group.rank(), tp.group.size());
        VocabParallelEmbedding {
            weight: Param::from_tensor(shard.take_rows(&w)),
            shard,
            tp: tp.clone(),
        }
    }

    /// `tokens: [batch, seq]` -> `[batch, seq, d]` (sequence-split with sequence parallelism).
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        vocab_parallel_embedding(self.weight.val(), tokens, &self.shard, &self.tp)
    }
}

/// Mean next-token cross-entropy from logits split by vocabulary (`[batch, seq, rows]`, this
/// rank's rows of [`VocabShard`]), without gathering them: the maximum, the sum of
/// exponentials and the target logit are each reduced over the group (three all-reduces).
/// Padding rows past the vocabulary are excluded.
pub fn vocab_parallel_cross_entropy(
    logits: Tensor<3>,
    targets: Tensor<2, Int>,
    shard: &VocabShard,
    group: &Group,
) -> Tensor<1> {
    let [b, t, v] = logits.dims();
    let n = b * t;
    let device = logits.device();
    // In f32 under any precision policy (as Megatron upcasts its vocab-parallel loss).
    let mut logits = logits.reshape([n, v]).cast(FloatDType::F32);
    let real = shard.vocab.saturating_sub(shard.start).min(v);
    let fused = super::loss_op::fuses(&logits);
    if real < v {
        let pad: Vec<bool> = (0..n)
            .flat_map(|_| (0..v).map(move |c| c >= real))
            .collect();
        let mask = Tensor::<2, Bool>::from_data(TensorData::new(pad, [n, v]), &device);
        // The kernel's per-rank maximum must stay finite on a rank holding only padding; its
        // rows then weigh exp(-1e30 - max) = 0 in the sum over ranks.
        let fill = if fused { -1e30 } else { f32::NEG_INFINITY };
        logits = logits.mask_fill(mask, fill);
    }
    if fused {
        return fused_cross_entropy(logits, &targets, shard, group);
    }
    // The maximum only stabilises the exponentials: a constant for the gradient.
    let max = logits.clone().detach().max_dim(1);
    let max = group
        .all_reduce_tensor(max, ReduceOp::Max)
        .unwrap_or_else(|e| std::panic::panic_any(e));
    let shifted = logits - max;
    let sum_exp = reduce_from_tp(shifted.clone().exp().sum_dim(1), group);
    let (local, _, other) = shard.localize(&targets);
    // mask_fill, not a product: a rank holding only padding has -inf there.
    let picked = shifted
        .gather(1, local.reshape([n, 1]))
        .mask_fill(other, 0.0);
    let target_logit = reduce_from_tp(picked, group);
    (sum_exp.log() - target_logit).mean()
}

/// [`vocab_parallel_cross_entropy`] with each rank's maximum and sum of exponentials from the
/// fused kernel (CubeCL devices): `loss = log Σ_r s_r exp(m_r - M) + M - logit[target]`, with
/// `M` the maximum over ranks; equal to the unfused form.
fn fused_cross_entropy(
    logits: Tensor<2>,
    targets: &Tensor<2, Int>,
    shard: &VocabShard,
    group: &Group,
) -> Tensor<1> {
    let n = logits.dims()[0];
    let (max, sum) = super::loss_op::max_and_sum_exp(logits.clone());
    let global = group
        .all_reduce_tensor(max.clone().detach(), ReduceOp::Max)
        .unwrap_or_else(|e| std::panic::panic_any(e));
    let rescale = (max - global.clone()).exp().detach();
    let sum_exp = reduce_from_tp((sum * rescale).reshape([n, 1]), group);
    let (local, _, other) = shard.localize(targets);
    let picked = logits
        .gather(1, local.reshape([n, 1]))
        .mask_fill(other, 0.0);
    let target_logit = reduce_from_tp(picked, group);
    (sum_exp.log() + global.reshape([n, 1]) - target_logit).mean()
}
