//! How a model's gradients are laid out for the reduction: a bucketed reducer per set of
//! data axes that sums some parameter, the parameters in each and their order, and under
//! gradient rows (ZeRO-1/2) where this rank's rows go.

use super::{BucketedReduction, GradientRowLayout, ReduceSet, StepState};
use crate::data_parallel::reducer::{Mode, Reducer, RowSplit};
use crate::error::ParallelError;
use crate::params::{ParamLayout, ParamSlot};
use crate::placement::{ParamPlacement, Tie, data_axis_sets};
use crate::plan::{GradientBuckets, GradientRows};
use crate::precision::Precision;
use crate::unit_shards::UnitShards;
use burn::tensor::Device;
use flashover_comm::Group;
use flashover_runtime::{Axis, RankContext};
use std::sync::Mutex;

/// A group for every non-empty set of the data axes above degree 1 on `ctx`'s mesh, in one
/// order on every rank (collective over the world: making a group is).
fn reduction_groups(ctx: &RankContext) -> Result<Vec<(Vec<Axis>, Group)>, ParallelError> {
    let mut groups = vec![];
    for set in data_axis_sets(ctx.mesh()) {
        // A communicator of its own: the buckets' thread must not interleave its collectives
        // with another thread's on the same group (a unit's on `fsdp`, say).
        let group = ctx.subgroup(&set)?;
        groups.push((set, group));
    }
    Ok(groups)
}

impl BucketedReduction {
    /// The reduction of a model whose parameters `entries` lists (layout order, with their
    /// placements) and whose gradients live on `device` (not an autodiff device); `held[i]`:
    /// whether this rank holds parameter `i` (not a placeholder); `tie`: the group summing
    /// tied copies, if any. Collective over the world.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        ctx: &RankContext,
        device: Device,
        entries: &[(ParamSlot, &ParamPlacement)],
        held: &[bool],
        tie: Option<&Group>,
        settings: GradientBuckets,
        wire: Precision,
    ) -> Result<Self, ParallelError> {
        let bucket_elems = settings.bucket_elems()?;
        let mesh = ctx.mesh();
        let groups = reduction_groups(ctx)?;
        let holds = |i: usize| held.get(i).copied().unwrap_or(true);
        // ZeRO-1/2 cut rows over fsdp, or dp without it (over one rank, rows are whole).
        let rows_over = settings.rows.map(|_| match mesh.degree(Axis::Fsdp) > 1 {
            true => Axis::Fsdp,
            false => Axis::Dp,
        });
        let row_axis = rows_over.filter(|&a| mesh.degree(a) > 1);
        let mut members: Vec<Vec<usize>> = vec![vec![]; groups.len()];
        let mut member = vec![None; entries.len()];
        // Refused after the groups are made: every rank makes them (collectively) first.
        let mut refusal = None;
        for (i, (slot, entry)) in entries.iter().enumerate() {
            let axes = entry.reduce_axes(mesh);
            if let Some(axis) = row_axis.filter(|a| holds(i) && !axes.contains(a)) {
                refusal.get_or_insert(ParallelError::Invalid(format!(
                    "gradient rows over {}: `{}` is not held whole on every {0} rank (fully \
                     sharded, or split over it), so it has no rows of its own to cut; use \
                     ZeRO-1/2 rows without fully_shard, or ZeRO-3 units alone",
                    axis.name(),
                    slot.name
                )));
                continue;
            }
            if axes.is_empty() || !holds(i) {
                continue;
            }
            let set = groups
                .iter()
                .position(|(s, _)| *s == axes)
                .expect("every subset");
            member[i] = Some((set, members[set].len()));
            members[set].push(i);
        }
        let slots: Vec<(usize, usize)> = entries.iter().map(|(s, _)| (s.offset, s.numel)).collect();
        let shapes: Vec<(usize, usize)> = entries
            .iter()
            .map(|(s, _)| {
                let rows = s.shape.first().copied().unwrap_or(1).max(1);
                (rows, s.numel / rows)
            })
            .collect();
        let mode = match settings.rows {
            Some(GradientRows::ReduceScatter) if row_axis.is_some() => Mode::ReduceScatter,
            Some(GradientRows::AllReduce) if row_axis.is_some() => Mode::AllReduceShard,
            _ => Mode::AllReduce,
        };
        let mut sets = vec![];
        let mut renumber = vec![usize::MAX; groups.len()];
        for (set, ((axes, group), params)) in groups.into_iter().zip(members).enumerate() {
            // Made for every set that holds the rows' axis, used or not: making a group is
            // collective over the world, so every rank makes the same ones.
            let row_groups = match row_axis.filter(|a| axes.contains(a)) {
                Some(axis) => {
                    let rest: Vec<Axis> = axes.iter().copied().filter(|&a| a != axis).collect();
                    let rest = match rest.is_empty() {
                        true => None,
                        false => Some(ctx.subgroup(&rest)?),
                    };
                    Some((ctx.subgroup(&[axis])?, rest))
                }
                None => None,
            };
            if params.is_empty() {
                continue;
            }
            renumber[set] = sets.len();
            let layout = SetLayout {
                group: &group,
                params: &params,
                row_groups: row_groups.as_ref(),
                slots: &slots,
                shapes: &shapes,
                device: &device,
            };
            let order: Vec<usize> = (0..params.len()).rev().collect();
            let reducer = layout.reducer(&order, bucket_elems, mode, wire);
            sets.push(ReduceSet {
                group,
                params,
                reducer,
                rebuilt: false,
                row_groups,
            });
        }
        if let Some(refusal) = refusal {
            return Err(refusal);
        }
        for m in member.iter_mut().flatten() {
            m.0 = renumber[m.0];
        }
        let tied: Vec<usize> = (entries.iter().enumerate())
            .filter(|(_, (_, e))| e.tie != Tie::None)
            .map(|(i, _)| i)
            .collect();
        let rows = match (rows_over, settings.rows) {
            (Some(axis), Some(rows)) => Some(row_layout(entries, &holds, axis, rows, mesh)),
            _ => None,
        };
        Ok(BucketedReduction {
            sets: Mutex::new(sets),
            member,
            slots,
            shapes,
            tie: tie
                .filter(|g| g.size() > 1 && !tied.is_empty())
                .map(|g| (g.clone(), tied)),
            rows,
            bucket_elems,
            wire,
            overlap: settings.overlap,
            mode,
            device,
            step: Mutex::new(StepState::default()),
            read_depths: Default::default(),
        })
    }
}

/// What a set's bucketed reducer is made from.
pub(super) struct SetLayout<'a> {
    pub(super) group: &'a Group,
    /// Its parameters (layout indices).
    pub(super) params: &'a [usize],
    pub(super) row_groups: Option<&'a (Group, Option<Group>)>,
    /// Per parameter of the model's layout: offset and length.
    pub(super) slots: &'a [(usize, usize)],
    /// Per parameter of the model's layout: rows and elements per row.
    pub(super) shapes: &'a [(usize, usize)],
    pub(super) device: &'a Device,
}

impl SetLayout<'_> {
    /// The set's reducer, its buckets filled in `order` (the set's numbering).
    pub(super) fn reducer(
        &self,
        order: &[usize],
        bucket_elems: usize,
        mode: Mode,
        wire: Precision,
    ) -> Reducer {
        let numels: Vec<usize> = self.params.iter().map(|&i| self.slots[i].1).collect();
        let rows = self.row_groups.map(|(group, rest)| RowSplit {
            group: group.clone(),
            shapes: self.params.iter().map(|&i| self.shapes[i]).collect(),
            rest: rest.clone(),
        });
        Reducer::new(
            self.group.clone(),
            self.device.clone(),
            &numels,
            order,
            bucket_elems,
            mode,
            wire,
            rows,
        )
    }
}

/// Where this rank's rows of the held parameters' gradients go, cut over `axis`.
fn row_layout(
    entries: &[(ParamSlot, &ParamPlacement)],
    holds: &impl Fn(usize) -> bool,
    axis: Axis,
    rows: GradientRows,
    mesh: &flashover_runtime::DeviceMesh,
) -> (GradientRowLayout, Vec<Option<usize>>) {
    let mut layout = ParamLayout {
        slots: vec![],
        numel: 0,
    };
    let mut index = vec![None; entries.len()];
    for (i, (slot, _)) in entries.iter().enumerate().filter(|(i, _)| holds(*i)) {
        index[i] = Some(layout.slots.len());
        let offset = layout.numel;
        layout.numel += slot.numel;
        layout.slots.push(ParamSlot {
            offset,
            ..slot.clone()
        });
    }
    let shards = UnitShards::new(&layout, mesh.degree(axis));
    let rows = GradientRowLayout {
        axis,
        layout,
        shards,
        rows,
    };
    (rows, index)
}
