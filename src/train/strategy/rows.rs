//! ZeRO by rows for strategies that step one flat vector (pipelines, mixtures of experts): every
//! parameter cut along its first dimension over one data axis, as fully sharded units cut
//! theirs, each rank stepping AdamW on its own rows. ZeRO-3 keeps only the rows between steps
//! and gathers the model at the start of each (TorchTitan's default under pipelines); ZeRO-1/2
//! keep the model and all-gather the updated rows after the step. Gradients are
//! reduce-scattered once per step, so ZeRO-2 holds what ZeRO-1 does until then.

use super::{SHARING, SharedState, borrowed, replica_index, restore_flat, with_moments};
use crate::train::checkpoint::{LocalState, placed_segments};
use burn::module::Module;
use flashover_parallel::params::{
    ParamLayout, ParamSlot, flatten_params, load_shaped, placeholders,
};
use flashover_parallel::placement::{ParamPlacement, PlacementTable};
use flashover_parallel::precision::Precision;
use flashover_parallel::zero::UnitShards;
use flashover_parallel::{FlatAdamW, FlatAdamWConfig, ModuleAdamW};
use flashover_runtime::{Axis, Group, RankContext, RankError};

/// A module's parameters cut by rows over `axis`; see the module docs.
pub(super) struct RowSharding {
    /// The axis the rows are cut over.
    axis: Axis,
    group: Group,
    /// The whole module's parameter layout.
    layout: ParamLayout,
    shards: UnitShards,
    /// This rank's rows of every parameter.
    own: Vec<f32>,
    adam: FlatAdamW,
    /// ZeRO-1/2: the whole module stays between steps (ZeRO-3 keeps only the rows).
    keep_params: bool,
}

impl RowSharding {
    /// `module` (every rank of the axis holds the same) cut over the fsdp axis (ZeRO-3, or
    /// any stage with an fsdp axis) or else `dp`, for ZeRO stage `zero`.
    pub fn new<M: Module>(
        ctx: &RankContext,
        module: &M,
        zero: u8,
        adamw: &FlatAdamWConfig,
    ) -> Self {
        Self::over(
            ctx,
            ParamLayout::of(module),
            &flatten_params(module),
            zero,
            adamw,
        )
    }

    /// [`RowSharding::new`] of parameters laid out as `layout`, whose values are `values`
    /// (some of a module's parameters: a pipeline rank's own).
    pub fn over(
        ctx: &RankContext,
        layout: ParamLayout,
        values: &[f32],
        zero: u8,
        adamw: &FlatAdamWConfig,
    ) -> Self {
        let axis = match zero == 3 || ctx.group(Axis::Fsdp).size() > 1 {
            true => Axis::Fsdp,
            false => Axis::Dp,
        };
        let group = ctx.group(axis).clone();
        let shards = UnitShards::new(&layout, group.size());
        let own = shards.take(group.rank(), values);
        RowSharding {
            axis,
            adam: FlatAdamW::new(adamw, shards.shard_len()),
            group,
            layout,
            shards,
            own,
            keep_params: zero != 3,
        }
    }

    /// `skeleton` with its whole parameters, from every rank's rows (collective).
    pub fn gather<M: Module>(&self, skeleton: M) -> Result<M, RankError> {
        Ok(load_shaped(skeleton, &self.layout, &self.gather_values()?))
    }

    /// The whole parameters' values, in the layout's order, from every rank's rows
    /// (collective).
    pub fn gather_values(&self) -> Result<Vec<f32>, RankError> {
        Ok(self.shards.all_gather(&self.group, &self.own)?)
    }

    /// AdamW on this rank's rows (when `update`).
    pub fn step_rows(&mut self, lr: f64, grads: &[f32], update: bool) {
        if update {
            self.adam.step(lr, &mut self.own, grads);
        }
    }

    /// Puts checkpointed rows and moments back.
    pub fn restore_rows(&mut self, state: LocalState) -> Result<(), RankError> {
        let LocalState {
            params,
            moments: [m1, m2],
            steps_taken,
            ..
        } = state;
        self.own = params;
        self.adam.restore(steps_taken, m1, m2)?;
        Ok(())
    }

    /// This rank's rows of the sum over the axis of every rank's `full` gradient.
    pub fn reduce_scatter(&self, full: &[f32], dtype: Precision) -> Result<Vec<f32>, RankError> {
        Ok(self.shards.reduce_scatter(&self.group, full, dtype)?)
    }

    /// This rank's rows of `full`, a gradient already summed over the axis (a data-parallel
    /// reducer's all-reduce: ZeRO-1 over DDP).
    pub fn take(&self, full: &[f32]) -> Vec<f32> {
        self.shards.take(self.group.rank(), full)
    }

    /// This rank's rows as pieces of the parameters `placements` describes.
    pub fn entries(
        &self,
        placements: &PlacementTable,
    ) -> Result<Vec<(ParamSlot, ParamPlacement)>, RankError> {
        Ok(self.shards.placed(&self.layout, placements, self.axis, 0)?)
    }

    /// AdamW on this rank's rows (when `update`), then the module as it is kept between
    /// steps (the updated rows all-gathered under ZeRO-1/2).
    pub fn step<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        grads: &[f32],
        update: bool,
    ) -> Result<M, RankError> {
        self.step_rows(lr, grads, update);
        match self.keep_params {
            true => self.gather(module),
            false => Ok(placeholders(module)),
        }
    }

    /// This rank's state for a checkpoint: its rows and their moments, written by the ranks
    /// that hold the same rows (not those along the axis).
    pub fn local_state(
        &self,
        ctx: &RankContext,
        placements: &PlacementTable,
    ) -> Result<SharedState, RankError> {
        let sharing: Vec<Axis> = SHARING.into_iter().filter(|&a| a != self.axis).collect();
        let replicas = replica_index(ctx, &sharing);
        let entries = self.entries(placements)?;
        let segments = placed_segments(&borrowed(&entries), 0, &|a| ctx.coord(a), &sharing);
        let state = with_moments(self.own.clone(), segments, &self.adam);
        Ok((state, replicas, replicas))
    }

    /// Elements this rank holds between steps: (parameters, gradients and moments).
    pub fn held(&self) -> (usize, usize) {
        match self.keep_params {
            true => (self.layout.numel, self.own.len()),
            false => (self.own.len(), self.own.len()),
        }
    }

    /// Puts checkpointed rows and moments back; the module as it is kept between steps
    /// (collective under ZeRO-1/2).
    pub fn restore<M: Module>(&mut self, state: LocalState, module: M) -> Result<M, RankError> {
        self.restore_rows(state)?;
        match self.keep_params {
            true => self.gather(module),
            false => Ok(module),
        }
    }
}

/// How a strategy that steps one flat vector updates it: whole replicas with Burn's AdamW, or
/// rows per rank (ZeRO, [`RowSharding`]).
pub(super) enum FlatOptimizer {
    /// Whole parameters, replicated over the data axes.
    Replicated(Box<ModuleAdamW>),
    /// Rows of every parameter over one data axis.
    Sharded(Box<RowSharding>),
}

impl FlatOptimizer {
    /// ZeRO stage `zero` (0: replicated) for `module`.
    pub fn new<M: Module>(
        ctx: &RankContext,
        module: &M,
        zero: u8,
        adamw: &FlatAdamWConfig,
    ) -> Self {
        match zero {
            0 => FlatOptimizer::Replicated(Box::new(ModuleAdamW::new(adamw, module))),
            zero => FlatOptimizer::Sharded(Box::new(RowSharding::new(ctx, module, zero, adamw))),
        }
    }

    /// AdamW on what this rank steps (when `update`); the module as kept between steps.
    pub fn step<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        grads: &[f32],
        update: bool,
    ) -> Result<M, RankError> {
        match self {
            FlatOptimizer::Replicated(optim) if update => Ok(optim.step_flat(lr, module, grads)?),
            FlatOptimizer::Replicated(_) => Ok(module),
            FlatOptimizer::Sharded(sh) => sh.step(lr, module, grads, update),
        }
    }

    /// This rank's state for a checkpoint (see [`RankStrategy::local_state`]).
    ///
    /// [`RankStrategy::local_state`]: super::RankStrategy::local_state
    pub fn local_state<M: Module>(
        &self,
        ctx: &RankContext,
        module: &M,
        placements: &PlacementTable,
    ) -> Result<SharedState, RankError> {
        let optim = match self {
            FlatOptimizer::Sharded(sh) => return sh.local_state(ctx, placements),
            FlatOptimizer::Replicated(optim) => optim,
        };
        let replicas = replica_index(ctx, &SHARING);
        let entries = placements.entries_of(module)?;
        let segments = placed_segments(&entries, 0, &|a| ctx.coord(a), &SHARING);
        let state = with_moments(flatten_params(module), segments, optim.flat());
        Ok((state, replicas, replicas))
    }

    /// Puts a checkpointed state back; the module as kept between steps.
    pub fn restore<M: Module>(&mut self, state: LocalState, module: M) -> Result<M, RankError> {
        match self {
            FlatOptimizer::Replicated(optim) => restore_flat(module, state, optim.flat_mut()),
            FlatOptimizer::Sharded(sh) => sh.restore(state, module),
        }
    }
}
