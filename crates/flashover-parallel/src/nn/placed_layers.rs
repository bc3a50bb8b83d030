//! A forward context's layer hooks computing through a plan's placements: for a model whose
//! layers run through a `ForwardContext` (the reference transformer) rather than being
//! declared as [`super::Linear`] and [`super::Embedding`].

use super::MoeForward;
use super::embedding::{placed_embedding, table_split, tied_logits};
use super::linear::{head_split, placed_linear, placed_linears};
use crate::forward_context::{
    ForwardContext, LinearHook, LinearOp, MoeLayerHook, MoeLayerOp, OutputHead, VocabHook, VocabOp,
    next_token_loss,
};
use crate::moe::LocalExperts;
use crate::moe::{Moe, MoeHook};
use crate::tensor_parallel::vocab_parallel_cross_entropy;
use burn::nn::{Embedding, Linear};
use burn::tensor::{Int, Tensor};
use std::sync::Arc;

/// The linear and vocabulary hooks of [`placed_context`], for a context of one's own.
pub fn placed_hooks() -> (LinearHook, VocabHook) {
    let layers = Arc::new(PlacedLayers);
    (LinearHook(layers.clone()), VocabHook(layers))
}

/// A forward context whose linear layers, embedding, loss and mixture-of-experts layers
/// compute as the plan placed their parameters (split over `tp`, experts spread over `ep`),
/// collecting the experts' auxiliary losses in its `moe` hook.
pub fn placed_context() -> ForwardContext {
    let (linear, vocab) = placed_hooks();
    ForwardContext {
        linear: Some(linear),
        vocab: Some(vocab),
        moe_layer: Some(MoeLayerHook(Arc::new(PlacedLayers))),
        // Collects the auxiliary losses only: the layers above run the experts.
        moe: Some(MoeHook::new(Arc::new(LocalExperts))),
        ..ForwardContext::default()
    }
}

/// The forward-context hooks through which a model whose layers are Burn's `Linear` and
/// `Embedding` and Flashover's mixture of experts computes them as a plan placed them: each
/// reads its split from the parameters' [`crate::parallelize::Placed`], as [`super::Linear`]
/// and [`super::Embedding`] do for a model declared with them.
pub struct PlacedLayers;

impl LinearOp for PlacedLayers {
    fn apply(&self, linear: &Linear, x: Tensor<3>) -> Tensor<3> {
        placed_linear(&linear.weight, linear.bias.as_ref(), x)
    }

    fn apply_shared(&self, layers: &[&Linear], x: Tensor<3>) -> Vec<Tensor<3>> {
        let params: Vec<_> = layers
            .iter()
            .map(|l| (&l.weight, l.bias.as_ref()))
            .collect();
        placed_linears(&params, x)
    }
}

impl MoeLayerOp for PlacedLayers {
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

impl VocabOp for PlacedLayers {
    fn embed(&self, table: &Embedding, tokens: Tensor<2, Int>) -> Tensor<3> {
        placed_embedding(&table.weight, tokens)
    }

    fn loss(&self, head: OutputHead<'_>, h: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        let (logits, split) = match head {
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
