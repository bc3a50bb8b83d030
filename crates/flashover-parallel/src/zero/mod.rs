//! Sharded data parallel. ZeRO-1/2 on a plan: [`RowAdamW`] steps each rank's rows of the
//! gradients a plan's `gradient_buckets.rows` reduces to it (all-reduced buckets under ZeRO-1,
//! reduce-scattered ones under ZeRO-2), then gathers the parameters back. ZeRO-3: a plan's
//! `fully_shard` units (their shards cut as [`UnitShards`] says).
//!
//! | | parameters | gradients after backward | AdamW moments | communication per step |
//! |---|---|---|---|---|
//! | DDP | full | full (all-reduced) | full | all-reduce of gradients |
//! | ZeRO-1 | full | full, then rows kept | rows | all-reduce; all-gather of parameters |
//! | ZeRO-2 | full | rows (reduce-scattered) | rows | reduce-scatter; all-gather of parameters |
//! | ZeRO-3 | rows of each parameter | rows | rows | per unit: all-gather before use, reduce-scatter of gradients |
//!
//! Because [`crate::FlatAdamW`] is bit-identical to Burn's AdamW on Flex and a plan divides the
//! sums as DDP does, ZeRO-1/2 without accumulation equal DDP bit for bit.

mod row_adamw;
mod shard_group;
pub(crate) mod units;

pub use crate::unit_shards::UnitShards;
pub use row_adamw::RowAdamW;
pub(crate) use shard_group::Pending;
pub use shard_group::{GatherCounts, GatherStats, ShardGroup};

/// Bytes one rank holds for training state, by kind.
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
