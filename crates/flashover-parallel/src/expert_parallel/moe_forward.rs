//! A mixture-of-experts layer's forward under a plan: experts spread over `ep` by an
//! `expert_parallel` rule, whole sequences routed under context parallelism.

use super::ExpertParallel;
use crate::context_parallel::CpSequences;
use crate::forward_context::{ForwardContext, MoeHook, SequenceHook};
use crate::moe::{ExpertDispatch, LocalExperts, Moe, SwiGlu};
use crate::placed::Placed;
use crate::recompute::replaying;
use crate::tensor_parallel::comm::on_whole_sequences;
use crate::zero::units::UnitGathers;
use burn::tensor::Tensor;
use std::sync::Arc;

/// The forward of a [`crate::moe::Moe`] layer in a model of your own: on one device, or
/// with its routed experts spread over `ep` by a plan's `expert_parallel` rule (each token
/// goes to the rank holding its expert and back, two all-to-alls each way), and routing whole
/// sequences under context and sequence parallelism, as one device does.
pub trait MoeForward {
    /// `x: [batch, seq, d_model]` -> the layer's output (same shape) and the weighted sum of
    /// its auxiliary losses (load balancing, z-loss), `None` when both weights are 0: add it to
    /// your loss. Every layout gives each rank a value whose mean over the ranks
    /// (`Parallelized::data().mean_loss` of `loss + aux`) is the one-device value: with `ep` and `dp`
    /// each rank's is its samples' (a mean over sequences), with `cp` each rank's part is
    /// weighted so. Nothing else changes between layouts: the plan's rules (`expert_parallel`,
    /// `context_parallel`, sequence parallelism) reach the layer through its router, and
    /// under `fully_shard` its sharded routed experts are gathered in one collective before
    /// routing, on every rank (a rank's tokens may choose none of some). Routing biases
    /// (`bias_update_rate`) move only where [`Self::forward_counted`] counts the loads.
    fn forward(&self, x: Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>);

    /// [`Self::forward`], adding this rank's routing statistics (assignments per expert) to
    /// `stats` as layer `layer` (not again when a recomputation reruns it in backward): for
    /// auxiliary-loss-free balancing, `Parallelized::experts().loads` of a step's statistics
    /// gives every rank the whole batch's loads, which `Moe::update_bias` takes.
    fn forward_counted(
        &self,
        x: Tensor<3>,
        stats: &MoeHook,
        layer: usize,
    ) -> (Tensor<3>, Option<Tensor<1>>);
}

impl MoeForward for Moe {
    fn forward(&self, x: Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>) {
        routed_on_whole_sequences(self, x, None)
    }

    fn forward_counted(
        &self,
        x: Tensor<3>,
        stats: &MoeHook,
        layer: usize,
    ) -> (Tensor<3>, Option<Tensor<1>>) {
        routed_on_whole_sequences(self, x, Some((stats, layer)))
    }
}

/// [`MoeForward::forward`] of `moe`, its statistics added to `stats` as `layer`'s if given.
fn routed_on_whole_sequences(
    moe: &Moe,
    x: Tensor<3>,
    stats: Option<(&MoeHook, usize)>,
) -> (Tensor<3>, Option<Tensor<1>>) {
    let placed = moe.router.weight.reparameterization::<Placed>();
    // Under sequence parallelism each tp rank holds part of every sequence, and routing is per
    // whole sequence: every tp rank routes the gathered sequences alike and keeps its part of
    // the output (both backward passes keep the gradient as it is: every tp rank computed the
    // same).
    if let Some(tp) = placed.and_then(Placed::sequence_tp) {
        let mut aux = None;
        let y = on_whole_sequences(x, tp, |x| {
            let (y, layer_aux) = forward_routed(moe, x, placed, stats);
            aux = layer_aux;
            y
        });
        return (y, aux);
    }
    forward_routed(moe, x, placed, stats)
}

/// [`MoeForward::forward`] of `moe` on whole sequences (of this rank's `cp` positions),
/// `placed` its router's placement.
fn forward_routed(
    moe: &Moe,
    x: Tensor<3>,
    placed: Option<&Placed>,
    stats: Option<(&MoeHook, usize)>,
) -> (Tensor<3>, Option<Tensor<1>>) {
    let mut ctx = ForwardContext::default();
    if let Some(split) = placed.and_then(Placed::context) {
        // Routing, capacity and the balancing loss are per whole sequence: the layer
        // gathers the other cp ranks' router logits (at its positions).
        let seq = x.dims()[1] * split.group.size();
        let layout = split
            .layout(seq)
            .unwrap_or_else(|e| panic!("mixture-of-experts routing: {e}"));
        let sequences = CpSequences::new(&split.group, layout);
        ctx.positions = Some(layout.positions(split.group.rank()).into());
        ctx.sequence = Some(SequenceHook(Arc::new(sequences)));
    }
    let (layer, dispatch): (std::borrow::Cow<Moe>, Arc<dyn ExpertDispatch>) =
        match placed.and_then(Placed::experts) {
            None => (std::borrow::Cow::Borrowed(moe), Arc::new(LocalExperts)),
            Some(split) => {
                let ep = ExpertParallel::placed(split)
                    .unwrap_or_else(|e| panic!("expert parallelism: {e}"));
                let mine = ep.experts_of(split.group.rank());
                // This rank's experts only (the others are placeholders here).
                let held = Moe {
                    router: moe.router.clone(),
                    experts: moe.experts[mine.clone()].to_vec(),
                    shared: moe.shared.clone(),
                    first_expert: mine.start,
                    config: moe.config.clone(),
                    expert_bias: moe.expert_bias.clone(),
                };
                (std::borrow::Cow::Owned(held), Arc::new(ep))
            }
        };
    let hook = MoeHook::new();
    ctx.moe = Some(hook.clone());
    // Fully sharded experts: gathered together before routing, on every rank of their
    // `fsdp` group, since which experts run depends on this rank's tokens.
    let gathered = gather_experts(&layer.experts);
    let mut y = layer.forward_dispatched(x, &ctx, 0, dispatch.as_ref());
    if let Some((units, names, gathered)) = gathered {
        units.release(names.iter().map(String::as_str));
        // A rank whose tokens reached none of its experts still joins their gradients'
        // reduce-scatter in backward: the gather must be on its graph.
        y = y + (gathered.sum() * 0.0).reshape([1, 1, 1]);
    }
    // A rerun in backward routes the same tokens again: counted once.
    if let Some((stats, layer)) = stats.filter(|_| !replaying()) {
        stats.add_layer_stats(layer, hook.take_stats());
    }
    (y, hook.take_aux_loss())
}

/// Gathers the fully sharded parameters of `experts` over their `fsdp` group in one
/// collective, for the experts' reads until the returned [`UnitGathers`] releases them (by
/// the returned paths); with the gathered tensor. `None` when none is sharded, or when they
/// are gathered already (with their unit or pipeline layer, on every rank).
fn gather_experts(experts: &[SwiGlu]) -> Option<(UnitGathers, Vec<String>, Tensor<1>)> {
    let mut shards = vec![];
    let mut unit: Option<UnitGathers> = None;
    let mut take = |placed: Option<&Placed>, base: Tensor<1>| {
        if let Some(placed) = placed
            && placed.fsdp_group().is_some()
            && !placed.unit_gathers().holds(placed.name())
        {
            unit.get_or_insert_with(|| placed.unit_gathers().clone());
            shards.push((placed.name().to_string(), base));
        }
    };
    for expert in experts {
        for linear in [&expert.w_gate, &expert.w_up, &expert.w_down] {
            let (weight, base) = (&linear.weight, linear.weight.base());
            let numel = base.shape().num_elements();
            take(weight.reparameterization::<Placed>(), base.reshape([numel]));
            if let Some(bias) = &linear.bias {
                take(bias.reparameterization::<Placed>(), bias.base());
            }
        }
    }
    let units = unit?;
    let names = shards.iter().map(|(n, _)| n.clone()).collect();
    let gathered = units.gather(shards)?;
    Some((units, names, gathered))
}
