//! Burn's `Embedding`, splittable by vocabulary, with the tied head and the loss that go with a
//! split table.

use crate::placed::{local_value, tp_split};
use crate::plan::TpStyle;
use crate::tensor_parallel::comm::{copy_to_tp, gather_from_sp};
use crate::tensor_parallel::{TensorParallel, VocabShard, vocab_parallel_embedding};
use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::Initializer;
use burn::tensor::module::embedding;
use burn::tensor::{Device, Int, Tensor};
use flashover_comm::Group;

/// Burn's [`burn::nn::Embedding`] (`weight: [vocab, d]`), splittable by a plan's `vocab` rule:
/// each `tp` rank then holds `ceil(vocab / tp)` rows (padded), looks up the tokens it holds
/// and the lookups are summed over `tp`.
#[derive(Module, Debug)]
pub struct Embedding {
    /// `[vocab, d]`, or this rank's rows of it.
    pub weight: Param<Tensor<2>>,
}

/// [`burn::nn::EmbeddingConfig`] for [`Embedding`]: the same fields, defaults and
/// initialisation.
#[derive(Config, Debug)]
pub struct EmbeddingConfig {
    /// Rows of the table (the vocabulary).
    pub n_embedding: usize,
    /// Width of each row.
    pub d_model: usize,
    /// How the table is initialised (Burn's default).
    #[config(default = "Initializer::Normal { mean: 0.0, std: 1.0 }")]
    pub initializer: Initializer,
}

impl EmbeddingConfig {
    /// A new table, initialised as Burn's `EmbeddingConfig::init` does.
    pub fn init(&self, device: &Device) -> Embedding {
        burn::nn::EmbeddingConfig::new(self.n_embedding, self.d_model)
            .with_initializer(self.initializer.clone())
            .init(device)
            .into()
    }
}

impl From<burn::nn::Embedding> for Embedding {
    fn from(layer: burn::nn::Embedding) -> Self {
        Embedding {
            weight: layer.weight,
        }
    }
}

impl Embedding {
    /// `tokens: [batch, seq]` -> `[batch, seq, d]`; under sequence parallelism `[batch, seq /
    /// tp, d]`, this rank's positions ([`Self::local_positions`]).
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        placed_embedding(&self.weight, tokens)
    }

    /// The positions of a `seq`-long sequence that [`Self::forward`]'s output holds: all of
    /// them, or under sequence parallelism this rank's `seq / tp` (for position embeddings
    /// added to it). It reads the plan's split only, never the table, so it makes no
    /// collective (under `fsdp` reading the table would gather it) and one rank may call it
    /// alone.
    ///
    /// # Panics
    /// Under sequence parallelism, when `seq` does not divide by the `tp` degree.
    pub fn local_positions(&self, seq: usize) -> std::ops::Range<usize> {
        match tp_split(&self.weight) {
            Some(split) if split.sequence_parallel => {
                let (rank, tp) = (split.group.rank(), split.group.size());
                assert!(
                    seq.is_multiple_of(tp),
                    "sequence parallelism splits the sequence evenly over tp: a sequence of \
                     {seq} positions does not divide by tp = {tp}"
                );
                let part = seq / tp;
                rank * part..(rank + 1) * part
            }
            _ => 0..seq,
        }
    }

    /// The table as a tied output head: `x: [batch, seq, d]` -> logits `x W^T`, `[batch, seq,
    /// vocab]`, or this rank's `ceil(vocab / tp)` of them when split (the gradient of `x`
    /// summed over `tp`). Pass them to [`Self::cross_entropy`].
    pub fn logits(&self, x: Tensor<3>) -> Tensor<3> {
        let (weight, split) = table_split(&self.weight);
        tied_logits(weight, split.as_ref().map(|(_, tp)| tp), x)
    }

    /// The mean next-token cross-entropy of [`Self::logits`] against `targets: [batch, seq]`;
    /// with a split table computed from each rank's part of the logits without gathering them
    /// (Megatron's vocabulary-parallel cross-entropy), the same on every `tp` rank.
    pub fn cross_entropy(&self, logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        super::cross_entropy(logits, targets, table_vocab(&self.weight))
    }
}

/// This rank's rows of an embedding table and the split, when a `vocab` rule split it.
pub(crate) fn table_split(
    weight: &Param<Tensor<2>>,
) -> (Tensor<2>, Option<(VocabShard, TensorParallel)>) {
    let (weight, split) = local_value(weight);
    let split = split.map(|s| {
        assert_eq!(
            s.style,
            TpStyle::Vocab,
            "an Embedding is split by `vocab` rules only"
        );
        let shard = VocabShard::new(s.rows, s.group.rank(), s.group.size());
        let tp = TensorParallel::new(&s.group).with_sequence_parallel(s.sequence_parallel);
        (shard, tp)
    });
    (weight, split)
}

/// The vocabulary rows and `tp` group of a table split by a `vocab` rule (for its loss as a
/// tied head), without reading its value; `None` when it is whole.
pub(crate) fn table_vocab(weight: &Param<Tensor<2>>) -> Option<(VocabShard, Group)> {
    let s = tp_split(weight)?;
    Some((
        VocabShard::new(s.rows, s.group.rank(), s.group.size()),
        s.group.clone(),
    ))
}

/// What [`Embedding::forward`] computes, for a table held by any module (the reference
/// transformer's Burn `Embedding`).
pub(crate) fn placed_embedding(weight: &Param<Tensor<2>>, tokens: Tensor<2, Int>) -> Tensor<3> {
    let split = table_split(weight);
    if let Some((_, tp)) = split.1.as_ref().filter(|(_, tp)| tp.sequence_parallel) {
        let (seq, n) = (tokens.dims()[1], tp.group.size());
        assert!(
            seq.is_multiple_of(n),
            "sequence parallelism over tp={n} splits the sequence into {n} parts: a \
             sequence of {seq} tokens does not divide; use a length that is a multiple of \
             {n}"
        );
    }
    match split {
        (weight, Some((shard, tp))) => vocab_parallel_embedding(weight, tokens, &shard, &tp),
        (weight, None) => embedding(weight, tokens),
    }
}

/// Logits of `x: [batch, seq, d]` through a table's (local rows of) `weight: [rows, d]`,
/// split over `tp` when given: under sequence parallelism `x` holds this rank's positions and
/// all of them enter the head.
pub(crate) fn tied_logits(
    weight: Tensor<2>,
    tp: Option<&TensorParallel>,
    x: Tensor<3>,
) -> Tensor<3> {
    let x = match tp {
        Some(tp) if tp.sequence_parallel => gather_from_sp(x, 1, &tp.group),
        Some(tp) => copy_to_tp(x, &tp.group),
        None => x,
    };
    x.matmul(weight.transpose().unsqueeze::<3>())
}
