//! Parallelize a user's own Burn model with a [`ParallelizePlan`], without changing it.
//!
//! ```text
//! let plan = ParallelizePlan::new().fully_shard("blocks").fully_shard("embed");
//! let (model, par) = parallelize(MyModel::new(&config, &device), &plan, &ctx)?;
//! for step in 0..steps {
//!     let (x, y) = my_batch(par.batch_share(global_batch, step)?);   // this rank's samples
//!     let loss = model.forward(x, y);                                // the unchanged forward
//!     println!("{}", par.mean_loss(loss.clone().into_scalar())?);   // the same on every rank
//!     let (grads, norm) = par.gradients(&model, loss.backward(), Some(1.0), &ctx)?;
//!     model = optim.step(lr, model, grads);                          // any Burn optimizer
//! }
//! ```
//!
//! What each mesh axis does to the model:
//! - `dp`: replicas; each reads its share of the batch; gradients averaged.
//! - `fsdp`: as `dp` for the batch; the plan's `fully_shard` modules keep `1/fsdp` of each
//!   parameter per rank, gathered where the forward reads them (Burn's parameter
//!   reparameterization, see [`placed`]), so the model's code does not change and any
//!   Burn optimizer steps the shards.
//! - `tp`: the plan's `tensor_parallel` linear layers hold their columns or rows
//!   ([`TpStyle`]); the model declares them as [`crate::nn::Linear`] (Burn's `Linear` with the
//!   collectives a split needs in its forward) and sizes its attention heads from the
//!   projection's local width ([`crate::nn::Linear::d_output`]). Every `tp` rank reads the
//!   same samples; the parameters outside the rules are computed identically on each.
//!
//! Other axes (`pp`, `cp`, `ep`) split the model's computation in ways a plan does not yet
//! describe (their layers are in `crate::pipeline`, `crate::context_parallel`, ...): a plan
//! refuses a mesh that has them rather than running the model on them unsplit.

pub mod placed;
mod plan;
mod validate;

pub use placed::{Placed, TpSplit, local_value};
pub use plan::{ModulePath, ParallelizePlan, TensorParallelRule, TpStyle};

use crate::clip_scale;
use crate::error::ParallelError;
use crate::params::{ParamLayout, accumulate_grads, broadcast_module, grads_from_flat};
use crate::placement::{GradientReducer, PlacementTable, global_grad_norm};
use crate::precision::Precision;
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Gradients;
use flashover_comm::{CommunicatorExt, Group, ReduceOp};
use flashover_runtime::{Axis, RankContext};
use placed::WholeReads;
use std::ops::Range;

/// The axes whose ranks read different samples.
const DATA_AXES: [Axis; 2] = [Axis::Dp, Axis::Fsdp];

/// What [`parallelize`] did to a model, and the per-step helpers that follow from it.
pub struct Parallelized {
    placements: PlacementTable,
    reducer: GradientReducer,
    /// The ranks that read different samples (`dp` x `fsdp`), in which this rank is
    /// `data.rank()`.
    data: Group,
    whole_reads: WholeReads,
}

/// Applies `plan` to `model` on this rank: the whole model as world rank 0 holds it
/// (collective: every rank calls it with a model of the same structure), then each
/// `tensor_parallel` layer cut to this rank's columns or rows over `tp`, then each
/// `fully_shard` module's parameters cut by rows over `fsdp`. Fails, naming the path and the
/// reason, when the plan does not fit the model (a path that names nothing, a
/// tensor-parallel path that is not a linear layer, a width that does not divide), and,
/// naming the axis, when the mesh has an axis the plan does not split the model over.
pub fn parallelize<M: Module>(
    model: M,
    plan: &ParallelizePlan,
    ctx: &RankContext,
) -> Result<(M, Parallelized), ParallelError> {
    check_axes(plan, ctx)?;
    let tp = ctx.group(Axis::Tp).clone();
    validate::check_plan(plan, &ParamLayout::of(&model).slots, tp.size())?;
    let mut placements = PlacementTable::whole(&model);
    let model = broadcast_module(model, ctx.world(), 0)?;
    let whole_reads = WholeReads::default();
    let mut error = None;
    let place = placed::PlaceParams {
        plan,
        fsdp: ctx.group(Axis::Fsdp).clone(),
        tp,
        placements: &mut placements,
        whole_reads: whole_reads.clone(),
        error: &mut error,
    };
    let model = model.apply_reparameterization(place);
    if let Some(e) = error {
        return Err(e);
    }
    let par = Parallelized {
        placements,
        reducer: GradientReducer::new(ctx, Precision::F32)?,
        data: ctx.subgroup(&DATA_AXES)?,
        whole_reads,
    };
    Ok((model, par))
}

/// Refuses a mesh axis the plan does not split the model over: its ranks would run the model
/// unsplit, repeating each other's work.
fn check_axes(plan: &ParallelizePlan, ctx: &RankContext) -> Result<(), ParallelError> {
    for axis in Axis::ALL {
        let degree = ctx.mesh().degree(axis);
        if degree == 1 || DATA_AXES.contains(&axis) {
            continue;
        }
        let why = match axis {
            Axis::Tp if !plan.tensor_parallel.is_empty() => continue,
            Axis::Tp => "the plan splits no layer over tp (add tensor_parallel rules)",
            _ => "parallelize plans split a model over dp, fsdp and tp only",
        };
        return Err(ParallelError::Invalid(format!(
            "the mesh has {}={degree}, but {why}: the model would run unsplit on the {} ranks, \
             each repeating the others' work",
            axis.name(),
            axis.name()
        )));
    }
    Ok(())
}

impl Parallelized {
    /// Where every parameter of the parallelized model lives (for norms, checkpoints).
    pub fn placements(&self) -> &PlacementTable {
        &self.placements
    }

    /// The whole model, every fully sharded parameter gathered (collective: every rank calls
    /// it): to read or export the weights.
    pub fn whole<M: Module>(&self, model: M) -> M {
        let _allowed = self.whole_reads.allow();
        model.materialize()
    }

    /// This rank's samples of step `step`, numbered over the whole run: step `s`'s batch is
    /// samples `s * global_batch .. (s + 1) * global_batch` of the data set, and each data
    /// rank (`dp` x `fsdp`) takes a contiguous share of it (rank 1 of 2 at step 1 of a batch
    /// of 8: `12..16`). Fails when the batch does not split evenly.
    pub fn batch_share(
        &self,
        global_batch: usize,
        step: usize,
    ) -> Result<Range<usize>, ParallelError> {
        let n = self.data.size();
        if !global_batch.is_multiple_of(n) {
            return Err(ParallelError::Invalid(format!(
                "a global batch of {global_batch} samples does not split over {n} data-parallel \
                 ranks (dp x fsdp): use a multiple of {n}"
            )));
        }
        let per = global_batch / n;
        let start = step * global_batch + self.data.rank() * per;
        Ok(start..start + per)
    }

    /// The mean over the data ranks of each rank's mean `loss`: the loss of the whole batch,
    /// the same on every rank (collective over `dp` x `fsdp`).
    pub fn mean_loss(&self, loss: f32) -> Result<f32, ParallelError> {
        let mut value = [loss];
        if self.data.size() > 1 {
            self.data.all_reduce(&mut value, ReduceOp::Avg)?;
        }
        Ok(value[0])
    }

    /// The gradients of the whole batch's mean loss for this rank's parameters, from
    /// `backward` of this rank's mean loss: summed over the ranks that hold the same values
    /// and read different samples (the placements say which) and divided by the number of
    /// data ranks. Then, with `max_norm`, clipped by their global norm (every element of the
    /// whole model counted once): scaled by `max_norm / (norm + 1e-6)` when `norm > max_norm`,
    /// as [`crate::clip_global_norm`] does on one device. Returns them with the norm before
    /// clipping. Collective: every rank calls it once per step.
    pub fn gradients<M: Module>(
        &self,
        model: &M,
        backward: Gradients,
        max_norm: Option<f32>,
        ctx: &RankContext,
    ) -> Result<(GradientsParams, f32), ParallelError> {
        let grads = GradientsParams::from_grads(backward, model);
        let entries = self.placements.entries_of(model)?;
        // Parameters without a gradient contribute zeros: every rank reduces the same layout.
        let mut flat = vec![0.0; entries.iter().map(|(slot, _)| slot.numel).sum()];
        accumulate_grads(model, &grads, &mut flat, &[]);
        let scale = 1.0 / self.data.size() as f32;
        self.reducer.reduce(&entries, &mut flat, scale, None)?;
        let parts = entries
            .iter()
            .map(|(slot, entry)| (*entry, &flat[slot.offset..slot.offset + slot.numel]));
        let norm = global_grad_norm(parts, ctx)?;
        if let Some(clip) = clip_scale(norm, max_norm)? {
            flat.iter_mut().for_each(|g| *g *= clip);
        }
        Ok((grads_from_flat(model, &flat), norm))
    }
}
