//! Where every element of every parameter lives on the mesh: one table, keyed by Burn's
//! [`ParamId`] (ids survive `Param::map`, so a cast or a recomputed view finds its entry).
//!
//! Each entry gives a parameter's name and shape in the whole model and, per mesh axis, how the
//! ranks along that axis hold it, in the spirit of DTensor's placements:
//! - [`Placement::Replicate`]: every rank of the axis holds the same values (the default for an
//!   axis an entry does not name);
//! - [`Placement::Shard`]: rank `r` holds rows `r * chunk ..` of one dimension (the last ranks'
//!   rows past the tensor's end are padding), as tensor parallelism splits a weight;
//! - [`Placement::Own`]: the ranks hold *different* whole tensors, told apart by their global
//!   names, as pipeline stages hold different blocks and expert-parallel ranks different experts.
//!
//! Each strategy that changes where parameters live records it here as it does it (tensor
//! parallelism when it splits a weight, the pipeline split when it cuts the model, expert
//! parallelism when it builds a rank's experts); nothing reads a parameter's name to guess.
//! From the table, one function each derives what used to be re-derived per strategy:
//! - which gradients are summed over which axes ([`ParamPlacement::reduce_axes`]: a gradient
//!   is summed over the data axes, `dp`, `fsdp`, `ep` and `cp`, on which its parameter is
//!   replicated; a plan's buckets reduce each set of axes on its own communicator);
//! - the global gradient norm ([`global_grad_norm`]: local squares, each element counted on one
//!   rank only, one all-reduce over the world);
//! - tied weights ([`Tie`]: two stages' copies of one tensor summed, counted once);
//! - which part of the whole tensor a rank holds ([`ParamPlacement::held`]), which checkpoints
//!   and gathering the whole model build on.

use crate::error::ParallelError;
use crate::grad_clip::{GradNorm, squared_sum};
use crate::params::{ParamLayout, ParamSlot};
use burn::module::{Module, ParamId};
use burn::tensor::{Device, Tensor};
use flashover_comm::ReduceOp;
use flashover_runtime::TensorCollectives;
use flashover_runtime::{Axis, DeviceMesh, RankContext};
use std::collections::HashMap;

/// How the ranks along one mesh axis hold a parameter (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Every rank of the axis holds the same values.
    Replicate,
    /// Rank `r` of the axis holds rows `r * chunk .. (r + 1) * chunk` of dimension `dim` of
    /// what the axes before it left (rows past the end are padding).
    Shard {
        /// The tensor dimension split.
        dim: usize,
        /// Rows per rank (the local extent of `dim`, padding included).
        chunk: usize,
    },
    /// The ranks of the axis hold different whole tensors, named apart in the whole model.
    Own,
}

/// One parameter's entry: its whole-model identity and how the mesh holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamPlacement {
    /// Its name in the whole model (`blocks.3.attn.wq.weight`), the same on every rank that
    /// holds part of it.
    pub name: String,
    /// Its shape in the whole model.
    pub global_shape: Vec<usize>,
    /// The shape this rank holds (padding included).
    pub local_shape: Vec<usize>,
    /// How each axis holds it, outermost split first; axes not named replicate it.
    pub axes: Vec<(Axis, Placement)>,
    /// Whether another pipeline stage holds a copy of the same tensor (tied weights).
    pub tie: Tie,
}

/// One tensor held by two pipeline stages (a tied embedding and LM head): both copies' gradients
/// are summed over the tie group, so the copies stay equal; the original alone is counted in the
/// norm and written to checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Tie {
    /// Not tied.
    #[default]
    None,
    /// The copy that counts (the first stage's embedding).
    Original,
    /// The other copy (the last stage's head).
    Copy,
}

/// The part of the whole tensor a rank holds: per dimension, the first index and the number of
/// real (non-padding) rows; the local tensor holds them at its start along every dimension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// First index per dimension.
    pub offsets: Vec<usize>,
    /// Real rows per dimension (0 along some dimension: this rank holds only padding).
    pub extents: Vec<usize>,
}

impl Held {
    /// Whether this is the whole tensor of `shape`.
    pub fn is_whole(&self, shape: &[usize]) -> bool {
        self.offsets.iter().all(|&o| o == 0) && self.extents == shape
    }
}

impl ParamPlacement {
    /// A whole parameter, replicated on every axis.
    pub fn whole(name: &str, shape: &[usize]) -> Self {
        ParamPlacement {
            name: name.to_string(),
            global_shape: shape.to_vec(),
            local_shape: shape.to_vec(),
            axes: vec![],
            tie: Tie::None,
        }
    }

    /// How `axis` holds it.
    pub fn on(&self, axis: Axis) -> Placement {
        self.axes
            .iter()
            .find(|(a, _)| *a == axis)
            .map_or(Placement::Replicate, |(_, p)| *p)
    }

    /// The data axes (of degree above 1 in `mesh`) its gradient is summed over: those on which
    /// it is replicated. Ranks along a data axis read different samples or positions, so each
    /// holds a partial gradient of a replicated parameter; an owned or sharded parameter's
    /// gradient is already whole on its rank.
    pub fn reduce_axes(&self, mesh: &DeviceMesh) -> Vec<Axis> {
        DATA_AXES
            .into_iter()
            .filter(|&a| mesh.degree(a) > 1 && self.on(a) == Placement::Replicate)
            .collect()
    }

    /// Whether this rank counts its copy of the gradient in the global norm: once per element
    /// in the whole mesh, so on the first rank of every axis that replicates it, and never for
    /// a tied copy.
    pub fn counted(&self, coord: impl Fn(Axis) -> usize) -> bool {
        self.tie != Tie::Copy
            && Axis::ALL
                .iter()
                .all(|&a| self.on(a) != Placement::Replicate || coord(a) == 0)
    }

    /// The part of the whole tensor this rank holds, at coordinates `coord`.
    pub fn held(&self, coord: impl Fn(Axis) -> usize) -> Held {
        let mut offsets = vec![0; self.global_shape.len()];
        let mut extents = self.global_shape.clone();
        for (axis, placement) in &self.axes {
            if let Placement::Shard { dim, chunk } = *placement {
                let start = (coord(*axis) * chunk).min(extents[dim]);
                let end = (start + chunk).min(extents[dim]);
                offsets[dim] += start;
                extents[dim] = end - start;
            }
        }
        Held { offsets, extents }
    }
}

/// The mesh axes whose ranks read different data (samples: `dp`, `fsdp`, `ep`; sequence
/// positions: `cp`).
pub const DATA_AXES: [Axis; 4] = [Axis::Dp, Axis::Fsdp, Axis::Ep, Axis::Cp];

/// Every non-empty set of `mesh`'s data axes above degree 1 (the sets a gradient may be summed
/// over), in one order on every rank.
pub(crate) fn data_axis_sets(mesh: &DeviceMesh) -> Vec<Vec<Axis>> {
    let axes: Vec<Axis> = DATA_AXES
        .into_iter()
        .filter(|&a| mesh.degree(a) > 1)
        .collect();
    (1..(1usize << axes.len()))
        .map(|mask| {
            (0..axes.len())
                .filter(|i| mask & (1 << i) != 0)
                .map(|i| axes[i])
                .collect()
        })
        .collect()
}

/// Every parameter's [`ParamPlacement`], by id; see the module docs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PlacementTable {
    entries: HashMap<ParamId, ParamPlacement>,
}

impl PlacementTable {
    /// `module` whole on every rank: each parameter named by its path, replicated everywhere.
    pub fn whole<M: Module>(module: &M) -> Self {
        let entries = ParamLayout::of(module)
            .slots
            .into_iter()
            .map(|s| (s.id, ParamPlacement::whole(&s.name, &s.shape)))
            .collect();
        PlacementTable { entries }
    }

    /// The entry of parameter `id`.
    pub fn get(&self, id: ParamId) -> Option<&ParamPlacement> {
        self.entries.get(&id)
    }

    /// Records (or replaces) parameter `id`'s entry.
    pub fn insert(&mut self, id: ParamId, entry: ParamPlacement) {
        self.entries.insert(id, entry);
    }

    /// Parameter `from` was replaced by `to`, its rows `rank * chunk ..` along `dim` split
    /// over `axis` (`to` holds `local_shape`, padding included). Fails when `from` has no
    /// entry.
    pub fn shard(
        &mut self,
        from: ParamId,
        to: ParamId,
        axis: Axis,
        dim: usize,
        local_shape: &[usize],
    ) -> Result<(), ParallelError> {
        let mut entry = self.entries.remove(&from).ok_or_else(|| missing(from))?;
        entry.axes.push((
            axis,
            Placement::Shard {
                dim,
                chunk: local_shape[dim],
            },
        ));
        entry.local_shape = local_shape.to_vec();
        self.entries.insert(to, entry);
        Ok(())
    }

    /// Marks parameter `id` as one copy of a tied tensor.
    pub fn tie(&mut self, id: ParamId, tie: Tie) -> Result<(), ParallelError> {
        self.entries.get_mut(&id).ok_or_else(|| missing(id))?.tie = tie;
        Ok(())
    }

    /// Marks parameter `id` as held by only some ranks of `axis`, each holding different
    /// tensors (pipeline stages, experts).
    pub fn own(&mut self, id: ParamId, axis: Axis) -> Result<(), ParallelError> {
        let entry = self.entries.get_mut(&id).ok_or_else(|| missing(id))?;
        entry.axes.retain(|(a, _)| *a != axis);
        entry.axes.push((axis, Placement::Own));
        Ok(())
    }

    /// Gives parameter `id` its whole-model `name` (an expert's global index, say).
    pub fn rename(&mut self, id: ParamId, name: String) -> Result<(), ParallelError> {
        self.entries.get_mut(&id).ok_or_else(|| missing(id))?.name = name;
        Ok(())
    }

    /// `module`'s parameters in visiting order, each with its entry; fails naming the first
    /// parameter the table does not know (a module built outside the transforms).
    pub fn entries_of<M: Module>(
        &self,
        module: &M,
    ) -> Result<Vec<(ParamSlot, &ParamPlacement)>, ParallelError> {
        ParamLayout::of(module)
            .slots
            .into_iter()
            .map(|s| match self.entries.get(&s.id) {
                Some(entry) => Ok((s, entry)),
                None => Err(ParallelError::Invalid(format!(
                    "parameter `{}` has no placement: it was created outside the parallelize \
                     transforms",
                    s.name
                ))),
            })
            .collect()
    }
}

fn missing(id: ParamId) -> ParallelError {
    ParallelError::Invalid(format!("parameter {id:?} has no placement"))
}

/// The global L2 norm of a gradient held as `parts` (each a parameter's local gradient, flat
/// on `device`, with its entry), on the device: the squares of each part this rank counts
/// ([`ParamPlacement::counted`]) summed as [`crate::grad_clip`] sums them (f64 where the
/// device has it), summed over the world with one all-reduce of one element.
pub fn global_grad_norm<'a>(
    parts: impl IntoIterator<Item = (&'a ParamPlacement, Tensor<1>)>,
    device: &Device,
    ctx: &RankContext,
) -> Result<GradNorm, ParallelError> {
    let coord = |a| ctx.coord(a);
    let counted = (parts.into_iter())
        .filter(|(entry, _)| entry.counted(coord))
        .map(|(_, g)| g);
    let mut squares = squared_sum(counted, device);
    if ctx.world_size() > 1 {
        squares = ctx.world().all_reduce_tensor(squares, ReduceOp::Sum)?;
    }
    Ok(GradNorm::from_squares(squares))
}
