//! The shard group of a fully sharded model: one communication thread per rank that runs the
//! units' all-gathers and reduce-scatters in submission order, and the gathered-memory counters.
//!
//! Every collective of the units goes through this thread, first in, first out. Ranks submit in
//! the same program order, so they issue the same collectives in the same order, and an
//! all-gather submitted early (a prefetch) runs while the training thread computes.

use crate::precision::Precision;
use burn::tensor::{FloatDType, Tensor};
use flashover_comm::{CommError, Group, ReduceOp};
use flashover_runtime::TensorCollectives;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
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

/// A unit's collective, on untracked tensors of the training thread's device.
enum Job {
    AllGather(Tensor<1>),
    ReduceScatter(Tensor<1>),
}

type Reply = Sender<Result<Tensor<1>, CommError>>;

/// A submitted collective; [`Pending::wait`] returns its result.
#[derive(Debug)]
pub(crate) struct Pending(Receiver<Result<Tensor<1>, CommError>>);

impl Pending {
    /// A collective already done, answering `result`.
    pub(crate) fn ready(result: Result<Tensor<1>, CommError>) -> Self {
        let (tx, rx) = channel();
        let _ = tx.send(result);
        Pending(rx)
    }

    /// Blocks until the collective is done.
    pub(crate) fn wait(self) -> Result<Tensor<1>, CommError> {
        self.0.recv().unwrap_or_else(|_| {
            Err(CommError::Engine {
                engine: "fsdp",
                detail: "the sharding communication thread ended before answering".into(),
            })
        })
    }
}

/// One communication thread per rank that runs the units' all-gathers and reduce-scatters in
/// submission order (ranks submit in the same program order, so they issue the same
/// collectives in the same order, and an all-gather submitted early, a prefetch, runs while
/// the training thread computes), and the gathered-memory counters.
pub struct ShardGroup {
    group: Group,
    stats: GatherStats,
    jobs: Mutex<Option<Sender<(Job, Reply)>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for ShardGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardGroup")
            .field("group", &self.group.name())
            .finish()
    }
}

impl ShardGroup {
    /// Units sharded over `group`, with their communication thread.
    pub fn new(group: &Group) -> Arc<Self> {
        Self::with_precision(group, Precision::F32, Precision::F32)
    }

    /// [`ShardGroup::new`] with parameters all-gathered in `gather` (bf16/f16: rounded first,
    /// half the bytes; FSDP2's `param_dtype`) and gradients reduce-scattered in `reduce`.
    pub fn with_precision(group: &Group, gather: Precision, reduce: Precision) -> Arc<Self> {
        let (tx, rx) = channel::<(Job, Reply)>();
        let worker_group = group.clone();
        let worker = std::thread::Builder::new()
            .name("fsdp-comm".into())
            .spawn(move || {
                for (job, reply) in rx {
                    // A panic (a bug or an injected fault) must reach the waiting thread.
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        run(&worker_group, job, gather, reduce)
                    }))
                    .unwrap_or_else(|payload| {
                        Err(CommError::from_panic(
                            "fsdp",
                            "sharding communication thread",
                            &*payload,
                        ))
                    });
                    let _ = reply.send(result);
                }
            })
            .expect("spawn the FSDP communication thread");
        Arc::new(ShardGroup {
            group: group.clone(),
            stats: GatherStats::default(),
            jobs: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(worker)),
        })
    }

    /// The process group the units are sharded over.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// Gathered-memory and collective counters.
    pub fn stats(&self) -> &GatherStats {
        &self.stats
    }

    fn submit(&self, job: Job) -> Pending {
        let (tx, rx) = channel();
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        match jobs.as_ref() {
            Some(jobs) if jobs.send((job, tx.clone())).is_ok() => {}
            _ => {
                let _ = tx.send(Err(CommError::Engine {
                    engine: "fsdp",
                    detail: "the sharding communication thread is gone".into(),
                }));
            }
        }
        Pending(rx)
    }

    /// Submits an all-gather of this rank's shard (the result is every rank's, in rank order,
    /// in the shard's dtype).
    pub(crate) fn all_gather(&self, own: Tensor<1>) -> Pending {
        self.submit(Job::AllGather(own))
    }

    /// Submits a reduce-scatter (sum) of a full buffer whose length divides by the group size
    /// (the result is f32).
    pub(crate) fn reduce_scatter(&self, full: Tensor<1>) -> Pending {
        self.stats.scattered();
        self.submit(Job::ReduceScatter(full))
    }
}

/// Runs `job` over `group`: parameters travel in `gather` (rounded to it, then back to their
/// own dtype), gradients in `reduce` and come back as f32.
fn run(
    group: &Group,
    job: Job,
    gather: Precision,
    reduce: Precision,
) -> Result<Tensor<1>, CommError> {
    match job {
        Job::AllGather(own) => {
            let dtype = own.dtype();
            let gathered = group.all_gather_tensor(own.cast(gather.float_dtype()), 0)?;
            Ok(gathered.cast(dtype))
        }
        Job::ReduceScatter(full) => {
            let wire = full.cast(reduce.float_dtype());
            let shard = group.reduce_scatter_tensor(wire, 0, ReduceOp::Sum)?;
            Ok(shard.cast(FloatDType::F32))
        }
    }
}

impl Drop for ShardGroup {
    fn drop(&mut self) {
        // Closing the channel ends the worker's loop.
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(worker) = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = worker.join();
        }
    }
}
