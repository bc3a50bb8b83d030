//! The shard group of a fully sharded model: one communication stream per rank
//! ([`CommStream`]) that runs the units' all-gathers and reduce-scatters in submission order,
//! and the gathered-memory counters.

use crate::precision::Precision;
use burn::tensor::{FloatDType, Tensor};
use flashover_comm::{Group, ReduceOp};
use flashover_runtime::{CommStream, TensorCollectives, Work};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Gathered-parameter bytes alive on one rank and collectives issued, shared by the units of a
/// model.
#[derive(Debug, Default)]
pub struct GatherStats {
    counts: Mutex<GatherCounts>,
}

/// A snapshot of [`GatherStats`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GatherCounts {
    /// Gathered parameter bytes alive now (from the all-gather's submission to the release).
    pub live_bytes: usize,
    /// The most alive at once since [`GatherStats::reset_peak`].
    pub peak_bytes: usize,
    /// All-gathers issued.
    pub all_gathers: usize,
    /// Of those, the ones submitted ahead of use (prefetches).
    pub prefetches: usize,
    /// Reduce-scatters issued.
    pub reduce_scatters: usize,
    /// Time the training thread spent waiting for collectives (communication not hidden).
    pub waited: Duration,
}

impl GatherStats {
    /// The counts now.
    pub fn snapshot(&self) -> GatherCounts {
        *self.lock()
    }

    /// Starts a new peak measurement at the current live bytes.
    pub fn reset_peak(&self) {
        let mut c = self.lock();
        c.peak_bytes = c.live_bytes;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GatherCounts> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn gathered(&self, bytes: usize, prefetch: bool) {
        let mut c = self.lock();
        c.live_bytes += bytes;
        c.peak_bytes = c.peak_bytes.max(c.live_bytes);
        c.all_gathers += 1;
        c.prefetches += prefetch as usize;
    }

    pub(crate) fn released(&self, bytes: usize) {
        let mut c = self.lock();
        c.live_bytes = c.live_bytes.saturating_sub(bytes);
    }

    pub(crate) fn scattered(&self) {
        self.lock().reduce_scatters += 1;
    }

    pub(crate) fn waited(&self, time: Duration) {
        self.lock().waited += time;
    }
}

/// A unit's collective submitted to its stream; `wait` returns its result.
pub(crate) type Pending = Work<Tensor<1>>;

/// The communication stream of a model's fully sharded units, with the dtypes they travel in
/// and the gathered-memory counters. Every unit collective (gathers, prefetches, gradient
/// reduce-scatters) runs on the stream in submission order: ranks submit in the same program
/// order, so they issue the same collectives in the same order, and an all-gather submitted
/// early (a prefetch) runs while the training thread computes.
pub struct ShardGroup {
    stream: Arc<CommStream>,
    stats: GatherStats,
    /// The dtype parameters are all-gathered in (FSDP2's `param_dtype`).
    gather: Precision,
    /// The dtype gradients are reduce-scattered in.
    reduce: Precision,
}

impl std::fmt::Debug for ShardGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardGroup")
            .field("group", &self.group().name())
            .finish()
    }
}

impl ShardGroup {
    /// Units sharded over `group`, with their communication stream.
    pub fn new(group: &Group) -> Arc<Self> {
        Self::with_precision(group, Precision::F32, Precision::F32)
    }

    /// [`ShardGroup::new`] with parameters all-gathered in `gather` (bf16/f16: rounded first,
    /// half the bytes; FSDP2's `param_dtype`) and gradients reduce-scattered in `reduce`.
    pub fn with_precision(group: &Group, gather: Precision, reduce: Precision) -> Arc<Self> {
        Arc::new(ShardGroup {
            stream: CommStream::new(group, "sharding communication thread"),
            stats: GatherStats::default(),
            gather,
            reduce,
        })
    }

    /// The process group the units are sharded over.
    pub fn group(&self) -> &Group {
        self.stream.group()
    }

    /// Gathered-memory and collective counters.
    pub fn stats(&self) -> &GatherStats {
        &self.stats
    }

    /// Submits an all-gather of this rank's shard (untracked; the result is every rank's, in
    /// rank order, in the shard's dtype, rounded to the gather dtype on the way).
    pub(crate) fn all_gather(&self, own: Tensor<1>) -> Pending {
        let wire = self.gather.float_dtype();
        self.stream.submit(move |group| {
            let dtype = own.dtype();
            Ok(group.all_gather_tensor(own.cast(wire), 0)?.cast(dtype))
        })
    }

    /// Submits a reduce-scatter (sum, in the reduce dtype) of a full buffer whose length
    /// divides by the group size; the result is f32.
    pub(crate) fn reduce_scatter(&self, full: Tensor<1>) -> Pending {
        self.stats.scattered();
        let wire = self.reduce.float_dtype();
        self.stream.submit(move |group| {
            let shard = group.reduce_scatter_tensor(full.cast(wire), 0, ReduceOp::Sum)?;
            Ok(shard.cast(FloatDType::F32))
        })
    }
}
