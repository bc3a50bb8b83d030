//! Whole replicas (DDP) or tensor-parallel shares replicated over the data axes: gradients are
//! reduced in buckets on a communication thread while backward runs, then Burn's AdamW steps
//! every parameter. The norm and checkpoints come from the placements (split weights summed
//! over tp, replicated ones counted once). Tensor-parallel shares under ZeRO-1/2 keep the
//! bucketed all-reduce and cut the optimizer state by rows (`rows::RowSharding`): each rank steps
//! its rows of the reduced gradient and the updated rows are all-gathered.

use super::rows::FlatOptimizer;
use super::{
    Batches, Precisions, RankStrategy, SharedState, StepOutcome, WholeModel, borrowed, clip_placed,
    named_params, replicated_memory, run_micro_batches,
};
use crate::train::checkpoint::LocalState;
use crate::train::config::TrainConfig;
use crate::train::parallelize::Shares;
use burn::module::Module;
use flashover_parallel::data_parallel::{DataParallel, DataParallelConfig};
use flashover_parallel::params::{ParamLayout, accumulate_grads};
use flashover_parallel::placement::PlacementTable;
use flashover_parallel::{FlatAdamWConfig, clip_module_grads};
use flashover_runtime::{Group, RankContext, RankError};

/// A replicated model and its bucketed reducer; see the module docs.
struct Replicated<M: Module> {
    model: Box<M>,
    ddp: DataParallel,
    /// Burn's AdamW on every parameter, or under ZeRO-1/2 (tp shares) on this rank's rows.
    optim: FlatOptimizer,
    /// Where each parameter (or tp share) lives: the norm and checkpoints read it.
    placements: PlacementTable,
}

/// Whole replicas (DDP) or tensor-parallel shares, replicated over the data axes: the model
/// broadcast from rank 0, buckets planned, the optimizer state cut by rows under ZeRO-1/2
/// (shares only: `build` hands whole replicas under ZeRO-1/2 to the bucket-wise strategy).
pub(super) fn build(
    ctx: &RankContext,
    config: &TrainConfig,
    shares: Shares,
    grad_group: &Group,
    ddp: DataParallelConfig,
    adamw: &FlatAdamWConfig,
) -> Result<Box<dyn RankStrategy>, RankError> {
    let zero = config.parallel.zero;
    debug_assert!(zero < 3, "ZeRO-3 runs fully sharded units");
    match shares {
        Shares::Whole(model, placements) => {
            replicate(ctx, *model, placements, grad_group, ddp, zero, adamw)
        }
        Shares::Split(model) => {
            let placements = model.placements().clone();
            replicate(ctx, *model, placements, grad_group, ddp, zero, adamw)
        }
    }
}

/// `model` replicated over `grad_group` (broadcast from its first rank), stepped as ZeRO
/// stage `zero` says.
fn replicate<M: WholeModel>(
    ctx: &RankContext,
    model: M,
    placements: PlacementTable,
    grad_group: &Group,
    ddp: DataParallelConfig,
    zero: u8,
    adamw: &FlatAdamWConfig,
) -> Result<Box<dyn RankStrategy>, RankError> {
    let (model, ddp) = ddp.init(model, grad_group)?;
    let optim = FlatOptimizer::new(ctx, &model, zero, adamw);
    Ok(Box::new(Replicated {
        model: Box::new(model),
        ddp,
        optim,
        placements,
    }))
}

impl<M: WholeModel> RankStrategy for Replicated<M> {
    fn step(
        self: Box<Self>,
        ctx: &RankContext,
        clip: Option<f32>,
        batches: Batches<'_>,
        micro_batches: usize,
        lr: f64,
        precision: &mut Precisions,
    ) -> Result<(Box<dyn RankStrategy>, StepOutcome), RankError> {
        let Replicated {
            model,
            mut ddp,
            mut optim,
            placements,
        } = *self;
        ddp.set_loss_scale(precision.scaler.scale());
        let loss_sum = run_micro_batches(&mut ddp, &*model, batches, micro_batches, precision)?;
        let reduced = ddp.finish(&*model, None)?;
        let memory = replicated_memory(&ddp);
        let mut outcome = StepOutcome::reduced(loss_sum, &reduced.report, memory);
        let model = match &mut optim {
            // The norm spans every tp rank's split weights; replicated ones count once.
            FlatOptimizer::Replicated(adam) => {
                let (grads, grad_norm) =
                    clip_module_grads(&*model, reduced.grads, clip, &placements, ctx)?;
                outcome.grad_norm = grad_norm;
                match precision.apply(&mut outcome) {
                    true => Box::new(adam.step(lr, *model, &grads)?),
                    false => model,
                }
            }
            FlatOptimizer::Sharded(rows) => {
                let mut full = vec![0.0; ParamLayout::of(&*model).numel];
                accumulate_grads(&*model, &reduced.grads, &mut full, &[]);
                drop(reduced);
                let mut own = rows.take(&full);
                let entries = rows.entries(&placements)?;
                outcome.grad_norm = clip_placed(&borrowed(&entries), &mut own, clip, ctx)?;
                let update = precision.apply(&mut outcome);
                let (params, held) = rows.held();
                outcome.memory.params = params * 4;
                outcome.memory.optimizer = held * 8;
                Box::new(rows.step(lr, *model, &own, update)?)
            }
        };
        let next = Replicated {
            model,
            ddp,
            optim,
            placements,
        };
        Ok((Box::new(next), outcome))
    }

    fn buckets(&self) -> (usize, bool) {
        (self.ddp.num_buckets(), self.ddp.overlaps())
    }

    fn local_state(
        &self,
        ctx: &RankContext,
        _grad_group: &Group,
    ) -> Result<SharedState, RankError> {
        self.optim.local_state(ctx, &*self.model, &self.placements)
    }

    fn restore(&mut self, state: LocalState) -> Result<(), RankError> {
        *self.model = self.optim.restore(state, (*self.model).clone())?;
        Ok(())
    }

    fn full_params(&self, _ctx: &RankContext) -> Result<Vec<(String, Vec<f32>)>, RankError> {
        Ok(named_params(&self.model.whole()?))
    }
}
