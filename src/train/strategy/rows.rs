//! ZeRO by rows: every parameter a rank holds cut along its first dimension over one data
//! axis (fsdp, or dp without it), as fully sharded units cut theirs, each rank stepping AdamW
//! on its own rows of the gradients the plan reduced to them. The plan lays a rank's rows out
//! the same way (`Parallelized::gradient_rows`).

use super::{SHARING, SharedState, borrowed, replica_index, with_moments};
use crate::train::checkpoint::{LocalState, placed_segments};
use flashover_parallel::params::{ParamLayout, ParamSlot};
use flashover_parallel::placement::{ParamPlacement, PlacementTable};
use flashover_parallel::zero::UnitShards;
use flashover_parallel::{FlatAdamW, FlatAdamWConfig};
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
    /// The rows of the parameters laid out as `layout` (what a rank holds of a model), whose
    /// values are `values`, for ZeRO stage `zero`: over fsdp (ZeRO-3, or any stage with an
    /// fsdp axis) or else `dp`.
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

    /// This rank's rows as pieces of the parameters `placements` describes.
    pub fn entries(
        &self,
        placements: &PlacementTable,
    ) -> Result<Vec<(ParamSlot, ParamPlacement)>, RankError> {
        Ok(self.shards.placed(&self.layout, placements, self.axis, 0)?)
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
}
