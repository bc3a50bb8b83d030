//! # flashover-parallel: the strategies
//!
//! Each strategy is one public module that says what is sharded, when it is gathered and which
//! collective runs where, with its equivalence test against one rank beside it.
//!
//! - [`data_parallel`]: DDP. Replicas start from rank 0's parameters; gradients are averaged
//!   over the `dp` group in buckets, launched from a per-rank communication thread while the
//!   rest of backward still runs (on Flex, through a gradient hook; elsewhere right after
//!   backward); gradient accumulation reduces once per step; global-norm clipping.
//! - [`parallelize`]: a user's own model parallelized by a plan (module paths to strategies),
//!   unchanged: fully sharded through Burn's parameter reparameterization, linear layers split
//!   over `tp` through [`nn::Linear`].
//! - [`nn`]: drop-in replacements for Burn layers whose forward follows a plan's split.
//! - [`params`]: walking a Burn module's parameters: layout, flattening, broadcasting.
//! - [`placement`]: where every parameter lives on the mesh (replicated, sharded along a
//!   dimension, or owned by some ranks), recorded by the strategies that move it; the gradient
//!   reduction, the global norm and checkpoint regions follow from it.
//! - [`zero`]: sharded data parallel: ZeRO-1/2 (optimizer state, gradients), ZeRO-3/FSDP units
//!   (each parameter cut by rows), HSDP.
//! - [`pipeline`]: pipeline schedules as data (GPipe, 1F1B, interleaved, zero-bubble H1), checked
//!   and timed before they run.
//! - [`tensor_parallel`]: Megatron's column/row-parallel layers, vocabulary-parallel embedding and
//!   loss, sequence parallelism.
//! - [`activation_checkpointing`]: recompute whole blocks (any module) or memory-bound
//!   operations in backward instead of keeping their activations.
//! - [`context_parallel`]: sequences split over `cp`; ring attention and all-to-all (Ulysses)
//!   attention.
//! - [`expert_parallel`]: mixture-of-experts layers with experts split over `ep`, tokens sent
//!   to them by all-to-all.
//! - [`precision`]: mixed precision: compute in bf16 or f16 on f32 master weights, gradient
//!   reduction dtype, loss scaling.
//! - [`FlatAdamW`]: AdamW on a flat slice, matching Burn's AdamW, for sharded optimizers.
#![warn(missing_docs)]

pub mod activation_checkpointing;
mod attention_op;
mod collective_op;
pub mod context_parallel;
pub mod data_parallel;
pub mod dropout;
mod error;
pub mod expert_parallel;
mod flat_adamw;
pub mod forward_context;
mod grad_clip;
mod hook;
pub mod moe;
pub mod nn;
pub mod parallelize;
pub mod params;
pub mod pipeline;
pub mod placed;
pub mod placement;
pub mod plan;
pub mod precision;
mod recompute;
pub mod tensor_parallel;
mod tensor_util;
mod unit_shards;
pub mod zero;

pub use error::ParallelError;
pub use flat_adamw::{FlatAdamW, FlatAdamWConfig, ModuleAdamW};
pub use grad_clip::{GradNorm, clip_global_norm};
pub use hook::hooks_supported;
