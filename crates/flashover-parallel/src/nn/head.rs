//! A language model's output head and its next-token loss, split by vocabulary where a plan
//! placed it (Megatron's vocabulary-parallel cross-entropy: whole logits never on one rank).

use super::embedding::{table_split, tied_logits};
use super::linear::{head_split, placed_linear};
use super::{Embedding, Linear};
use crate::tensor_parallel::vocab_parallel_cross_entropy;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor};

/// A language model's output head: a linear layer of its own, or its token embedding's table
/// read transposed (tied).
#[derive(Debug, Clone, Copy)]
pub enum OutputHead<'a> {
    /// The embedding table `[vocab, d]`, read transposed.
    Tied(&'a Embedding),
    /// A linear layer `[d, vocab]`.
    Untied(&'a Linear),
}

impl OutputHead<'_> {
    /// Logits of normed hidden states: `[batch, seq, d_model]` -> `[batch, seq, vocab]`, or
    /// this rank's part of the vocabulary when the plan split the head.
    pub fn logits(&self, h: Tensor<3>) -> Tensor<3> {
        match self {
            OutputHead::Untied(head) => head.forward(h),
            OutputHead::Tied(table) => table.logits(h),
        }
    }

    /// The mean next-token cross-entropy of the normed hidden states `h: [batch, seq, d]`
    /// against `targets: [batch, seq]`: [`next_token_loss`] of the logits, or, when the plan
    /// split the head by vocabulary, the vocabulary-parallel one from each rank's part (the
    /// same value on every `tp` rank).
    pub fn next_token_loss(&self, h: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        let (logits, split) = match self {
            OutputHead::Tied(table) => {
                let (weight, split) = table_split(&table.weight);
                let logits = tied_logits(weight, split.as_ref().map(|(_, tp)| tp), h);
                (logits, split.map(|(shard, tp)| (shard, tp.group)))
            }
            OutputHead::Untied(head) => (
                placed_linear(&head.weight, head.bias.as_ref(), h),
                head_split(&head.weight),
            ),
        };
        match split {
            Some((shard, group)) => vocab_parallel_cross_entropy(logits, targets, &shard, &group),
            None => next_token_loss(logits, targets),
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
