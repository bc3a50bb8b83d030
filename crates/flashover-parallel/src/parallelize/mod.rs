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
//!   reparameterization, see [`fully_shard`]), so the model's code does not change and any
//!   Burn optimizer steps the shards.
//!
//! Other axes (`tp`, `pp`, `cp`, `ep`) split the model's computation, which needs their
//! layers (`crate::tensor_parallel`, `crate::pipeline`, ...): a plan refuses a mesh that has
//! them rather than running the model on them unsplit.

pub mod fully_shard;
mod plan;

pub use plan::{ModulePath, ParallelizePlan};

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
use std::ops::Range;

/// The axes a plan applies to: every rank along them reads different samples.
const PLAN_AXES: [Axis; 2] = [Axis::Dp, Axis::Fsdp];

/// What [`parallelize`] did to a model, and the per-step helpers that follow from it.
pub struct Parallelized {
    placements: PlacementTable,
    reducer: GradientReducer,
    /// The ranks that read different samples (`dp` x `fsdp`), in which this rank is
    /// `data.rank()`.
    data: Group,
}

/// Applies `plan` to `model` on this rank: the whole model as world rank 0 holds it
/// (collective: every rank calls it with a model of the same structure), then each
/// `fully_shard` module's parameters cut by rows over `fsdp`. Fails, naming the path or axis,
/// when a plan path names no module of the model or the mesh has an axis plans do not split
/// a model over.
pub fn parallelize<M: Module>(
    model: M,
    plan: &ParallelizePlan,
    ctx: &RankContext,
) -> Result<(M, Parallelized), ParallelError> {
    for axis in Axis::ALL {
        if !PLAN_AXES.contains(&axis) && ctx.mesh().degree(axis) > 1 {
            return Err(ParallelError::Invalid(format!(
                "the mesh has {}={}, but a parallelize plan splits a model over dp and fsdp \
                 only: the model's own layers would run unsplit and repeat each other's work \
                 on the {} ranks; use dp/fsdp, or Flashover's {} layers",
                axis.name(),
                ctx.mesh().degree(axis),
                axis.name(),
                axis.name()
            )));
        }
    }
    let mut placements = PlacementTable::whole(&model);
    let names: Vec<String> = ParamLayout::of(&model)
        .slots
        .into_iter()
        .map(|s| s.name)
        .collect();
    for path in &plan.fully_shard {
        if !names.iter().any(|n| path.contains(n)) {
            return Err(ParallelError::Invalid(format!(
                "plan path `{}` (fully_shard) names no module of the model; its parameters are: \
                 {}",
                path.as_str(),
                preview(&names)
            )));
        }
    }
    let model = broadcast_module(model, ctx.world(), 0)?;
    let fsdp = ctx.group(Axis::Fsdp).clone();
    let model = if fsdp.size() > 1 && !plan.fully_shard.is_empty() {
        let mut error = None;
        let shard = fully_shard::ShardRows {
            paths: plan,
            group: fsdp,
            placements: &mut placements,
            error: &mut error,
        };
        let model = model.apply_reparameterization(shard);
        if let Some(e) = error {
            return Err(e);
        }
        model
    } else {
        model
    };
    let par = Parallelized {
        placements,
        reducer: GradientReducer::new(ctx, Precision::F32)?,
        data: ctx.subgroup(&PLAN_AXES)?,
    };
    Ok((model, par))
}

/// The first few names of `names`, for an error message.
fn preview(names: &[String]) -> String {
    let mut shown: Vec<&str> = names.iter().take(8).map(String::as_str).collect();
    if names.len() > shown.len() {
        shown.push("...");
    }
    shown.join(", ")
}

impl Parallelized {
    /// Where every parameter of the parallelized model lives (for norms, checkpoints).
    pub fn placements(&self) -> &PlacementTable {
        &self.placements
    }

    /// The whole model, every fully sharded parameter gathered (collective: every rank calls
    /// it): to read or export the weights.
    pub fn whole<M: Module>(&self, model: M) -> M {
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
