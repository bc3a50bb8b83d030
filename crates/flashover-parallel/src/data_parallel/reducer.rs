//! The bucketed gradient reducer behind DDP and ZeRO-1/2: per-bucket host buffers that
//! gradients are added into (from hooks during backward, or after it), and a per-rank
//! communication thread that reduces buckets strictly in bucket order as soon as each is
//! complete, so every rank issues the same collectives in the same order while backward goes on.
//!
//! Three modes. **All-reduce** (DDP): buffers persist and accumulate over micro-batches; only
//! the last micro-batch launches reductions. **All-reduce, then shard** (ZeRO-1): the same, but
//! once reduced each bucket gives up this rank's chunk and is freed. **Reduce-scatter**
//! (ZeRO-2): every micro-batch's buckets are reduce-scattered as they fill; each rank adds its
//! chunk of every bucket into its gradient shard, and a bucket's buffer is freed once reduced,
//! so a rank holds its shard plus the buckets in flight, not the whole gradient.
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

use crate::hook::GradCallback;
use crate::precision::{Precision, all_reduce_in, reduce_scatter_in};
use flashover_comm::{CommError, Group};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

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
    /// All-reduce, then keep chunk `r` of every bucket and free the bucket (ZeRO-1).
    AllReduceShard,
    /// Rank `r` gets the sum of chunk `r` of every bucket (ZeRO-2).
    ReduceScatter,
}

/// Reduce-scatter mode keeps at most this many bucket buffers allocated while the
/// communication thread can drain them: one filling, one being reduced.
const MAX_BUFFERS_IN_FLIGHT: usize = 2;

struct State {
    /// Bucket buffers allocated now (reduce-scatter mode).
    buffers: usize,
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
    /// Buckets laid out by rows (ZeRO-1/2 of whole parameters' rows), if they are.
    rows: Option<RowLayout>,
    mode: Mode,
    /// The dtype buckets travel and are summed in (f32, or rounded to bf16/f16).
    wire: Precision,
    /// Per bucket: its chunk length (`ceil(len / size)`) and the chunk's offset in the shard.
    chunks: Vec<usize>,
    chunk_offsets: Vec<usize>,
    /// This rank's gradient shard (reduce-scatter mode; allocated at the first reduction).
    shard: Mutex<Vec<f32>>,
    /// Gradient bytes held (buckets and shard) now, and at most since the step began.
    held: Mutex<(usize, usize)>,
    /// Per parameter: element count.
    numels: Vec<usize>,
    buckets: Vec<BucketPlan>,
    location: Vec<(usize, usize)>,
    data: Vec<Mutex<Vec<f32>>>,
    state: Mutex<State>,
    changed: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn add(&self, param: usize, values: &[f32]) {
        let (b, offset) = self.location[param];
        if self.mode == Mode::ReduceScatter && lock(&self.data[b]).is_empty() {
            self.wait_for_room();
        }
        {
            let mut data = lock(&self.data[b]);
            if data.is_empty() {
                // Freed after its last reduction: allocate again (padded to whole chunks).
                let len = self.chunks[b] * self.chunk_rank_size().1;
                data.resize(len, 0.0);
                self.hold(len * 4);
                if self.mode == Mode::ReduceScatter {
                    lock(&self.state).buffers += 1;
                }
            }
            match &self.rows {
                None => {
                    for (acc, v) in data[offset..offset + values.len()].iter_mut().zip(values) {
                        *acc += v;
                    }
                }
                Some(rows) => {
                    // Each rank's rows go to that rank's chunk of the bucket.
                    let (n_rows, row_len) = rows.split.shapes[param];
                    let chunk_rows = rows.cuts[param].0;
                    let chunk = self.chunks[b];
                    for r in 0..rows.split.group.size() {
                        let start = (r * chunk_rows).min(n_rows);
                        let end = (start + chunk_rows).min(n_rows);
                        let src = &values[start * row_len..end * row_len];
                        let dst = r * chunk + offset;
                        for (acc, v) in data[dst..dst + src.len()].iter_mut().zip(src) {
                            *acc += v;
                        }
                    }
                }
            }
        }
        let mut st = lock(&self.state);
        self.mark(&mut st, param);
    }

    /// Backpressure for reduce-scatter mode: before another bucket buffer is allocated, waits
    /// while [`MAX_BUFFERS_IN_FLIGHT`] are allocated and the communication thread can make
    /// progress without this thread (its next bucket is complete). Waiting only then cannot
    /// deadlock when backward fills buckets out of order.
    fn wait_for_room(&self) {
        let mut st = lock(&self.state);
        while st.buffers >= MAX_BUFFERS_IN_FLIGHT
            && st.next < self.buckets.len()
            && st.ready[st.next]
            && st.error.is_none()
            && !st.shutdown
        {
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Counts `bytes` more gradient held.
    fn hold(&self, bytes: usize) {
        let mut held = lock(&self.held);
        held.0 += bytes;
        held.1 = held.1.max(held.0);
    }

    /// Counts `bytes` of gradient released.
    fn release(&self, bytes: usize) {
        lock(&self.held).0 -= bytes;
    }

    fn mark(&self, st: &mut State, param: usize) {
        if st.arrived[param] {
            return;
        }
        st.arrived[param] = true;
        st.arrivals.push(param);
        let b = self.location[param].0;
        st.pending[b] -= 1;
        if st.pending[b] == 0 && st.launch {
            st.ready[b] = true;
            self.changed.notify_all();
        }
    }
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
    /// Per parameter: rows per rank and where its rows start in a rank's chunk of its bucket.
    cuts: Vec<(usize, usize)>,
}

impl Shared {
    /// The rank and size of the group a bucket's chunks are cut over.
    fn chunk_rank_size(&self) -> (usize, usize) {
        match &self.rows {
            Some(rows) => (rows.split.group.rank(), rows.split.group.size()),
            None => (self.group.rank(), self.group.size()),
        }
    }
}

/// What the reducer measured in one step.
#[derive(Debug, Clone, Default)]
pub(crate) struct Spans {
    /// (start, end) of each bucket's all-reduce, in bucket order.
    pub spans: Vec<(Instant, Instant)>,
}

/// Owns the buffers and the communication thread of one rank.
pub(crate) struct Reducer {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl Reducer {
    /// A reducer over `group` for parameters of `numels` elements, bucketed in `order`, that
    /// all-reduces whole buckets (`mode` all-reduce) or reduce-scatters them, its buckets laid
    /// out by `rows` (see [`RowSplit`]) when given: all-reduce then keep this rank's rows
    /// (ZeRO-1) or reduce-scatter them (ZeRO-2).
    pub(crate) fn new(
        group: Group,
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
            let n = split.group.size();
            let mut cuts = vec![(0, 0); numels.len()];
            for (b, bucket) in buckets.iter().enumerate() {
                let mut at = 0;
                for &p in &bucket.params {
                    let (n_rows, row_len) = split.shapes[p];
                    let chunk_rows = n_rows.div_ceil(n);
                    cuts[p] = (chunk_rows, at);
                    location[p] = (b, at);
                    at += chunk_rows * row_len;
                }
                chunks[b] = at;
            }
            RowLayout { split, cuts }
        });
        let chunk_offsets = chunks
            .iter()
            .scan(0, |acc, &c| {
                let o = *acc;
                *acc += c;
                Some(o)
            })
            .collect();
        // Buffers are allocated at a bucket's first gradient of the step and freed once its
        // sums are handed over, so between steps the reducer holds nothing.
        let shared = Arc::new(Shared {
            group,
            rows,
            mode,
            wire,
            chunk_offsets,
            shard: Mutex::new(vec![]),
            held: Mutex::new((0, 0)),
            numels: numels.to_vec(),
            data: buckets.iter().map(|_| Mutex::new(vec![])).collect(),
            chunks,
            state: Mutex::new(State {
                buffers: 0,
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
            .spawn(move || worker_loop(&worker_shared))
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
        let (chunk_rows, _) = rows.cuts[param];
        let row_len = rows.split.shapes[param].1;
        Some((s.chunk_offsets[b] + at, chunk_rows * row_len))
    }

    /// Elements of this rank's gradient shard (reduce-scatter mode).
    pub(crate) fn shard_len(&self) -> usize {
        self.shared.chunks.iter().sum()
    }

    /// Parameters in the order their gradients arrived in the last micro-batch.
    pub(crate) fn arrival_order(&self) -> Vec<usize> {
        lock(&self.shared.state).arrivals.clone()
    }

    /// Gradient bytes held now, and the most held at once since the step began.
    pub(crate) fn held_bytes(&self) -> (usize, usize) {
        *lock(&self.shared.held)
    }

    /// Starts a step: zeroes the buffers; the worker waits for the first bucket.
    pub(crate) fn begin_step(&self) {
        for d in &self.shared.data {
            lock(d).iter_mut().for_each(|x| *x = 0.0);
        }
        {
            let mut held = lock(&self.shared.held);
            held.1 = held.0;
        }
        let mut st = lock(&self.shared.state);
        st.next = 0;
        st.ready.iter_mut().for_each(|r| *r = false);
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

    /// Adds a gradient of parameter `param` into its bucket and marks it final for this
    /// micro-batch.
    pub(crate) fn add(&self, param: usize, values: &[f32]) {
        self.shared.add(param, values);
    }

    /// A callback for gradient hooks: adds the gradient of parameter `param` during backward.
    pub(crate) fn callback(&self, param: usize) -> GradCallback {
        let shared = self.shared.clone();
        GradCallback(Arc::new(move |values: &[f32]| shared.add(param, values)))
    }

    /// Which parameters have reported this micro-batch.
    pub(crate) fn arrived(&self) -> Vec<bool> {
        lock(&self.shared.state).arrived.clone()
    }

    /// Waits until every bucket of the current micro-batch is reduced (reduce-scatter mode
    /// adds chunks into the shard; the buffers may then be reused).
    pub(crate) fn wait_reduced(&self) -> Result<Spans, CommError> {
        let mut st = lock(&self.shared.state);
        while st.next < self.shared.buckets.len() && st.error.is_none() {
            st = self
                .shared
                .changed
                .wait(st)
                .unwrap_or_else(|e| e.into_inner());
        }
        if let Some(e) = st.error.take() {
            return Err(e);
        }
        Ok(Spans {
            spans: st.spans.clone(),
        })
    }

    /// Waits until every bucket is reduced and hands over this rank's gradient shard (chunk `r`
    /// of every bucket, in bucket order). ZeRO modes only; their bucket buffers are freed.
    pub(crate) fn wait_shard(&self) -> Result<(Vec<f32>, Spans), CommError> {
        let spans = self.wait_reduced()?;
        let s = &self.shared;
        let shard = match s.mode {
            Mode::ReduceScatter => std::mem::take(&mut *lock(&s.shard)),
            Mode::AllReduceShard => {
                let rank = s.chunk_rank_size().0;
                // Filled bucket by bucket while each bucket is freed: the peak stays near one
                // whole gradient, not a gradient plus a shard.
                let mut shard = Vec::with_capacity(self.shard_len());
                for (b, data) in s.data.iter().enumerate() {
                    let full = std::mem::take(&mut *lock(data));
                    let c = s.chunks[b];
                    let chunk = full.get(rank * c..(rank + 1) * c).unwrap_or(&[]);
                    shard.extend_from_slice(chunk);
                    shard.resize(s.chunk_offsets[b] + c, 0.0);
                    s.hold(c * 4);
                    s.release(full.len() * 4);
                }
                shard
            }
            Mode::AllReduce => panic!("wait_shard needs a ZeRO reduction mode"),
        };
        // The shard now belongs to the caller, which accounts for it.
        s.release(shard.len() * 4);
        Ok((shard, spans))
    }

    /// Every parameter's reduced gradient, in layout order, each bucket freed as soon as its
    /// last parameter is copied out (all-reduce modes, after [`Reducer::wait_reduced`]): the
    /// peak stays near one gradient plus one bucket.
    pub(crate) fn drain(&self) -> Vec<Vec<f32>> {
        let s = &self.shared;
        let last: Vec<usize> = s
            .buckets
            .iter()
            .map(|b| b.params.iter().copied().max().unwrap_or(0))
            .collect();
        let mut out = Vec::with_capacity(s.numels.len());
        for (p, &n) in s.numels.iter().enumerate() {
            let (b, off) = s.location[p];
            let mut data = lock(&s.data[b]);
            let values = match data.get(off..off + n) {
                Some(values) => values.to_vec(),
                None => vec![0.0; n],
            };
            s.hold(n * 4);
            if last[b] == p {
                let freed = std::mem::take(&mut *data);
                s.release(freed.len() * 4);
            }
            out.push(values);
        }
        // The copies now belong to the caller.
        s.release(out.iter().map(|v| v.len() * 4).sum());
        out
    }
}

fn worker_loop(shared: &Shared) {
    loop {
        let b = {
            let mut st = lock(&shared.state);
            loop {
                if st.shutdown {
                    return;
                }
                if st.next < shared.buckets.len() && st.ready[st.next] && st.error.is_none() {
                    break st.next;
                }
                st = shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        };
        let t0 = Instant::now();
        // A panic here (a bug, or an injected fault) must reach the training thread as an
        // error: it is waiting for this bucket and would otherwise wait forever.
        let result =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| reduce_bucket(shared, b)))
                .unwrap_or_else(|payload| {
                    Err(CommError::from_panic(
                        "ddp",
                        "gradient communication thread",
                        &*payload,
                    ))
                });
        let t1 = Instant::now();
        let mut st = lock(&shared.state);
        st.spans.push((t0, t1));
        match result {
            Ok(()) => st.next += 1,
            Err(e) => {
                st.error = Some(e);
                st.next = shared.buckets.len();
            }
        }
        shared.changed.notify_all();
    }
}

/// Reduces bucket `b`: in place (all-reduce), or into this rank's shard, freeing the buffer
/// (reduce-scatter).
fn reduce_bucket(shared: &Shared, b: usize) -> Result<(), CommError> {
    let mut data = lock(&shared.data[b]);
    match shared.mode {
        Mode::AllReduce | Mode::AllReduceShard => {
            all_reduce_in(&shared.group, &mut data, shared.wire)
        }
        Mode::ReduceScatter => {
            let full = std::mem::take(&mut *data);
            drop(data);
            let mut chunk = vec![0.0f32; shared.chunks[b]];
            match &shared.rows {
                None => reduce_scatter_in(&shared.group, &full, &mut chunk, shared.wire)?,
                Some(rows) => {
                    reduce_scatter_in(&rows.split.group, &full, &mut chunk, shared.wire)?;
                    if let Some(rest) = &rows.split.rest {
                        all_reduce_in(rest, &mut chunk, shared.wire)?;
                    }
                }
            }
            shared.release(full.len() * 4);
            drop(full);
            lock(&shared.state).buffers -= 1;
            let at = shared.chunk_offsets[b];
            let mut shard = lock(&shared.shard);
            if shard.is_empty() {
                let len: usize = shared.chunks.iter().sum();
                shard.resize(len, 0.0);
                shared.hold(len * 4);
            }
            for (acc, g) in shard[at..at + chunk.len()].iter_mut().zip(&chunk) {
                *acc += g;
            }
            Ok(())
        }
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
