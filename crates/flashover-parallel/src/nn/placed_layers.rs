//! The forward context of a model whose mixture-of-experts layers report to one (the
//! reference transformer).

use crate::forward_context::{ForwardContext, MoeHook};

/// A forward context that counts the mixture-of-experts layers' routing and collects their
/// auxiliary losses in its `moe` hook. The layers themselves compute as the plan placed their
/// experts ([`crate::expert_parallel::MoeForward`]), as linear layers, embeddings and heads do (`crate::nn`'s
/// layers).
pub fn placed_context() -> ForwardContext {
    ForwardContext {
        moe: Some(MoeHook::new()),
        ..ForwardContext::default()
    }
}
