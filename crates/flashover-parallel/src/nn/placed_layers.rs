//! A forward context for a model whose mixture-of-experts layers run through one (the
//! reference transformer): the layers a plan placed computed by [`MoeForward`], their
//! auxiliary losses collected.

use super::MoeForward;
use crate::forward_context::{ForwardContext, MoeLayerHook, MoeLayerOp};
use crate::moe::{LocalExperts, Moe, MoeHook};
use burn::tensor::Tensor;
use std::sync::Arc;

/// A forward context whose mixture-of-experts layers compute as the plan placed their experts
/// (spread over `ep`, sharded over `fsdp`), collecting their auxiliary losses and routing
/// counts in its `moe` hook. Linear layers, embeddings and heads need no hook: `crate::nn`'s
/// layers compute as the plan placed them.
pub fn placed_context() -> ForwardContext {
    ForwardContext {
        moe_layer: Some(MoeLayerHook(Arc::new(PlacedExperts))),
        // Collects the auxiliary losses only: the layers above run the experts.
        moe: Some(MoeHook::new(Arc::new(LocalExperts))),
        ..ForwardContext::default()
    }
}

/// Mixture-of-experts layers computed by [`MoeForward`], which finds each layer's experts'
/// placement itself.
pub struct PlacedExperts;

impl MoeLayerOp for PlacedExperts {
    fn apply(&self, moe: &Moe, x: Tensor<3>, ctx: &ForwardContext, layer: usize) -> Tensor<3> {
        // The context's hook counts every layer's routing (for the routing biases' loads).
        let (y, aux) = match &ctx.moe {
            Some(hook) => MoeForward::forward_counted(moe, x, hook, layer),
            None => MoeForward::forward(moe, x),
        };
        if let (Some(aux), Some(hook)) = (aux, &ctx.moe) {
            hook.push_aux_loss(aux);
        }
        y
    }
}
