//! The bucketed gradient reducer behind DDP and ZeRO-1/2: gradients added per parameter on
//! their device (from hooks during backward, or after it), laid out into one bucket tensor when
//! the bucket completes, and a per-rank communication thread that reduces buckets strictly in
//! bucket order as soon as each is complete, so every rank issues the same collectives in the
//! same order while backward goes on. The collectives take the bucket as a tensor
//! ([`TensorCollectives`]): whatever staging an engine needs happens there, nowhere else.
//!
//! Three modes. **All-reduce** (DDP): gradients accumulate over micro-batches; only the last
//! micro-batch launches reductions. **All-reduce, then shard** (ZeRO-1): the same, but once
//! reduced each bucket gives up this rank's chunk and the rest is dropped. **Reduce-scatter**
//! (ZeRO-2): every micro-batch's buckets are reduce-scattered as they fill; each rank adds its
//! chunk of every bucket into its gradient shard, so a rank holds its shard plus the buckets in
//! flight, not the whole gradient.
//!
//! Buckets are first planned in reverse layout order, but backward does not finish parameters
//! in exactly that order (norm weights, embeddings...): a bucket would then be allocated at its
//! first gradient and wait long for its last, and reduction in bucket order would stall. So the
//! reducer records the order gradients arrive in, and after the first step DDP re-plans its
//! buckets from rank 0's order (broadcast, so all ranks issue the same collectives), as PyTorch
//! DDP rebuilds its buckets after the first iteration.
//!
//! The reducer counts the gradient bytes it holds (and their peak in the step), so strategies
//! can report measured memory rather than formulas.

mod worker;

use crate::hook::GradCallback;
use crate::params::part;
use crate::precision::Precision;
use crate::unit_shards::UnitShards;
use burn::tensor::{Device, Tensor};
use flashover_comm::{CommError, Group};
use flashover_runtime::SharedWork;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

/// A parameter's gradient that a collective still computes: rows `start..start + len` of
/// what `rows` returns (a fully sharded unit's reduce-scatter, which returns the unit's
/// parameters' rows end to end). Its bucket waits for it when laid out, on the communication
/// thread, so backward goes on meanwhile.
#[derive(Debug, Clone)]
pub(crate) struct LaterGrad {
    pub(crate) rows: Arc<SharedWork<Tensor<1>>>,
    pub(crate) start: usize,
    pub(crate) len: usize,
}

/// One parameter of a reducer, taking [`LaterGrad`]s ([`Reducer::later_handle`]).
#[derive(Clone)]
pub(crate) struct LaterHandle {
    shared: Arc<Shared>,
    param: usize,
}

impl std::fmt::Debug for LaterHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LaterHandle({})", self.param)
    }
}

impl LaterHandle {
    /// Adds `later` to the parameter's gradient of this micro-batch. It does not mark the
    /// gradient final: the parameter's hook still reports it, after, with a zero gradient
    /// that is not added.
    pub(crate) fn hand(&self, later: LaterGrad) {
        let mut handed = lock(&self.shared.later[self.param]);
        handed.grads.push(later);
        handed.zero_owed = true;
    }
}

/// A parameter's gradients handed later ([`LaterHandle::hand`]).
#[derive(Debug, Default)]
struct Later {
    grads: Vec<LaterGrad>,
    /// Its hook's next report is the zero that follows a handed gradient.
    zero_owed: bool,
}

/// Which parameters (by layout index) a bucket holds and where.
#[derive(Debug, Clone)]
pub(crate) struct BucketPlan {
    /// Parameter indices, in the order they are laid out in the bucket.
    pub params: Vec<usize>,
    /// Elements in the bucket.
    pub len: usize,
}

/// Splits parameters into buckets of about `bucket_elems` elements, taking parameters in
/// `order` (the order backward produces their gradients; reverse layout order before it is
/// known). Every bucket holds at least one parameter. Returns the buckets and, per parameter,
/// (bucket, offset in bucket).
pub(crate) fn plan_buckets(
    numels: &[usize],
    order: &[usize],
    bucket_elems: usize,
) -> (Vec<BucketPlan>, Vec<(usize, usize)>) {
    let mut buckets: Vec<BucketPlan> = vec![];
    let mut location = vec![(0, 0); numels.len()];
    for &p in order {
        let start_new = buckets
            .last()
            .is_none_or(|b| b.len > 0 && b.len + numels[p] > bucket_elems);
        if start_new {
            buckets.push(BucketPlan {
                params: vec![],
                len: 0,
            });
        }
        let b = buckets.len() - 1;
        location[p] = (b, buckets[b].len);
        buckets[b].params.push(p);
        buckets[b].len += numels[p];
    }
    (buckets, location)
}

/// Gradient reduction of a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Every rank gets the whole sum (DDP).
    AllReduce,
    /// All-reduce, then keep chunk `r` of every bucket and drop the rest (ZeRO-1).
    AllReduceShard,
    /// Rank `r` gets the sum of chunk `r` of every bucket (ZeRO-2).
    ReduceScatter,
}

/// Reduce-scatter mode keeps at most this many buckets holding gradients while the
/// communication thread can drain them: one filling, one being reduced.
const MAX_BUFFERS_IN_FLIGHT: usize = 2;

struct State {
    /// Per bucket: whether it holds gradients not yet reduced (reduce-scatter mode).
    open: Vec<bool>,
    /// Parameters in the order their gradients arrived in the current micro-batch.
    arrivals: Vec<usize>,
    /// Reductions launch when a bucket fills (last micro-batch, or every one when scattering).
    launch: bool,
    /// The micro-batch in progress is the step's last.
    last: bool,
    arrived: Vec<bool>,
    pending: Vec<usize>,
    ready: Vec<bool>,
    next: usize,
    spans: Vec<(Instant, Instant)>,
    error: Option<CommError>,
    shutdown: bool,
}

struct Shared {
    group: Group,
    /// The device the gradients live on (zeros for parameters that got none are made there).
    device: Device,
    /// Buckets laid out by rows (ZeRO-1/2 of whole parameters' rows), if they are.
    rows: Option<RowLayout>,
    mode: Mode,
    /// The dtype buckets travel and are summed in (f32, or rounded to bf16/f16).
    wire: Precision,
    /// Per bucket: its chunk length (`ceil(len / size)`, or the rows' under rows).
    chunks: Vec<usize>,
    /// Gradient bytes held (gradients, buckets and shard) now, and at most since the step began.
    held: Mutex<(usize, usize)>,
    /// Per parameter: element count.
    numels: Vec<usize>,
    buckets: Vec<BucketPlan>,
    location: Vec<(usize, usize)>,
    /// Per parameter: its gradient summed over the micro-batches so far, until its bucket is
    /// reduced.
    grads: Vec<Mutex<Option<Tensor<1>>>>,
    /// Per parameter: gradients still being reduce-scattered, added to `grads` when the
    /// bucket is laid out.
    later: Vec<Mutex<Later>>,
    /// Per bucket: its sum over the ranks (all-reduce mode), until it is drained.
    reduced: Vec<Mutex<Option<Tensor<1>>>>,
    /// Per bucket: this rank's chunk of its sum (ZeRO modes), summed over the micro-batches.
    shard: Vec<Mutex<Option<Tensor<1>>>>,
    state: Mutex<State>,
    changed: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Bytes of an f32 tensor.
fn bytes(t: &Tensor<1>) -> usize {
    t.dims()[0] * 4
}

/// Buckets laid out by rows: every parameter cut along its first dimension over the ranks of
/// `group` (`ceil(rows / size)` rows each, the last ones padded), a bucket holding rank 0's rows
/// of each of its parameters, then rank 1's, and so on. So chunk `r` of a bucket is exactly rank
/// `r`'s rows of its parameters: a reduce-scatter over `group` hands each rank the sum of its
/// rows (ZeRO-2), and after an all-reduce each rank keeps its chunk (ZeRO-1).
pub(crate) struct RowSplit {
    /// The ranks the rows are cut over (a communicator the reducer's thread alone uses).
    pub group: Group,
    /// Per parameter (the reducer's numbering): its rows and elements per row.
    pub shapes: Vec<(usize, usize)>,
    /// Reduce-scatter mode: the rest of the ranks to sum over, after the reduce-scatter over
    /// `group` (a communicator of the thread's own), if any.
    pub rest: Option<Group>,
}

/// A [`RowSplit`] laid out over the buckets.
struct RowLayout {
    split: RowSplit,
    /// Per bucket: its parameters (in bucket order) cut over the split's ranks, as ZeRO-3's
    /// units cut theirs.
    shards: Vec<UnitShards>,
    /// Per parameter: its place among its bucket's.
    index: Vec<usize>,
}

/// What the reducer measured in one step.
#[derive(Debug, Clone, Default)]
pub(crate) struct Spans {
    /// (start, end) of each bucket's all-reduce, in bucket order.
    pub spans: Vec<(Instant, Instant)>,
}

/// Owns the gradients and the communication thread of one rank.
pub(crate) struct Reducer {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl Reducer {
    /// A reducer over `group` for parameters of `numels` elements whose gradients live on
    /// `device`, bucketed in `order`, that all-reduces whole buckets (`mode` all-reduce) or
    /// reduce-scatters them, its buckets laid out by `rows` (see [`RowSplit`]) when given:
    /// all-reduce then keep this rank's rows (ZeRO-1) or reduce-scatter them (ZeRO-2).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        group: Group,
        device: Device,
        numels: &[usize],
        order: &[usize],
        bucket_elems: usize,
        mode: Mode,
        wire: Precision,
        rows: Option<RowSplit>,
    ) -> Self {
        let (buckets, mut location) = plan_buckets(numels, order, bucket_elems);
        let size = group.size();
        let mut chunks: Vec<usize> = buckets.iter().map(|b| b.len.div_ceil(size)).collect();
        let rows = rows.map(|split| {
            let mut index = vec![0; numels.len()];
            let shards = (buckets.iter().enumerate())
                .map(|(b, bucket)| {
                    let shapes: Vec<_> = bucket.params.iter().map(|&p| split.shapes[p]).collect();
                    let shards = UnitShards::of_shapes(&shapes, split.group.size());
                    for (i, &p) in bucket.params.iter().enumerate() {
                        index[p] = i;
                        location[p] = (b, shards.offset_in_shard(i));
                    }
                    chunks[b] = shards.shard_len();
                    shards
                })
                .collect();
            RowLayout {
                split,
                shards,
                index,
            }
        });
        let none = |n: usize| (0..n).map(|_| Mutex::new(None)).collect::<Vec<_>>();
        let shared = Arc::new(Shared {
            group,
            device,
            rows,
            mode,
            wire,
            held: Mutex::new((0, 0)),
            numels: numels.to_vec(),
            grads: none(numels.len()),
            later: (0..numels.len()).map(|_| Mutex::default()).collect(),
            reduced: none(buckets.len()),
            shard: none(buckets.len()),
            chunks,
            state: Mutex::new(State {
                open: vec![false; buckets.len()],
                arrivals: vec![],
                launch: false,
                last: false,
                arrived: vec![false; numels.len()],
                pending: buckets.iter().map(|b| b.params.len()).collect(),
                ready: vec![false; buckets.len()],
                next: buckets.len(),
                spans: vec![],
                error: None,
                shutdown: false,
            }),
            buckets,
            location,
            changed: Condvar::new(),
        });
        let worker_shared = shared.clone();
        let worker = std::thread::Builder::new()
            .name("ddp-reducer".into())
            .spawn(move || {
                flashover_comm::mark_background_thread();
                worker::worker_loop(&worker_shared)
            })
            .expect("spawn the DDP communication thread");
        Reducer {
            shared,
            worker: Some(worker),
        }
    }

    pub(crate) fn buckets(&self) -> &[BucketPlan] {
        &self.shared.buckets
    }

    /// Where parameter `param`'s rows sit in this rank's shard ([`Self::wait_shard`]) and how
    /// many elements they are (padding included), when the buckets are laid out by rows.
    pub(crate) fn rows_in_shard(&self, param: usize) -> Option<(usize, usize)> {
        let s = &self.shared;
        let rows = s.rows.as_ref()?;
        let (b, at) = s.location[param];
        let chunk_offset: usize = s.chunks[..b].iter().sum();
        Some((
            chunk_offset + at,
            rows.shards[b].len_in_shard(rows.index[param]),
        ))
    }

    /// Parameters in the order their gradients arrived in the last micro-batch.
    pub(crate) fn arrival_order(&self) -> Vec<usize> {
        lock(&self.shared.state).arrivals.clone()
    }

    /// Gradient bytes held now, and the most held at once since the step began.
    pub(crate) fn held_bytes(&self) -> (usize, usize) {
        *lock(&self.shared.held)
    }

    /// Starts a step: drops whatever a failed step left; the worker waits for the first
    /// bucket.
    pub(crate) fn begin_step(&self) {
        let s = &self.shared;
        for slot in s.grads.iter().chain(&s.reduced).chain(&s.shard) {
            lock(slot).take();
        }
        s.later
            .iter()
            .for_each(|later| *lock(later) = Later::default());
        *lock(&s.held) = (0, 0);
        let mut st = lock(&s.state);
        st.next = 0;
        st.ready.iter_mut().for_each(|r| *r = false);
        st.open.iter_mut().for_each(|o| *o = false);
        st.spans.clear();
        st.error = None;
    }

    /// Starts a micro-batch. Buckets are reduced as they fill on the last micro-batch, and on
    /// every micro-batch in reduce-scatter mode.
    pub(crate) fn begin_micro(&self, last: bool) {
        let mut st = lock(&self.shared.state);
        st.launch = last || self.shared.mode == Mode::ReduceScatter;
        st.last = last;
        st.arrived.iter_mut().for_each(|a| *a = false);
        st.pending = self.shared.buckets.iter().map(|b| b.params.len()).collect();
        st.arrivals.clear();
        if self.shared.mode == Mode::ReduceScatter {
            st.next = 0;
            st.ready.iter_mut().for_each(|r| *r = false);
        }
    }

    /// From now on in this micro-batch, a bucket is reduced as soon as it is complete (those
    /// complete already, at once): the step's gradients are all coming.
    pub(crate) fn launch_all(&self) {
        let mut st = lock(&self.shared.state);
        st.launch = true;
        for b in 0..self.shared.buckets.len() {
            if st.pending[b] == 0 {
                st.ready[b] = true;
            }
        }
        self.shared.changed.notify_all();
    }

    /// Whether the micro-batch in progress is the step's last (its complete buckets are
    /// reduced; in reduce-scatter mode every micro-batch's are).
    pub(crate) fn is_last_micro(&self) -> bool {
        lock(&self.shared.state).last
    }

    /// Adds a gradient of parameter `param` (flat, on the reducer's device) into its bucket
    /// and marks it final for this micro-batch.
    pub(crate) fn add(&self, param: usize, grad: Tensor<1>) {
        self.shared.add(param, grad);
    }

    /// Marks parameter `param` final for this micro-batch without a gradient.
    pub(crate) fn mark_absent(&self, param: usize) {
        self.shared.mark_absent(param);
    }

    /// Where parameter `param`'s gradient can be handed while a collective still computes it
    /// ([`LaterHandle::hand`]).
    pub(crate) fn later_handle(&self, param: usize) -> LaterHandle {
        LaterHandle {
            shared: self.shared.clone(),
            param,
        }
    }

    /// A callback for gradient hooks: adds the gradient of parameter `param` during backward.
    pub(crate) fn callback(&self, param: usize) -> GradCallback {
        let shared = self.shared.clone();
        GradCallback(Arc::new(move |grad: Tensor<1>| shared.add(param, grad)))
    }

    /// Which parameters have reported this micro-batch.
    pub(crate) fn arrived(&self) -> Vec<bool> {
        lock(&self.shared.state).arrived.clone()
    }

    /// Waits until every bucket of the current micro-batch is reduced (reduce-scatter mode
    /// adds chunks into the shard).
    pub(crate) fn wait_reduced(&self) -> Result<Spans, CommError> {
        let started = Instant::now();
        let mut st = lock(&self.shared.state);
        while st.next < self.shared.buckets.len() && st.error.is_none() {
            st = self
                .shared
                .changed
                .wait(st)
                .unwrap_or_else(|e| e.into_inner());
        }
        // What the training thread did not hide, on the reducer's group.
        self.shared.group.record_wait(started.elapsed());
        if let Some(e) = st.error.take() {
            return Err(e);
        }
        Ok(Spans {
            spans: st.spans.clone(),
        })
    }

    /// Waits until every bucket is reduced and hands over this rank's gradient shard (chunk `r`
    /// of every bucket, in bucket order). ZeRO modes only.
    pub(crate) fn wait_shard(&self) -> Result<(Tensor<1>, Spans), CommError> {
        assert_ne!(
            self.shared.mode,
            Mode::AllReduce,
            "wait_shard needs a ZeRO reduction mode"
        );
        let spans = self.wait_reduced()?;
        let s = &self.shared;
        let chunks: Vec<Tensor<1>> = (s.shard.iter().zip(&s.chunks))
            .map(|(slot, &c)| lock(slot).take().unwrap_or_else(|| s.zeros(c)))
            .collect();
        // The shard now belongs to the caller, which accounts for it.
        s.release(chunks.iter().map(bytes).sum());
        let shard = match chunks.is_empty() {
            true => s.zeros(0),
            false => Tensor::cat(chunks, 0),
        };
        Ok((shard, spans))
    }

    /// Every parameter's reduced gradient, in the reducer's numbering (all-reduce modes,
    /// after [`Reducer::wait_reduced`]); the buckets are handed over with them.
    pub(crate) fn drain(&self) -> Vec<Tensor<1>> {
        let s = &self.shared;
        let sums: Vec<Option<Tensor<1>>> = s.reduced.iter().map(|slot| lock(slot).take()).collect();
        s.release(sums.iter().flatten().map(bytes).sum());
        (s.numels.iter().enumerate())
            .map(|(p, &n)| {
                let (b, offset) = s.location[p];
                match &sums[b] {
                    Some(sum) => part(sum, offset, n),
                    None => s.zeros(n),
                }
            })
            .collect()
    }
}

impl Drop for Reducer {
    fn drop(&mut self) {
        lock(&self.shared.state).shutdown = true;
        self.shared.changed.notify_all();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_fill_in_reverse_order_and_cover_every_parameter() {
        let (buckets, loc) = plan_buckets(&[10, 5, 20, 3, 8], &[4, 3, 2, 1, 0], 16);
        let order: Vec<Vec<usize>> = buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(order, vec![vec![4, 3], vec![2], vec![1, 0]]);
        assert_eq!(loc[3], (0, 8));
        assert_eq!(loc[0], (2, 5));
        assert_eq!(buckets.iter().map(|b| b.len).sum::<usize>(), 46);
        // In the order gradients arrived instead (rebuilt after the first step).
        let (buckets, _) = plan_buckets(&[10, 5, 20, 3, 8], &[1, 4, 0, 3, 2], 16);
        let order: Vec<Vec<usize>> = buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(order, vec![vec![1, 4], vec![0, 3], vec![2]]);
    }
}
