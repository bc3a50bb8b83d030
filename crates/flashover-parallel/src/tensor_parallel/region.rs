//! Where activations enter and leave a tensor-parallel region ([`TensorParallel`]), and the
//! vocabulary-parallel embedding lookup and cross-entropy: the pieces `crate::nn`'s layers
//! compute with when a plan splits them.

use super::comm::{copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_tp};
use burn::tensor::module::embedding;
use burn::tensor::{Bool, FloatDType, Int, Tensor, TensorData};
use flashover_comm::{Group, ReduceOp};
use flashover_runtime::TensorCollectives;
use flashover_runtime::transfers::{Cause, read};

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
        Tensor::from_data(read(Tensor::cat(parts, 0), Cause::SetUp), &device)
    }

    /// Local row of every token (0 where the token is not this rank's), a `[batch, seq, 1]`
    /// 0/1 mask of the tokens this rank holds, and a `[batch * seq, 1]` mask of the others.
    fn localize(&self, tokens: &Tensor<2, Int>) -> (Tensor<2, Int>, Tensor<3>, Tensor<2, Bool>) {
        let [b, t] = tokens.dims();
        let (start, end) = (self.start as i64, (self.start + self.rows) as i64);
        // On the device: reading the tokens to the host would drain a GPU's queue.
        let mine =
            (tokens.clone().greater_equal_elem(start)).bool_and(tokens.clone().lower_elem(end));
        let local = (tokens.clone().sub_scalar(start)).mask_fill(mine.clone().bool_not(), 0);
        let keep = mine.clone().float().reshape([b, t, 1]);
        let other = mine.bool_not().reshape([b * t, 1]);
        (local, keep, other)
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
