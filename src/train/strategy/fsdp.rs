//! ZeRO-3 / FSDP (and HSDP): one unit per block and one for the rest, each parameter cut by rows
//! over `fsdp`; units gathered just before use with prefetch and (by default) released after
//! forward; gradients reduce-scattered in backward, then all-reduced over the replicas (`dp`
//! for HSDP, and `cp`, whose ranks hold the same parameters). Under tensor parallelism the
//! units hold this rank's shares (FSDP over TP). Norm and checkpoints read the placements.

use super::{
    Batches, Precisions, RankStrategy, SHARING, SharedState, StepOutcome, borrowed, clip_placed,
    named_params, replica_index, restore_flat, with_moments,
};
use crate::train::checkpoint::{LocalState, placed_segments};
use crate::train::config::{GradientReduction, TrainConfig};
use crate::train::parallelize::Shares;
use crate::train::sharded_model::ShardedTransformer;
use burn::optim::GradientsParams;
use flashover_parallel::FlatAdamWConfig;
use flashover_parallel::params::{ParamLayout, flatten_params};
use flashover_parallel::zero::{FullyShardConfig, FullyShardedOptimizer, MemoryReport, ShardGroup};
use flashover_runtime::{Axis, Group, RankContext, RankError};
use std::sync::Arc;

/// A fully sharded model, its optimizer and its shard group; see the module docs.
struct FullySharded {
    model: Box<ShardedTransformer>,
    optim: FullyShardedOptimizer,
    units: Arc<ShardGroup>,
}

/// `shares` (the whole model or its tp shares) in units over the fsdp axis (collective).
pub(super) fn build(
    ctx: &RankContext,
    config: &TrainConfig,
    shares: Shares,
    adamw: &FlatAdamWConfig,
) -> Result<Box<dyn RankStrategy>, RankError> {
    let fsdp =
        FullyShardConfig::new().with_reshard_after_forward(config.parallel.reshard_after_forward);
    let shard_group = ctx.group(Axis::Fsdp);
    // Replicas of a shard: the dp ranks (HSDP), and the cp ranks, which hold the same
    // parameters and see other positions of the same samples.
    let replicas = match ctx.group(Axis::Cp).size() {
        1 => ctx.group(Axis::Dp).clone(),
        _ => ctx.subgroup(&[Axis::Dp, Axis::Cp])?,
    };
    // Replicas must start equal: rank 0 of each shard group broadcasts within its group, and
    // those ranks hold the same seeded initialisation.
    let units = ShardGroup::with_precision(
        shard_group,
        config.precision.param_dtype,
        config.precision.reduce_dtype,
    );
    // Under tensor parallelism each rank's units hold its shares (FSDP over TP).
    let model = match shares {
        Shares::Split(shares) => ShardedTransformer::tensor_parallel(*shares, &fsdp, &units)?,
        Shares::Whole(model, _) => ShardedTransformer::new(*model, &fsdp, &units)?,
    };
    let mut optim = FullyShardedOptimizer::new(
        &model,
        shard_group,
        (replicas.size() > 1).then_some(&replicas),
        adamw,
        config.parallel.gradient_reduction == GradientReduction::Mean,
    );
    optim.set_reduce_dtype(config.precision.reduce_dtype);
    Ok(Box::new(FullySharded {
        model: Box::new(model),
        optim,
        units,
    }))
}

impl RankStrategy for FullySharded {
    fn step(
        self: Box<Self>,
        ctx: &RankContext,
        clip: Option<f32>,
        batches: Batches<'_>,
        micro_batches: usize,
        lr: f64,
        precision: &mut Precisions,
    ) -> Result<(Box<dyn RankStrategy>, StepOutcome), RankError> {
        let FullySharded {
            model,
            mut optim,
            units,
        } = *self;
        units.stats().reset_peak();
        optim.set_loss_scale(precision.scaler.scale());
        let before = ctx.comm_stats();
        let waited_before = units.stats().snapshot().waited;
        let mut loss_sum = 0.0f64;
        for micro in 0..micro_batches {
            let (inputs, targets, fwd) = batches(micro);
            let loss = model.forward_loss(inputs, targets, &fwd, precision.policy)?;
            loss_sum += loss.clone().into_scalar::<f32>() as f64;
            let loss = precision.scaler.scale_loss(loss);
            let grads = GradientsParams::from_grads(loss.backward(), &*model);
            optim.accumulate(&*model, &grads);
        }
        let shard_bytes = ParamLayout::of(&*model).numel * 4;
        let entries = model.shard_entries()?;
        let grads = optim.reduce_replicas()?;
        let grad_norm = clip_placed(&borrowed(&entries), grads, clip, ctx)?;
        let (update, loss_scale) = precision.decide(grad_norm);
        let model = Box::new(optim.apply(lr, *model, update));
        // Collectives run on the shard group's thread; the training thread's waits for them
        // are the exposed part, the rest overlapped compute (prefetches).
        let comm = ctx.comm_stats().since(&before).total();
        let comm = comm.wait + comm.transfer;
        let exposed = units.stats().snapshot().waited - waited_before;
        let outcome = StepOutcome {
            comm,
            overlapped: comm.saturating_sub(exposed),
            exposed,
            memory: MemoryReport {
                params: shard_bytes,
                grads: optim.grad_bytes(),
                optimizer: optim.state_bytes(),
                gathered_peak: units.stats().snapshot().peak_bytes,
            },
            loss_scale,
            skipped: !update,
            ..StepOutcome::new(loss_sum, grad_norm)
        };
        Ok((
            Box::new(FullySharded {
                model,
                optim,
                units,
            }),
            outcome,
        ))
    }

    fn local_state(
        &self,
        ctx: &RankContext,
        _grad_group: &Group,
    ) -> Result<SharedState, RankError> {
        let replicas = replica_index(ctx, &SHARING);
        let entries = self.model.shard_entries()?;
        let segments = placed_segments(&borrowed(&entries), 0, &|a| ctx.coord(a), &SHARING);
        let state = with_moments(flatten_params(&*self.model), segments, self.optim.flat());
        Ok((state, replicas, replicas))
    }

    fn restore(&mut self, state: LocalState) -> Result<(), RankError> {
        *self.model = restore_flat((*self.model).clone(), state, self.optim.flat_mut())?;
        Ok(())
    }

    fn full_params(&self, _ctx: &RankContext) -> Result<Vec<(String, Vec<f32>)>, RankError> {
        Ok(named_params(&self.model.gather_full()?))
    }
}
