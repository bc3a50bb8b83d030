//! # flashover-models: the reference transformer
//!
//! A Llama-style decoder-only transformer (token embedding, RMSNorm, causal multi-head attention
//! with rotary position embeddings, SwiGLU MLP, tied or untied LM head) as ordinary Burn modules.
//! Its pieces (embedding, blocks, final norm and head) are separate so later strategies can split
//! them (tensor parallel by layer, pipeline by block, context parallel by position).
//!
//! Initial weights are drawn on the host from a per-parameter seed ([`init`]): the same
//! configuration and seed give bit-identical models on any rank, thread or device.
//!
//! ```
//! use burn::tensor::{Device, Int, Tensor};
//! use flashover_models::{TransformerConfig, next_token_loss};
//!
//! let device = Device::flex();
//! let model = TransformerConfig::tiny(16).init(7, &device);
//! let tokens = Tensor::<2, Int>::from_ints([[1, 2, 3, 4, 5]], &device);
//! let (inputs, targets) = (tokens.clone().narrow(1, 0, 4), tokens.narrow(1, 1, 4));
//! let loss: f32 = next_token_loss(model.forward(inputs), targets).into_scalar();
//! assert!((loss - (16f32).ln()).abs() < 0.5); // near uniform at initialisation
//! ```
#![warn(missing_docs)]

pub mod init;
mod layers;
mod model;
pub mod transformer;

/// The mixture-of-experts layer, which the library defines (its experts spread by a plan's
/// `expert_parallel` rule).
pub use flashover_parallel::moe;

pub use flashover_parallel::dropout::{Coords, Dropout, Site};
pub use flashover_parallel::forward_context::{
    AttentionHook, AttentionOp, BlockFn, CheckpointHook, ForwardContext, SequenceHook,
    SequenceShare, rope_tables, rope_tables_at,
};
pub use flashover_parallel::moe::{Moe, MoeConfig, MoeHook, SwiGlu};
pub use flashover_parallel::nn::{OutputHead, next_token_loss};
pub use layers::{Attention, Block};
pub use model::{Transformer, TransformerConfig};
