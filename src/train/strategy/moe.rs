//! Mixture-of-experts models: experts split over `ep` (tokens reach them by all-to-all), the
//! rest replicated over the data axes or split over `tp`. Where every parameter lives (experts
//! owned over `ep` under their global index, tp shares) is in the placements, from which the
//! gradient reduction (experts over `dp`, the rest over `dp x ep`) and the norm follow.

use super::rows::FlatOptimizer;
use super::{
    Batches, NextTokenLoss, PlacedReduction, Precisions, RankStrategy, SharedState, StepOutcome,
    WholeModel, borrowed, named_params,
};
use crate::train::checkpoint::LocalState;
use crate::train::config::TrainConfig;
use crate::train::parallelize::Shares;
use crate::train::report::MoeRecord;
use crate::train::tp_model::TpTransformer;
use burn::module::Module;
use burn::optim::GradientsParams;
use flashover_models::moe::MoeStats;
use flashover_models::{Block, MoeHook, Transformer, TransformerConfig};
use flashover_parallel::FlatAdamWConfig;
use flashover_parallel::expert_parallel::ExpertParallel;
use flashover_parallel::params::{ParamLayout, accumulate_grads};
use flashover_parallel::placement::PlacementTable;
use flashover_parallel::zero::MemoryReport;
use flashover_runtime::{CommunicatorExt, Group, RankContext, RankError, ReduceOp};
use std::time::Duration;

/// An expert-parallel rank: its experts and the rest, how tokens reach the experts, how
/// gradients are reduced.
struct MoeState<M> {
    model: M,
    experts: ExpertParallel,
    hook: MoeHook,
    /// Where each parameter lives (experts owned over ep, with tp its shares).
    placements: PlacementTable,
    reduction: PlacedReduction,
    /// Replicated AdamW, or this rank's rows under ZeRO.
    optim: FlatOptimizer,
    layout: ParamLayout,
    d_model: usize,
    /// Hot experts copied to every ep rank each step (`moe.replicate_hot`).
    replicate_hot: usize,
}

/// A model whose blocks an expert-parallel step reaches between steps (routing biases).
trait MoeBlocks {
    fn moe_blocks(&self) -> &[Block];
    fn moe_blocks_mut(&mut self) -> &mut [Block];
}

impl MoeBlocks for Transformer {
    fn moe_blocks(&self) -> &[Block] {
        &self.blocks
    }
    fn moe_blocks_mut(&mut self) -> &mut [Block] {
        &mut self.blocks
    }
}

impl MoeBlocks for TpTransformer {
    fn moe_blocks(&self) -> &[Block] {
        &self.local.blocks
    }
    fn moe_blocks_mut(&mut self) -> &mut [Block] {
        &mut self.local.blocks
    }
}

impl<M: MoeBlocks> MoeState<M> {
    /// Every MoE layer's routing bias (empty vectors where balancing by bias is off).
    fn bias(&self) -> Vec<Vec<f32>> {
        self.model
            .moe_blocks()
            .iter()
            .map(|b| b.moe.as_ref().map_or(vec![], |m| m.expert_bias.clone()))
            .collect()
    }

    /// Sets the routing biases from [`MoeState::bias`]'s output (a checkpoint's).
    fn set_bias(&mut self, bias: &[Vec<f32>]) -> Result<(), RankError> {
        let blocks = self.model.moe_blocks_mut();
        super::routing_bias_layers(bias.len(), blocks.len())?;
        for (block, b) in blocks.iter_mut().zip(bias) {
            if let Some(moe) = block.moe.as_mut() {
                moe.expert_bias = b.clone();
            }
        }
        Ok(())
    }
}

impl<M: Module> MoeState<M> {
    /// `model` (this rank's experts, reached through the hook, and with tp its shares)
    /// placed as `placements` say and reduced by `reduction`, stepped by `optim`, copying the
    /// `replicate_hot` hottest experts to every ep rank.
    fn new(
        model: M,
        (experts, hook): (ExpertParallel, MoeHook),
        (placements, reduction): (PlacementTable, PlacedReduction),
        optim: FlatOptimizer,
        d_model: usize,
        replicate_hot: usize,
    ) -> Self {
        let layout = ParamLayout::of(&model);
        // Under ZeRO-3 a rank keeps only its rows between steps.
        let model = optim.between_steps(model);
        MoeState {
            placements,
            reduction,
            optim,
            hook,
            experts,
            layout,
            model,
            d_model,
            replicate_hot,
        }
    }
}

/// An expert-parallel rank of `shares` (built with only its own experts, placed by the
/// expert-parallel transform; with tp its shares).
pub(super) fn build(
    ctx: &RankContext,
    config: &TrainConfig,
    model_config: &TransformerConfig,
    shares: Shares,
    experts: ExpertParallel,
    grad_group: &Group,
    adamw: &FlatAdamWConfig,
) -> Result<Box<dyn RankStrategy>, RankError> {
    // Replicas start equal: the seeded initialisation is the same on every rank.
    let reduction = (
        shares.placements().clone(),
        PlacedReduction::new(ctx, config, grad_group)?,
    );
    let (d, hot) = (model_config.d_model, config.moe.replicate_hot);
    let hook = MoeHook::new(std::sync::Arc::new(experts.clone()));
    let experts = (experts, hook);
    let zero = config.parallel.zero;
    Ok(match shares {
        Shares::Split(model) => {
            let optim = FlatOptimizer::new(ctx, &*model, zero, adamw);
            Box::new(MoeState::new(*model, experts, reduction, optim, d, hot))
        }
        Shares::Whole(model, _) => {
            let optim = FlatOptimizer::new(ctx, &*model, zero, adamw);
            Box::new(MoeState::new(*model, experts, reduction, optim, d, hot))
        }
    })
}

impl<M: WholeModel + MoeBlocks> RankStrategy for MoeState<M> {
    fn step(
        mut self: Box<Self>,
        ctx: &RankContext,
        clip: Option<f32>,
        batches: Batches<'_>,
        micro_batches: usize,
        lr: f64,
        precision: &mut Precisions,
    ) -> Result<(Box<dyn RankStrategy>, StepOutcome), RankError> {
        let outcome = moe_step(ctx, &mut self, clip, batches, micro_batches, lr, precision)?;
        Ok((self, outcome))
    }

    fn local_state(
        &self,
        ctx: &RankContext,
        _grad_group: &Group,
    ) -> Result<SharedState, RankError> {
        self.optim.local_state(ctx, &self.model, &self.placements)
    }

    fn restore(&mut self, state: LocalState) -> Result<(), RankError> {
        self.model = self.optim.restore(state, self.model.clone())?;
        Ok(())
    }

    fn moe_bias(&self) -> Option<Vec<Vec<f32>>> {
        Some(self.bias())
    }

    fn set_moe_bias(&mut self, bias: &[Vec<f32>]) -> Result<(), RankError> {
        self.set_bias(bias)
    }

    fn full_params(&self, _ctx: &RankContext) -> Result<Vec<(String, Vec<f32>)>, RankError> {
        let model = self.optim.whole(&self.model)?;
        let whole = self.experts.gather_experts(model.whole()?)?;
        Ok(named_params(&whole))
    }
}

/// One expert-parallel step: every micro-batch's forward (tokens to their experts' ranks and
/// back) and backward with the auxiliary losses, gradients reduced over the ranks that share
/// each parameter, AdamW on this rank's parameters; routing statistics over the batch group.
fn moe_step<M: NextTokenLoss + MoeBlocks>(
    ctx: &RankContext,
    state: &mut MoeState<M>,
    clip: Option<f32>,
    batches: Batches<'_>,
    micro_batches: usize,
    lr: f64,
    precision: &mut Precisions,
) -> Result<StepOutcome, RankError> {
    let before = ctx.comm_stats();
    let a2a_before = state.experts.group().stats();
    state.experts.traffic().take();
    // Under ZeRO-3 the model is gathered for the step.
    state.model = state.optim.for_step(state.model.clone())?;
    state
        .experts
        .replicate_hot(state.model.moe_blocks(), state.replicate_hot)?;
    let mut grads = vec![0.0f32; state.layout.numel];
    let mut loss_sum = 0.0f64;
    for micro in 0..micro_batches {
        let (inputs, targets, mut fwd) = batches(micro);
        fwd.moe = Some(state.hook.clone());
        let compute = precision.policy.compute_view(state.model.clone());
        let lm = compute.loss(inputs, targets, &fwd);
        loss_sum += lm.clone().into_scalar::<f32>() as f64;
        let total = match state.hook.take_aux_loss() {
            Some(aux) => lm + aux,
            None => lm,
        };
        let mut raw = precision.scaler.scale_loss(total).backward();
        state.experts.take_replica_grads(&mut raw);
        let g = GradientsParams::from_grads(raw, &state.model);
        accumulate_grads(&state.model, &g, &mut grads, &[]);
    }
    state
        .experts
        .fold_replica_grads(&state.model, state.model.moe_blocks(), &mut grads)?;
    if precision.scaler.is_active() {
        let scale = precision.scaler.scale();
        grads.iter_mut().for_each(|g| *g /= scale);
    }
    // Under ZeRO each rank keeps the sum of its own rows over the sharding axis; the
    // placements' reducer sums the rest over the other data axes.
    let r = &state.reduction;
    let mut grads = state.optim.own_grads(grads, r.reduce_dtype())?;
    let entries = state.optim.entries(&state.placements, &state.model)?;
    let entries = borrowed(&entries);
    let grad_norm = r.reduce_and_clip(&entries, &mut grads, micro_batches, clip, ctx)?;
    drop(entries);
    let (update, loss_scale) = precision.decide(grad_norm);
    state.model = state.optim.step(lr, state.model.clone(), &grads, update)?;
    let routing = routing_record(state)?;
    let comm = ctx.comm_stats().since(&before).total();
    let a2a = state.experts.group().stats().since(&a2a_before).total();
    let (params, held) = state.optim.held(state.layout.numel);
    Ok(StepOutcome {
        loss_sum,
        grad_norm,
        comm: comm.wait + comm.transfer,
        overlapped: Duration::ZERO,
        exposed: comm.wait + comm.transfer,
        memory: MemoryReport {
            params: params * 4,
            grads: held * 4,
            optimizer: held * 8,
            gathered_peak: 0,
        },
        events: vec![],
        in_flight: 0,
        pipeline: Duration::ZERO,
        moe: Some(routing),
        a2a: a2a.wait + a2a.transfer,
        loss_scale,
        skipped: !update,
        recomputed: 0,
        attention: None,
    })
}

/// The step's routing over the whole batch group (statistics and traffic summed over it), and
/// the auxiliary-loss-free balancing that the global loads drive (every rank's biases alike).
fn routing_record<M: MoeBlocks>(state: &mut MoeState<M>) -> Result<MoeRecord, RankError> {
    let layers = state.model.moe_blocks().len();
    let n_experts = state.experts.per_rank() * state.experts.group().size();
    let stats = state.hook.take_stats();
    let remote = state.experts.traffic().take();
    let batch = state.reduction.batch();
    let routing = RoutingSums::over(stats, remote, [layers, n_experts], &[batch])?;
    state
        .experts
        .record_loads(state.model.moe_blocks(), &routing.routed);
    for (block, counts) in state.model.moe_blocks_mut().iter_mut().zip(&routing.routed) {
        if let Some(moe) = block.moe.as_mut() {
            moe.update_bias(counts);
        }
    }
    Ok(routing.record(state.d_model))
}

/// A step's routing summed over the ranks that read different samples (and under pipelines
/// over the stages, which route disjoint layers).
pub(super) struct RoutingSums {
    /// Per layer (global index) and expert: assignments before dropping.
    pub routed: Vec<Vec<u64>>,
    /// Per layer and expert: assignments kept.
    kept: Vec<Vec<u64>>,
    /// Sums of the unweighted auxiliary losses, and of the forwards they cover.
    aux_loss: f64,
    z_loss: f64,
    forwards: f64,
    /// Token rows sent to other ep ranks.
    remote: f64,
}

impl RoutingSums {
    /// This rank's `stats` (layers by global index) and `remote` rows, as `[layers, experts]`
    /// counts, summed over each of `groups` in turn (collective).
    pub fn over(
        stats: MoeStats,
        remote: u64,
        [layers, experts]: [usize; 2],
        groups: &[&Group],
    ) -> Result<Self, RankError> {
        let padded = |per_layer: &[Vec<u64>]| -> Vec<f64> {
            (0..layers * experts)
                .map(|i| {
                    let counts = per_layer.get(i / experts.max(1));
                    counts
                        .and_then(|c| c.get(i % experts))
                        .map_or(0.0, |&c| c as f64)
                })
                .collect()
        };
        let mut sums = padded(&stats.routed);
        sums.extend(padded(&stats.kept));
        sums.extend([
            stats.aux_loss,
            stats.z_loss,
            stats.forwards as f64,
            remote as f64,
        ]);
        for group in groups {
            group.all_reduce(&mut sums, ReduceOp::Sum)?;
        }
        let per_layer = |part: usize| -> Vec<Vec<u64>> {
            sums[part * layers * experts..(part + 1) * layers * experts]
                .chunks(experts.max(1))
                .map(|c| c.iter().map(|&v| v as u64).collect())
                .collect()
        };
        let tail = &sums[2 * layers * experts..];
        Ok(RoutingSums {
            routed: per_layer(0),
            kept: per_layer(1),
            aux_loss: tail[0],
            z_loss: tail[1],
            forwards: tail[2],
            remote: tail[3],
        })
    }

    /// The step's record (`d_model`: the width of a token row).
    pub fn record(self, d_model: usize) -> MoeRecord {
        let total_routed: u64 = self.routed.iter().flatten().sum();
        let total_kept: u64 = self.kept.iter().flatten().sum();
        let imbalance = self
            .kept
            .iter()
            .map(|l| {
                let mean = l.iter().sum::<u64>() as f64 / l.len().max(1) as f64;
                l.iter().copied().max().unwrap_or(0) as f64 / mean.max(f64::MIN_POSITIVE)
            })
            .fold(0.0, f64::max);
        MoeRecord {
            tokens_per_expert: self.kept,
            imbalance,
            drop_rate: 1.0 - total_kept as f64 / (total_routed as f64).max(1.0),
            aux_loss: self.aux_loss / self.forwards.max(1.0),
            z_loss: self.z_loss / self.forwards.max(1.0),
            a2a_remote_bytes: self.remote as u64 * d_model as u64 * 4,
            a2a_s: 0.0,
        }
    }
}
