//! Drop-in replacements for Burn layers that a [`crate::parallelize`] plan can split.
//!
//! Burn has no forward hooks, so a layer split over `tp` needs a forward that knows it holds a
//! part: [`Linear`] is Burn's `Linear` (same fields, same initialisation, same record) whose
//! forward adds Megatron's collectives when the plan split its weight, and is Burn's forward
//! otherwise; [`Embedding`] is Burn's `Embedding`, split by vocabulary under a `vocab` rule,
//! with the tied head ([`Embedding::logits`]) and the loss ([`Embedding::cross_entropy`]) that
//! a split table needs. Swapping Burn's layers for these is the only change a model needs for
//! tensor parallelism, besides sizing attention heads from [`Linear::d_output`].
//! [`MultiHeadAttention`], [`SwiGlu`] and [`transformer`]'s encoder, decoder and feed-forward are Burn's,
//! built on these (heads counted from the split, ready-made `tp` rules); they, [`RmsNorm`] and
//! [`BatchNorm`] (whose training statistics span the data-parallel ranks)
//! check their input against [`crate::parallelize::value_dims`] rather than a parameter's
//! stored shape, so `fully_shard` shards every one of their parameters.
//! [`CausalAttention`] is attention's core (`softmax(q k^T / sqrt(d) + mask) v`), which a
//! plan's `context_parallel` rule makes attend across the ranks that hold a sequence's other
//! positions. A mixture-of-experts layer (`flashover::models::Moe`) whose experts a plan's
//! `expert_parallel` rule spreads over `ep` runs through
//! `crate::expert_parallel::MoeForward` (`flashover::nn::MoeForward`).

mod attention;
mod batch_norm;
pub(crate) mod dropout;
pub(crate) mod embedding;
mod head;
pub(crate) mod linear;
mod multi_head_attention;
mod placed_layers;
mod rms_norm;
mod sequence_split;
mod swiglu;
pub mod transformer;

pub use attention::{CausalAttention, fused_causal_attention, takes_fused_attention};
pub use batch_norm::{BatchNorm, BatchNormConfig};
pub use dropout::{Dropout, DropoutConfig, clear_dropout_draws, set_dropout_draws};
pub use embedding::{Embedding, EmbeddingConfig};
pub use head::{OutputHead, next_token_loss};
pub use linear::{Linear, LinearConfig};
pub use multi_head_attention::{MhaInput, MhaOutput, MultiHeadAttention, MultiHeadAttentionConfig};
pub use placed_layers::placed_context;
pub use rms_norm::{RmsNorm, RmsNormConfig};
pub use swiglu::{SwiGlu, SwiGluConfig};

use crate::tensor_parallel::{VocabShard, vocab_parallel_cross_entropy};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Int, Tensor};
use flashover_comm::Group;

/// The mean cross-entropy of `logits: [batch, seq, vocab]` against `targets: [batch, seq]`:
/// Burn's, or, when the logits are this rank's `shard` of the vocabulary over `group`,
/// Megatron's vocabulary-parallel one (the same value on every rank of `group`).
fn cross_entropy(
    logits: Tensor<3>,
    targets: Tensor<2, Int>,
    split: Option<(VocabShard, Group)>,
) -> Tensor<1> {
    match split {
        Some((shard, group)) => vocab_parallel_cross_entropy(logits, targets, &shard, &group),
        None => {
            let [batch, seq, vocab] = logits.dims();
            CrossEntropyLossConfig::new()
                .init(&logits.device())
                .forward(
                    logits.reshape([batch * seq, vocab]),
                    targets.reshape([batch * seq]),
                )
        }
    }
}
