//! The optimizer of the per-unit ZeRO-3 wrappers ([`super::FullyShardedUnit`]).

use crate::error::ParallelError;
use crate::flat_adamw::{FlatAdamW, FlatAdamWConfig};
use crate::grad_clip::clip_global_norm;
use crate::params::{
    ParamLayout, accumulate_grads, flatten_params, load_flat, load_packed, pack_params, upload,
};
use crate::precision::{Precision, all_reduce_in};
use burn::module::Module;
use burn::optim::GradientsParams;
use flashover_comm::Group;

/// The step of ZeRO-3 / HSDP: AdamW on a model whose parameters are shards (a module made of
/// [`super::FullyShardedUnit`]s), with no communication in the step itself.
///
/// Per micro-batch, [`FullyShardedOptimizer::accumulate`] adds the shard gradients backward
/// produced (already summed over the shard group by the units' reduce-scatters). The step then
/// all-reduces them across `replicate_group` (HSDP: shard within `fsdp`, replicate across `dp`),
/// averages, clips by the global norm over all shards, and updates each shard in place.
pub struct FullyShardedOptimizer {
    shard_group: Group,
    replicate_group: Option<Group>,
    adam: FlatAdamW,
    grads: Vec<f32>,
    micro_batches: usize,
    average: bool,
    /// The factor losses were multiplied by before backward (divided out with the average).
    loss_scale: f32,
    /// The dtype the HSDP all-reduce over replicas sums in.
    reduce_dtype: Precision,
}

impl FullyShardedOptimizer {
    /// AdamW for `model`'s (sharded) parameters. `average` divides gradient sums by ranks and
    /// micro-batches (for per-sample-mean losses).
    pub fn new<M: Module>(
        model: &M,
        shard_group: &Group,
        replicate_group: Option<&Group>,
        config: &FlatAdamWConfig,
        average: bool,
    ) -> Self {
        let numel = ParamLayout::of(model).numel;
        FullyShardedOptimizer {
            shard_group: shard_group.clone(),
            replicate_group: replicate_group.cloned(),
            adam: FlatAdamW::new(config, numel),
            grads: vec![0.0; numel],
            micro_batches: 0,
            average,
            loss_scale: 1.0,
            reduce_dtype: Precision::F32,
        }
    }

    /// Sums the HSDP replicas' gradients in `dtype` (the shard group's reduce-scatter has its
    /// own, see [`super::ShardGroup::with_precision`]).
    pub fn set_reduce_dtype(&mut self, dtype: Precision) {
        self.reduce_dtype = dtype;
    }

    /// Sets the factor this step's losses were multiplied by (loss scaling; 1 by default).
    pub fn set_loss_scale(&mut self, scale: f32) {
        self.loss_scale = scale;
    }

    /// Bytes of optimizer state (moments of this rank's shards).
    pub fn state_bytes(&self) -> usize {
        self.adam.state_bytes()
    }

    /// This rank's AdamW (moments of its shards in the model's parameter order, step count).
    pub fn flat(&self) -> &FlatAdamW {
        &self.adam
    }

    /// This rank's AdamW, to restore a saved state.
    pub fn flat_mut(&mut self) -> &mut FlatAdamW {
        &mut self.adam
    }

    /// Bytes of gradient held (this rank's shards).
    pub fn grad_bytes(&self) -> usize {
        self.grads.len() * 4
    }

    /// Adds one micro-batch's shard gradients (parameters without one count as zero).
    pub fn accumulate<M: Module>(&mut self, model: &M, grads: &GradientsParams) {
        accumulate_grads(model, grads, &mut self.grads, &[]);
        self.micro_batches += 1;
    }

    /// Averages, clips to `max_norm`, and updates `model`'s shards; returns the model and the
    /// global gradient norm before clipping. Resets the accumulated gradients.
    pub fn step<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        max_norm: Option<f32>,
    ) -> Result<(M, f32), ParallelError> {
        let norm = self.reduce(max_norm)?;
        Ok((self.apply(lr, model, true), norm))
    }

    /// The first half of [`FullyShardedOptimizer::step`]: reduces over replicas, averages,
    /// unscales and clips; returns the global gradient norm before clipping (every element of
    /// the shards counted once: each rank's shard is disjoint, replicas are not added).
    pub fn reduce(&mut self, max_norm: Option<f32>) -> Result<f32, ParallelError> {
        self.reduce_replicas()?;
        clip_global_norm(&mut self.grads, max_norm, Some(&self.shard_group))
    }

    /// [`FullyShardedOptimizer::reduce`] without the norm: reduces over replicas, averages and
    /// unscales, and hands back this rank's shard gradients, for a norm and clipping computed
    /// from the parameters' placements (`crate::placement::global_grad_norm`).
    pub fn reduce_replicas(&mut self) -> Result<&mut [f32], ParallelError> {
        if self.micro_batches == 0 {
            return Err(ParallelError::Invalid(
                "FullyShardedOptimizer::step before any accumulate".into(),
            ));
        }
        let mut ranks = self.shard_group.size();
        if let Some(replicas) = &self.replicate_group {
            all_reduce_in(replicas, &mut self.grads, self.reduce_dtype)?;
            ranks *= replicas.size();
        }
        let ranks = if self.average {
            (ranks * self.micro_batches) as f32
        } else {
            1.0
        };
        let denom = ranks * self.loss_scale;
        if denom != 1.0 {
            self.grads.iter_mut().for_each(|g| *g /= denom);
        }
        Ok(&mut self.grads)
    }

    /// The second half of [`FullyShardedOptimizer::step`]: AdamW on the shards (unless
    /// `update` is false: a skipped step), then the accumulated gradients are reset.
    pub fn apply<M: Module>(&mut self, lr: f64, model: M, update: bool) -> M {
        let shards = if update { pack_params(&model) } else { None };
        let model = match (update, shards) {
            // Where the kernels run the shards stay on their device: the fused AdamW kernel
            // steps them there.
            (true, Some(shards)) => {
                let grads = upload(&self.grads, &shards.device());
                let shards = self.adam.step_on_device(lr, shards, grads);
                load_packed(model, shards)
            }
            (true, None) => {
                let mut flat = flatten_params(&model);
                self.adam.step(lr, &mut flat, &self.grads);
                load_flat(model, &flat)
            }
            (false, _) => model,
        };
        self.grads.iter_mut().for_each(|g| *g = 0.0);
        self.micro_batches = 0;
        model
    }
}
