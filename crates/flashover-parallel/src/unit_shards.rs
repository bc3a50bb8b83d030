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
use crate::params::{ParamLayout, ParamSlot, part};
use crate::placement::{ParamPlacement, Placement, PlacementTable};
use burn::tensor::{Device, Tensor};
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
    /// The cut of the parameters of `layout` (laid end to end, as [`ParamLayout::of`] lays
    /// them) over `size` ranks.
    pub fn new(layout: &ParamLayout, size: usize) -> Self {
        let shapes: Vec<(usize, usize)> = (layout.slots.iter())
            .map(|s| {
                let rows = s.shape.first().copied().unwrap_or(1);
                (rows, s.numel / rows.max(1))
            })
            .collect();
        Self::of_shapes(&shapes, size)
    }

    /// The cut over `size` ranks of parameters laid end to end, each of `(rows, elements per
    /// row)` in `shapes`.
    pub fn of_shapes(shapes: &[(usize, usize)], size: usize) -> Self {
        let size = size.max(1);
        let (mut at, mut flat) = (0, 0);
        let cuts = (shapes.iter())
            .map(|&(rows, row_len)| {
                let chunk = rows.div_ceil(size);
                let cut = Cut {
                    rows,
                    row_len,
                    chunk,
                    at,
                    flat,
                };
                at += chunk * row_len;
                flat += rows * row_len;
                cut
            })
            .collect();
        UnitShards {
            cuts,
            size,
            shard: at,
            numel: flat,
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

    /// Elements of parameter `i`'s rows in a shard (padding included).
    pub fn len_in_shard(&self, i: usize) -> usize {
        self.cuts[i].chunk * self.cuts[i].row_len
    }

    /// A parameter's values (`cut.rows x cut.row_len` of them) padded to whole chunks: one row
    /// of `[size, chunk x row_len]` per rank.
    fn chunks_of(&self, cut: &Cut, values: Tensor<1>) -> Tensor<2> {
        let padded = self.size * cut.chunk * cut.row_len;
        let rows = match padded - cut.rows * cut.row_len {
            0 => values,
            pad => {
                let zeros = Tensor::zeros([pad], &values.device());
                Tensor::cat(vec![values, zeros], 0)
            }
        };
        rows.reshape([self.size, cut.chunk * cut.row_len])
    }

    /// Parameter `cut`'s values in `flat` (parameter-major).
    fn values_of(cut: &Cut, flat: &Tensor<1>) -> Tensor<1> {
        part(flat, cut.flat, cut.rows * cut.row_len)
    }

    /// Rank `rank`'s shard of `flat` (the unit's parameters, parameter-major, on the device),
    /// padding zeroed.
    pub fn take(&self, rank: usize, flat: &Tensor<1>) -> Tensor<1> {
        let parts: Vec<Tensor<1>> = (self.cuts.iter())
            .filter(|cut| cut.chunk * cut.row_len > 0)
            .map(|cut| {
                let len = cut.chunk * cut.row_len;
                let chunks = self.chunks_of(cut, Self::values_of(cut, flat));
                chunks.narrow(0, rank, 1).reshape([len])
            })
            .collect();
        match parts.is_empty() {
            true => Tensor::zeros([self.shard], &flat.device()),
            false => Tensor::cat(parts, 0),
        }
    }

    /// The unit's parameters, parameter-major, from `gathered` (every rank's shard in turn).
    pub fn assemble(&self, gathered: Tensor<1>) -> Tensor<1> {
        let device = gathered.device();
        let by_rank = gathered.reshape([self.size, self.shard]);
        let parts: Vec<Tensor<1>> = (self.cuts.iter())
            .filter(|cut| cut.rows * cut.row_len > 0)
            .map(|cut| {
                let len = cut.chunk * cut.row_len;
                let rows = by_rank.clone().narrow(1, cut.at, len);
                rows.reshape([self.size * len])
                    .narrow(0, 0, cut.rows * cut.row_len)
            })
            .collect();
        match parts.is_empty() {
            true => Tensor::zeros([self.numel], &device),
            false => Tensor::cat(parts, 0),
        }
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
    pub fn rank_major(&self, flat: &Tensor<1>) -> Tensor<1> {
        let parts = (self.cuts.iter()).map(|cut| Self::values_of(cut, flat));
        self.rank_major_of(parts.collect(), &flat.device())
    }

    /// [`Self::rank_major`] of the parameters' values given one tensor per parameter (on
    /// `device`): each padded to whole chunks and viewed as one row per rank, all side by side,
    /// so row `r` is rank `r`'s shard.
    pub fn rank_major_of(&self, parts: Vec<Tensor<1>>, device: &Device) -> Tensor<1> {
        let blocks: Vec<Tensor<2>> = (self.cuts.iter().zip(parts))
            .filter(|(cut, _)| cut.chunk * cut.row_len > 0)
            .map(|(cut, values)| self.chunks_of(cut, values))
            .collect();
        match blocks.is_empty() {
            true => Tensor::zeros([self.padded()], device),
            false => Tensor::cat(blocks, 1).reshape([self.padded()]),
        }
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

    fn values(t: Tensor<1>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().unwrap()
    }

    #[test]
    fn each_rank_holds_rows_of_every_parameter_and_they_assemble_back() {
        // A 5 x 2 matrix (3 rows per rank, one padded) and a vector of 3 over 2 ranks.
        let shards = UnitShards::new(&layout(&[&[5, 2], &[3]]), 2);
        let device = Device::flex();
        let values_0_to_12: Vec<f32> = (0..13).map(|i| i as f32).collect();
        let flat = Tensor::<1>::from_floats(values_0_to_12.as_slice(), &device);
        assert_eq!(shards.shard_len(), 3 * 2 + 2);
        assert_eq!(
            values(shards.take(0, &flat)),
            [0., 1., 2., 3., 4., 5., 10., 11.]
        );
        assert_eq!(
            values(shards.take(1, &flat)),
            [6., 7., 8., 9., 0., 0., 12., 0.]
        );
        let gathered = shards.rank_major(&flat);
        assert_eq!(gathered.dims()[0], shards.padded());
        assert_eq!(values(shards.assemble(gathered)), values(flat));
    }

    #[test]
    fn a_parameter_with_fewer_rows_than_ranks_leaves_the_last_ranks_padding() {
        let shards = UnitShards::new(&layout(&[&[1, 3]]), 4);
        let flat = Tensor::<1>::from_floats([1., 2., 3.], &Device::flex());
        assert_eq!(values(shards.take(0, &flat)), [1., 2., 3.]);
        assert_eq!(values(shards.take(3, &flat)), [0., 0., 0.]);
        assert_eq!(
            values(shards.assemble(shards.rank_major(&flat))),
            [1., 2., 3.]
        );
    }
}
