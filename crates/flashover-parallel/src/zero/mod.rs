//! Sharded data parallel: ZeRO stages 1 and 2 here, stage 3 (fully sharded parameters) in
//! [`FullyShardConfig`].
//!
//! | | parameters | gradients after backward | AdamW moments | communication per step |
//! |---|---|---|---|---|
//! | DDP | full | full (all-reduced) | full | all-reduce of gradients |
//! | ZeRO-1 | full | full, then shard kept | shard | all-reduce; all-gather of parameters |
//! | ZeRO-2 | full | shard (reduce-scattered) | shard | reduce-scatter; all-gather of parameters |
//! | ZeRO-3 | shard (rows of each parameter) | shard | shard | per unit: all-gather before use, reduce-scatter of gradients |
//!
//! **What a rank owns** (stages 1-2): chunk `r` of every gradient bucket of
//! [`crate::data_parallel`] ([`ShardMap::bucketed`]), so the reduce-scatter of a bucket delivers
//! exactly the gradient of the elements this rank steps. Buckets that do not divide by the group
//! size are padded; padding never reaches a parameter.
//!
//! **When:** stage 1 all-reduces each bucket as in DDP (overlapped with backward), keeps its
//! chunk and frees the bucket. Stage 2 reduce-scatters every micro-batch's buckets as they
//! fill, accumulating into the shard; hooks keep the gradient out of Burn's container, so a
//! rank never holds the whole gradient, only its shard and the buckets in flight. After the
//! last micro-batch each rank steps AdamW on its shard ([`ZeroOptimizer`]) and one all-gather
//! refreshes every replica. Clipping takes the global norm over the shards.
//!
//! Because [`crate::FlatAdamW`] is bit-identical to Burn's AdamW on Flex, stage 1 equals DDP
//! bit for bit; stage 2 sums micro-batches after ranks rather than before, so it equals DDP to
//! rounding (and bit for bit without accumulation).

mod fully_shard;
mod ops;
mod optimizer;
mod row_adamw;
mod shard_group;
mod shard_map;
mod unit_shards;

pub use fully_shard::{FullyShardConfig, FullyShardedUnit, Prefetch};
pub(crate) use ops::{ScatterHook, gather_shard};
pub use optimizer::{FullyShardedOptimizer, ZeroOptimizer};
pub use row_adamw::RowAdamW;
pub(crate) use shard_group::Pending;
pub use shard_group::{GatherCounts, GatherStats, ShardGroup};
pub use shard_map::{Run, ShardLayout, ShardMap};
pub use unit_shards::UnitShards;

use crate::data_parallel::{DataParallel, DataParallelConfig, Mode, ReduceReport};
use crate::error::ParallelError;
use crate::flat_adamw::FlatAdamWConfig;
use crate::params::ParamLayout;
use burn::config::Config;
use burn::module::Module;
use burn::optim::GradientsParams;
use flashover_comm::Group;

/// What stages 1-2 shard, and how gradients are reduced.
#[derive(Config, Debug)]
pub struct ZeroConfig {
    /// Reduce-scatter gradients so a rank only ever holds its shard (ZeRO-2). `false`
    /// all-reduces them and keeps the shard afterwards (ZeRO-1).
    #[config(default = false)]
    pub shard_gradients: bool,
    /// Bucketing, overlap and averaging of the gradient reduction.
    pub data_parallel: DataParallelConfig,
    /// The AdamW whose moments are sharded.
    pub optimizer: FlatAdamWConfig,
}

impl ZeroConfig {
    /// ZeRO stage 1 (`1`) or 2 (`2`) with default reduction settings. Stage 3 shards
    /// parameters and is [`FullyShardConfig`].
    pub fn stage(stage: usize, optimizer: FlatAdamWConfig) -> Result<Self, ParallelError> {
        match stage {
            1 | 2 => Ok(ZeroConfig::new(DataParallelConfig::new(), optimizer)
                .with_shard_gradients(stage == 2)),
            _ => Err(ParallelError::Invalid(format!(
                "ZeroConfig covers stages 1 and 2, not {stage}; stage 3 is FullyShardConfig"
            ))),
        }
    }

    /// Wraps `model` over `group`: broadcasts rank 0's parameters (collective), plans buckets
    /// and shards. Returns the synchronised model and the per-rank state.
    pub fn init<M: Module>(
        &self,
        model: M,
        group: &Group,
    ) -> Result<(M, ShardedDataParallel), ParallelError> {
        let mode = if self.shard_gradients {
            Mode::ReduceScatter
        } else {
            Mode::AllReduceShard
        };
        let (model, ddp) = self.data_parallel.init_with(model, group, mode)?;
        let optimizer = ZeroOptimizer::new(&model, group, ddp.shard_map(), &self.optimizer)?;
        let numel = ParamLayout::of(&model).numel;
        Ok((
            model,
            ShardedDataParallel {
                ddp,
                optimizer,
                numel,
            },
        ))
    }
}

/// Bytes one rank holds for training state, by kind; see [`ShardedDataParallel::memory`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryReport {
    /// Parameters held between steps (full replicas, or shards).
    pub params: usize,
    /// The most gradient bytes held at once during the step (buckets, shards).
    pub grads: usize,
    /// Optimizer state (AdamW moments).
    pub optimizer: usize,
    /// The most gathered (unsharded) parameter bytes alive at once (ZeRO-3).
    pub gathered_peak: usize,
}

impl MemoryReport {
    /// Parameters + gradients + optimizer state + gathered peak.
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optimizer + self.gathered_peak
    }
}

impl crate::data_parallel::MicroBatches for ShardedDataParallel {
    fn begin_step(&mut self, micro_batches: usize) {
        ShardedDataParallel::begin_step(self, micro_batches)
    }
    fn prepare<M: Module>(&mut self, model: &M) -> M {
        ShardedDataParallel::prepare(self, model)
    }
    fn backward_done<M: Module>(
        &mut self,
        model: &M,
        grads: GradientsParams,
    ) -> Result<(), ParallelError> {
        ShardedDataParallel::backward_done(self, model, grads)
    }
}

/// The per-rank state of ZeRO stages 1-2: the step protocol of
/// [`crate::data_parallel::DataParallel`] (`begin_step`, per micro-batch `prepare` + backward +
/// `backward_done`), then [`ShardedDataParallel::step`], which also updates the parameters.
pub struct ShardedDataParallel {
    ddp: DataParallel,
    optimizer: ZeroOptimizer,
    numel: usize,
}

impl ShardedDataParallel {
    /// Starts a step of `micro_batches` micro-batches.
    pub fn begin_step(&mut self, micro_batches: usize) {
        self.ddp.begin_step(micro_batches);
    }

    /// The model to run the next micro-batch's forward with (gradient hooks attached).
    pub fn prepare<M: Module>(&mut self, model: &M) -> M {
        self.ddp.prepare(model)
    }

    /// After a micro-batch's backward (see [`DataParallel::backward_done`]).
    pub fn backward_done<M: Module>(
        &mut self,
        model: &M,
        grads: GradientsParams,
    ) -> Result<(), ParallelError> {
        self.ddp.backward_done(model, grads)
    }

    /// After the last micro-batch: waits for this rank's gradient shard, clips by the global
    /// norm over all shards, steps AdamW on the shard and all-gathers the new parameters.
    pub fn step<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        max_norm: Option<f32>,
    ) -> Result<(M, ReduceReport), ParallelError> {
        let report = self.reduce(max_norm)?;
        let model = self.apply(lr, model, true)?;
        Ok((model, report))
    }

    /// The first half of [`ShardedDataParallel::step`]: waits for this rank's reduced
    /// gradient shard and clips it; the report's norm says whether it is finite.
    pub fn reduce(&mut self, max_norm: Option<f32>) -> Result<ReduceReport, ParallelError> {
        self.ddp.finish_shard(max_norm)
    }

    /// The second half of [`ShardedDataParallel::step`]: AdamW on this rank's shard and the
    /// updated parameters gathered, or with `update == false` (a skipped step: a loss-scaled
    /// gradient overflowed) the model as it is.
    pub fn apply<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        update: bool,
    ) -> Result<M, ParallelError> {
        let model = if update {
            self.optimizer.step(lr, model, self.ddp.shard_grads())?
        } else {
            model
        };
        // After the first step the reducer re-plans its buckets in gradient order; the
        // optimizer state follows the new shards.
        let map = self.ddp.shard_map();
        if &map != self.optimizer.shard_map() {
            self.optimizer.reshard(map)?;
        }
        Ok(model)
    }

    /// The sharded optimizer (its shard map and state size).
    pub fn optimizer(&self) -> &ZeroOptimizer {
        &self.optimizer
    }

    /// The sharded optimizer, to restore a saved state.
    pub fn optimizer_mut(&mut self) -> &mut ZeroOptimizer {
        &mut self.optimizer
    }

    /// The gradient reduction underneath (buckets, overlap).
    pub fn data_parallel(&self) -> &DataParallel {
        &self.ddp
    }

    /// The gradient reduction underneath, to set its loss scale.
    pub fn data_parallel_mut(&mut self) -> &mut DataParallel {
        &mut self.ddp
    }

    /// Measured bytes of this step (call after [`ShardedDataParallel::step`]).
    pub fn memory(&self) -> MemoryReport {
        MemoryReport {
            params: self.numel * 4,
            grads: self.ddp.peak_grad_bytes(),
            optimizer: self.optimizer.state_bytes(),
            gathered_peak: 0,
        }
    }
}
