//! Sharded data parallel (ZeRO). **This session: stage 1**, optimizer-state sharding.
//!
//! **What is sharded:** the AdamW moments. The flattened parameters (layout order, padded to a
//! multiple of the group size) are cut into one contiguous shard per rank of the sharding group;
//! each rank keeps moments for its shard only: `8 x params / N` bytes instead of `8 x params`.
//! **Communication per step:** the gradient all-reduce of data parallel (unchanged), then one
//! all-gather of the updated shards (`(N-1)/N x 4 x params` bytes of bus traffic per rank).
//!
//! Because [`FlatAdamW`] is bit-identical to Burn's AdamW on Flex and each rank updates its
//! shard from the same averaged gradient, ZeRO-1 training equals DDP training bit for bit.
//! Stages 2 and 3 (gradient and parameter sharding) and HSDP are the rest of the issue.

use crate::error::ParallelError;
use crate::flat_adamw::{FlatAdamW, FlatAdamWConfig};
use crate::params::{ParamLayout, flatten_params, load_flat};
use burn::module::Module;
use flashover_comm::{CommunicatorExt, Group};
use std::ops::Range;

/// How a flat buffer of `numel` elements is cut into `size` equal shards (the last ones padded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLayout {
    /// Real elements.
    pub numel: usize,
    /// Elements per shard: `ceil(numel / size)`.
    pub shard: usize,
    /// Number of shards (the group size).
    pub size: usize,
}

impl ShardLayout {
    /// Shards of `numel` elements over `size` ranks.
    pub fn new(numel: usize, size: usize) -> Self {
        ShardLayout {
            numel,
            shard: numel.div_ceil(size.max(1)),
            size: size.max(1),
        }
    }

    /// Padded length: `shard x size`.
    pub fn padded(&self) -> usize {
        self.shard * self.size
    }

    /// The padded range rank `r` owns.
    pub fn range(&self, r: usize) -> Range<usize> {
        r * self.shard..(r + 1) * self.shard
    }
}

/// ZeRO stage 1: AdamW whose state is sharded over `group`; see the module docs.
pub struct ZeroOptimizer {
    group: Group,
    shards: ShardLayout,
    adam: FlatAdamW,
    /// Padded flat parameters (host copy) and the gather buffer.
    params: Vec<f32>,
    gathered: Vec<f32>,
}

impl ZeroOptimizer {
    /// Sharded AdamW for `model`'s float parameters over `group` (every rank must hold the same
    /// parameters, e.g. after [`crate::data_parallel::DataParallelConfig::init`]).
    pub fn new<M: Module>(model: &M, group: &Group, config: &FlatAdamWConfig) -> Self {
        let shards = ShardLayout::new(ParamLayout::of(model).numel, group.size());
        ZeroOptimizer {
            group: group.clone(),
            adam: FlatAdamW::new(config, shards.shard),
            params: vec![0.0; shards.padded()],
            gathered: vec![0.0; shards.padded()],
            shards,
        }
    }

    /// The shard layout.
    pub fn shards(&self) -> ShardLayout {
        self.shards
    }

    /// Bytes of optimizer state this rank holds.
    pub fn state_bytes(&self) -> usize {
        self.adam.state_bytes()
    }

    /// One step: updates this rank's shard from `flat_grads` (the whole averaged gradient in
    /// layout order), all-gathers every shard, and returns `model` with the new parameters.
    pub fn step<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        flat_grads: &[f32],
    ) -> Result<M, ParallelError> {
        let numel = self.shards.numel;
        if flat_grads.len() != numel {
            return Err(ParallelError::Invalid(format!(
                "ZeRO step got {} gradient elements for a model of {numel}",
                flat_grads.len()
            )));
        }
        self.params[..numel].copy_from_slice(&flatten_params(&model));
        let own = self.shards.range(self.group.rank());
        let mut grads = vec![0.0; own.len()];
        let real = own.start.min(numel)..own.end.min(numel);
        grads[..real.len()].copy_from_slice(&flat_grads[real]);
        self.adam.step(lr, &mut self.params[own.clone()], &grads);
        self.group
            .all_gather(&self.params[own], &mut self.gathered)?;
        Ok(load_flat(model, &self.gathered[..numel]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_buffer_with_padding_at_the_end() {
        let s = ShardLayout::new(10, 3);
        assert_eq!((s.shard, s.padded()), (4, 12));
        assert_eq!(s.range(2), 8..12);
        assert_eq!(ShardLayout::new(12, 4).padded(), 12);
        assert_eq!(ShardLayout::new(0, 4).shard, 0);
    }
}
