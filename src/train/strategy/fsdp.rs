//! ZeRO-3 / FSDP (and HSDP) through the model's plan: transform 1 cut every parameter by rows
//! over `fsdp` (after its tensor-parallel split, if any) in fully sharded units, one per block
//! and one for the rest, as a user's model gets them from `fully_shard("")`. Each micro-batch
//! runs in the units' scope: a unit is all-gathered at its first read with the next one
//! prefetched, and its gradients are reduce-scattered in backward. With
//! `reshard_after_forward` every block's forward is checkpointed, so a block is freed after
//! its forward and gathered again for its rerun in backward, which prefetches the block before
//! it. The placements' reducer then sums what the fsdp ranks do not: over the replicas (`dp`
//! for HSDP, and `cp`, whose ranks hold the same parameters), and a parameter the plan keeps
//! whole (a norm Burn's layer reads by shape) over `fsdp` too. Norm and checkpoints read the
//! placements; AdamW steps the rows each rank holds.

use super::rows::FlatOptimizer;
use super::{
    Batches, PlacedReduction, Precisions, RankStrategy, SharedState, StepOutcome, WholeModel,
    named_params,
};
use crate::train::checkpoint::LocalState;
use crate::train::config::TrainConfig;
use crate::train::tp_model::TpTransformer;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use flashover_models::{Block, BlockCheckpoint, BlockFn, CheckpointHook, ForwardContext};
use flashover_parallel::FlatAdamWConfig;
use flashover_parallel::activation_checkpointing::CheckpointPolicy;
use flashover_parallel::params::{ParamLayout, accumulate_grads};
use flashover_parallel::precision::MixedPrecision;
use flashover_parallel::zero::{GatherCounts, GatherStats, MemoryReport};
use flashover_runtime::{Group, RankContext, RankError};
use std::sync::Arc;

/// A fully sharded model, its optimizer and reducer; see the module docs.
struct FullySharded {
    model: Box<TpTransformer>,
    /// AdamW on the rows (and whole parameters) this rank holds.
    optim: FlatOptimizer,
    reduction: PlacedReduction,
    /// With `reshard_after_forward`: recomputes every block, so that its gathered
    /// parameters live only while it computes.
    reshard: Option<CheckpointHook>,
}

/// `model`, cut into units by transform 1 (`TpTransformer::shard_plan`), stepped as ZeRO-3.
pub(super) fn build(
    ctx: &RankContext,
    config: &TrainConfig,
    model: Box<TpTransformer>,
    grad_group: &Group,
    adamw: &FlatAdamWConfig,
) -> Result<Box<dyn RankStrategy>, RankError> {
    let reshard = config.parallel.reshard_after_forward.then(|| {
        let recompute = CheckpointPolicy::Full.block_recompute();
        recompute.expect("full recomputation is block-level").hook()
    });
    Ok(Box::new(FullySharded {
        optim: FlatOptimizer::new(ctx, &*model, 0, adamw),
        model,
        reduction: PlacedReduction::new(ctx, config, grad_group)?,
        reshard,
    }))
}

impl FullySharded {
    /// The units' counters (none on an fsdp axis of one rank, which shards nothing).
    fn stats(&self) -> GatherCounts {
        let stats = self.model.units().stats();
        stats.map(GatherStats::snapshot).unwrap_or_default()
    }
}

impl RankStrategy for FullySharded {
    fn step(
        mut self: Box<Self>,
        ctx: &RankContext,
        clip: Option<f32>,
        batches: Batches<'_>,
        micro_batches: usize,
        lr: f64,
        precision: &mut Precisions,
    ) -> Result<(Box<dyn RankStrategy>, StepOutcome), RankError> {
        if let Some(stats) = self.model.units().stats() {
            stats.reset_peak();
        }
        let before = ctx.comm_stats();
        let waited_before = self.stats().waited;
        let numel = ParamLayout::of(&*self.model).numel;
        let mut grads = vec![0.0f32; numel];
        let mut loss_sum = 0.0f64;
        for micro in 0..micro_batches {
            let (inputs, targets, mut fwd) = batches(micro);
            if let Some(hook) = &self.reshard {
                fwd.checkpointing = Some(hook.clone());
            }
            let policy = precision.policy;
            if !policy.is_full_precision() {
                let inner = fwd.checkpointing.take();
                let blocks = BlocksInComputeDtype { policy, inner };
                fwd.checkpointing = Some(CheckpointHook(Arc::new(blocks)));
            }
            // The compute view inside the scope: the units gather the stored f32 rows, each
            // read comes in the compute dtype, gradients return to the rows in f32. Blocks
            // are cast inside whatever runs them (`BlocksInComputeDtype`).
            let model = &*self.model;
            let loss = model.units().forward(model, |m| {
                let mut view = m.local.clone();
                let blocks = std::mem::take(&mut view.blocks);
                let mut view = policy.compute_view(view);
                view.blocks = blocks;
                m.forward_loss_of(&view, inputs, targets, &fwd)
            })?;
            loss_sum += loss.clone().into_scalar::<f32>() as f64;
            let raw = precision.scaler.scale_loss(loss).backward();
            let g = GradientsParams::from_grads(raw, model);
            accumulate_grads(model, &g, &mut grads, &[]);
        }
        if precision.scaler.is_active() {
            let scale = precision.scaler.scale();
            grads.iter_mut().for_each(|g| *g /= scale);
        }
        // The units reduce-scattered each row's gradient over fsdp in backward; the reducer
        // sums the rest as the placements say.
        let entries = self.model.placements().entries_of(&*self.model)?;
        let grad_norm =
            self.reduction
                .reduce_and_clip(&entries, &mut grads, micro_batches, clip, ctx)?;
        drop(entries);
        let (update, loss_scale) = precision.decide(grad_norm);
        let model = (*self.model).clone();
        *self.model = self.optim.step(lr, model, &grads, update)?;
        // Unit collectives run on the fsdp communication thread; the training thread's waits
        // for them are the exposed part, the rest overlapped compute (prefetches).
        let comm = ctx.comm_stats().since(&before).total();
        let comm = comm.wait + comm.transfer;
        let units = self.stats();
        let exposed = units.waited - waited_before;
        let outcome = StepOutcome {
            comm,
            overlapped: comm.saturating_sub(exposed),
            exposed,
            memory: MemoryReport {
                params: numel * 4,
                grads: numel * 4,
                optimizer: numel * 8,
                gathered_peak: units.peak_bytes,
            },
            loss_scale,
            skipped: !update,
            ..StepOutcome::new(loss_sum, grad_norm)
        };
        Ok((self, outcome))
    }

    fn local_state(
        &self,
        ctx: &RankContext,
        _grad_group: &Group,
    ) -> Result<SharedState, RankError> {
        self.optim
            .local_state(ctx, &*self.model, self.model.placements())
    }

    fn restore(&mut self, state: LocalState) -> Result<(), RankError> {
        *self.model = self.optim.restore(state, (*self.model).clone())?;
        Ok(())
    }

    fn full_params(&self, _ctx: &RankContext) -> Result<Vec<(String, Vec<f32>)>, RankError> {
        Ok(named_params(&self.model.whole()?))
    }
}

/// Runs each block in the compute dtype inside whatever runs the blocks (`inner`: the
/// recomputation that reshards after forward, or the job's checkpointing policy), so that a
/// recomputed block is the stored f32 one: its rerun's gradients then return to the rows in
/// f32, where recomputing a cast view would round the reduce-scattered sum to the compute
/// dtype once more.
struct BlocksInComputeDtype {
    policy: MixedPrecision,
    inner: Option<CheckpointHook>,
}

impl BlockCheckpoint for BlocksInComputeDtype {
    fn run(
        &self,
        layer: usize,
        block: &Block,
        x: Tensor<3>,
        ctx: &ForwardContext,
        forward: BlockFn,
    ) -> Tensor<3> {
        let policy = self.policy;
        let cast: BlockFn = Arc::new(move |b: &Block, x, ctx: &ForwardContext| {
            forward(&policy.compute_view(b.clone()), x, ctx)
        });
        match &self.inner {
            Some(hook) => hook.0.run(layer, block, x, ctx, cast),
            None => cast(block, x, ctx),
        }
    }
}
