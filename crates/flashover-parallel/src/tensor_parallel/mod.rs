//! Tensor parallelism (Megatron-style) and sequence parallelism over the `tp` mesh axis.
//!
//! **What is split:** individual weight matrices. A column-parallel layer holds a block of
//! output features, a row-parallel layer a block of input features, the embedding and the LM
//! head a block of vocabulary rows (padded to a multiple of `tp`; padding never changes
//! results). **Communication:** the conjugate operators of [`comm`]: a column layer followed by
//! a row layer (attention: q/k/v then output; MLP: gate/up then down) costs one all-reduce
//! forward and one backward, so a transformer block costs four per step. With sequence
//! parallelism the activations between those regions (norms, residuals) are split along the
//! sequence and each all-reduce becomes an all-gather / reduce-scatter pair; replicated
//! parameters used there (norm weights) then get their gradient all-reduced over `tp`.
//!
//! A model splits its layers with a plan's `tensor_parallel` rules on `crate::nn`'s `Linear`
//! and `Embedding`, which compute with these pieces.

pub(crate) mod async_colwise;
pub mod comm;
mod loss_op;
mod region;
mod shard;

pub use region::{
    TensorParallel, VocabShard, vocab_parallel_cross_entropy, vocab_parallel_embedding,
};
pub use shard::split_dim;
