//! How a fully sharded unit cuts its parameters over the shard group: each parameter along its
//! first dimension, as FSDP2 does. Rank `r` holds rows `r * chunk .. (r + 1) * chunk` of every
//! parameter (`chunk = ceil(rows / size)`; rows past the end are zero padding), and its shard is
//! the concatenation of those rows, parameter after parameter.
//!
//! Sharding by parameter rather than cutting the unit's flattening makes every shard a block of
//! each parameter (of its tensor-parallel share, when there is one), so where it belongs in the
//! whole model is a [`crate::placement::Placement::Shard`] like any other, and checkpoints,
//! the gradient norm and gathering read it from the placements.
//!
//! One all-gather still moves a whole unit: the gathered buffer is rank-major (every rank's
//! shard in turn), [`UnitShards::assemble`] puts each parameter's rows back together, and
//! [`UnitShards::rank_major`] lays a gradient out the other way for the reduce-scatter.

use crate::error::ParallelError;
use crate::params::{ParamLayout, ParamSlot};
use crate::placement::{ParamPlacement, Placement, PlacementTable};
use flashover_comm::{CommunicatorExt, Group};
use flashover_runtime::Axis;

/// One parameter's cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cut {
    /// Its first dimension.
    rows: usize,
    /// Elements per row (the product of the other dimensions).
    row_len: usize,
    /// Rows per rank.
    chunk: usize,
    /// Where its rows start in a shard.
    at: usize,
    /// Where it starts in the unit's flat (parameter-major) layout.
    flat: usize,
}

/// The cut of every parameter of a unit over `size` ranks; see the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitShards {
    cuts: Vec<Cut>,
    size: usize,
    shard: usize,
    numel: usize,
}

impl UnitShards {
    /// The cut of the parameters of `layout` over `size` ranks.
    pub fn new(layout: &ParamLayout, size: usize) -> Self {
        let size = size.max(1);
        let mut at = 0;
        let cuts = layout
            .slots
            .iter()
            .map(|s| {
                let rows = s.shape.first().copied().unwrap_or(1);
                let row_len = s.numel / rows.max(1);
                let chunk = rows.div_ceil(size);
                let cut = Cut {
                    rows,
                    row_len,
                    chunk,
                    at,
                    flat: s.offset,
                };
                at += chunk * row_len;
                cut
            })
            .collect();
        UnitShards {
            cuts,
            size,
            shard: at,
            numel: layout.numel,
        }
    }

    /// Elements of one rank's shard (padding included).
    pub fn shard_len(&self) -> usize {
        self.shard
    }

    /// Elements of the gathered, padded buffer: `shard_len x size`.
    pub fn padded(&self) -> usize {
        self.shard * self.size
    }

    /// Real elements of the unit's parameters.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Rows per rank of parameter `i` (its local first dimension, padding included).
    pub fn chunk_rows(&self, i: usize) -> usize {
        self.cuts[i].chunk
    }

    /// Where parameter `i`'s rows start in a shard.
    pub fn offset_in_shard(&self, i: usize) -> usize {
        self.cuts[i].at
    }

    /// The real rows `rank` holds of parameter `i` (as a range of its first dimension).
    fn real_rows(&self, cut: &Cut, rank: usize) -> std::ops::Range<usize> {
        let start = (rank * cut.chunk).min(cut.rows);
        start..(start + cut.chunk).min(cut.rows)
    }

    /// Rank `rank`'s shard of `flat` (the unit's parameters, parameter-major), padding zeroed.
    pub fn take(&self, rank: usize, flat: &[f32]) -> Vec<f32> {
        let mut shard = vec![0.0; self.shard];
        for cut in &self.cuts {
            let rows = self.real_rows(cut, rank);
            let from = cut.flat + rows.start * cut.row_len;
            let len = rows.len() * cut.row_len;
            shard[cut.at..cut.at + len].copy_from_slice(&flat[from..from + len]);
        }
        shard
    }

    /// The unit's parameters, parameter-major, from `gathered` (every rank's shard in turn).
    pub fn assemble(&self, gathered: &[f32]) -> Vec<f32> {
        let mut flat = vec![0.0; self.numel];
        for rank in 0..self.size {
            let shard = &gathered[rank * self.shard..(rank + 1) * self.shard];
            for cut in &self.cuts {
                let rows = self.real_rows(cut, rank);
                let to = cut.flat + rows.start * cut.row_len;
                let len = rows.len() * cut.row_len;
                flat[to..to + len].copy_from_slice(&shard[cut.at..cut.at + len]);
            }
        }
        flat
    }

    /// The unit's parameters (parameter-major) from every rank of `group`'s shard `own`.
    pub fn all_gather(&self, group: &Group, own: &[f32]) -> Result<Vec<f32>, ParallelError> {
        Ok(self.assemble(&group.all_gather_vec(own)?))
    }

    /// A shard laid out by this cut (from `base` in a flat vector) as pieces of the parameters
    /// of `layout`: each parameter's entry in `placements` with its rows split over `axis`,
    /// and where those rows sit. Fails naming a parameter the table does not know.
    pub fn placed(
        &self,
        layout: &ParamLayout,
        placements: &PlacementTable,
        axis: Axis,
        base: usize,
    ) -> Result<Vec<(ParamSlot, ParamPlacement)>, ParallelError> {
        layout
            .slots
            .iter()
            .zip(&self.cuts)
            .map(|(slot, cut)| {
                let mut entry = placements.get(slot.id).cloned().ok_or_else(|| {
                    ParallelError::Invalid(format!(
                        "parameter `{}` of a sharded module has no placement",
                        slot.name
                    ))
                })?;
                let chunk = cut.chunk;
                entry.axes.push((axis, Placement::Shard { dim: 0, chunk }));
                entry.local_shape[0] = chunk;
                let piece = ParamSlot {
                    id: slot.id,
                    name: slot.name.clone(),
                    shape: entry.local_shape.clone(),
                    offset: base + cut.at,
                    numel: chunk * cut.row_len,
                };
                Ok((piece, entry))
            })
            .collect()
    }

    /// `flat` (parameter-major, e.g. the parameters' gradient) laid out rank-major and padded,
    /// as a reduce-scatter over the group takes it.
    pub fn rank_major(&self, flat: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.padded());
        for rank in 0..self.size {
            out.extend(self.take(rank, flat));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::ParamSlot;
    use burn::module::ParamId;

    fn layout(shapes: &[&[usize]]) -> ParamLayout {
        let mut offset = 0;
        let slots = shapes
            .iter()
            .map(|shape| {
                let numel = shape.iter().product();
                let slot = ParamSlot {
                    id: ParamId::new(),
                    name: String::new(),
                    shape: shape.to_vec(),
                    offset,
                    numel,
                };
                offset += numel;
                slot
            })
            .collect();
        ParamLayout {
            slots,
            numel: offset,
        }
    }

    #[test]
    fn each_rank_holds_rows_of_every_parameter_and_they_assemble_back() {
        // A 5 x 2 matrix (3 rows per rank, one padded) and a vector of 3 over 2 ranks.
        let shards = UnitShards::new(&layout(&[&[5, 2], &[3]]), 2);
        let flat: Vec<f32> = (0..13).map(|i| i as f32).collect();
        assert_eq!(shards.shard_len(), 3 * 2 + 2);
        assert_eq!(shards.take(0, &flat), [0., 1., 2., 3., 4., 5., 10., 11.]);
        assert_eq!(shards.take(1, &flat), [6., 7., 8., 9., 0., 0., 12., 0.]);
        let gathered = shards.rank_major(&flat);
        assert_eq!(gathered.len(), shards.padded());
        assert_eq!(shards.assemble(&gathered), flat);
    }

    #[test]
    fn a_parameter_with_fewer_rows_than_ranks_leaves_the_last_ranks_padding() {
        let shards = UnitShards::new(&layout(&[&[1, 3]]), 4);
        let flat = [1., 2., 3.];
        assert_eq!(shards.take(0, &flat), [1., 2., 3.]);
        assert_eq!(shards.take(3, &flat), [0., 0., 0.]);
        assert_eq!(shards.assemble(&shards.rank_major(&flat)), flat);
    }
}
