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
    Batches, Precisions, RankStrategy, SharedState, StepOutcome, WholeModel, clip_placed,
    named_params,
};
use crate::train::checkpoint::LocalState;
use crate::train::config::{GradientReduction, TrainConfig};
use crate::train::tp_model::TpTransformer;
use burn::optim::GradientsParams;
use flashover_models::CheckpointHook;
use flashover_parallel::FlatAdamWConfig;
use flashover_parallel::activation_checkpointing::{BlockRecompute, CheckpointPolicy};
use flashover_parallel::params::{ParamLayout, accumulate_grads};
use flashover_parallel::placement::GradientReducer;
use flashover_parallel::zero::{GatherStats, MemoryReport};
use flashover_runtime::{Group, RankContext, RankError};
use std::sync::Arc;

/// A fully sharded model, its optimizer and reducer; see the module docs.
struct FullySharded {
    model: Box<TpTransformer>,
    /// AdamW on the rows (and whole parameters) this rank holds.
    optim: FlatOptimizer,
    reducer: GradientReducer,
    /// The ranks whose gradients are averaged (`dp x fsdp x cp`).
    batch: Group,
    average: bool,
    /// With `reshard_after_forward`: recomputes every block, so that its gathered
    /// parameters live only while it computes.
    reshard: Option<(Arc<BlockRecompute>, CheckpointHook)>,
}

/// `model`, cut into units by transform 1 (`TpTransformer::shard_units`), stepped as ZeRO-3.
pub(super) fn build(
    ctx: &RankContext,
    config: &TrainConfig,
    model: Box<TpTransformer>,
    grad_group: &Group,
    adamw: &FlatAdamWConfig,
) -> Result<Box<dyn RankStrategy>, RankError> {
    if model.units().stats().is_none() {
        return Err(RankError::from(
            "ZeRO-3 needs the model cut into fully sharded units over an fsdp axis of more \
             than one rank (transform 1 does it for such a mesh)",
        ));
    }
    let reshard = config.parallel.reshard_after_forward.then(|| {
        let recompute = CheckpointPolicy::Full
            .block_recompute()
            .expect("full recomputation is block-level");
        let hook = recompute.hook();
        (recompute, hook)
    });
    Ok(Box::new(FullySharded {
        optim: FlatOptimizer::new(ctx, &*model, 0, adamw),
        model,
        reducer: GradientReducer::new(ctx, config.precision.reduce_dtype)?,
        batch: grad_group.clone(),
        average: config.parallel.gradient_reduction == GradientReduction::Mean,
        reshard,
    }))
}

impl FullySharded {
    fn stats(&self) -> &GatherStats {
        self.model.units().stats().expect("checked in build")
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
        self.stats().reset_peak();
        let before = ctx.comm_stats();
        let waited_before = self.stats().snapshot().waited;
        let numel = ParamLayout::of(&*self.model).numel;
        let mut grads = vec![0.0f32; numel];
        let mut loss_sum = 0.0f64;
        for micro in 0..micro_batches {
            let (inputs, targets, mut fwd) = batches(micro);
            if let Some((_, hook)) = &self.reshard {
                fwd.checkpointing = Some(hook.clone());
            }
            // The compute view inside the scope: the units gather the stored f32 rows, each
            // read comes in the compute dtype, gradients return to the rows in f32.
            let model = &*self.model;
            let loss = model.units().forward(model, |m| {
                precision
                    .policy
                    .compute_view(m.clone())
                    .forward_loss(inputs, targets, &fwd)
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
        let scale = match self.average {
            true => 1.0 / (self.batch.size() * micro_batches) as f32,
            false => 1.0,
        };
        self.reducer.reduce(&entries, &mut grads, scale, None)?;
        let grad_norm = clip_placed(&entries, &mut grads, clip, ctx)?;
        drop(entries);
        let (update, loss_scale) = precision.decide(grad_norm);
        let model = (*self.model).clone();
        *self.model = self.optim.step(lr, model, &grads, update)?;
        // Unit collectives run on the fsdp communication thread; the training thread's waits
        // for them are the exposed part, the rest overlapped compute (prefetches).
        let comm = ctx.comm_stats().since(&before).total();
        let comm = comm.wait + comm.transfer;
        let units = self.stats().snapshot();
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
