//! The bucketed gradient reducer behind DDP: per-bucket host buffers that gradients are added
//! into (from hooks during backward, or after it), and a per-rank communication thread that
//! all-reduces buckets strictly in bucket order as soon as each is complete, so every rank
//! issues the same collectives in the same order while backward goes on.

use crate::hook::GradCallback;
use flashover_comm::{CommError, CommunicatorExt, Group, ReduceOp};
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

/// Splits parameters into buckets of about `bucket_elems` elements, in reverse layout order
/// (backward produces the last layers' gradients first). Every bucket holds at least one
/// parameter. Returns the buckets and, per parameter, (bucket, offset in bucket).
pub(crate) fn plan_buckets(
    numels: &[usize],
    bucket_elems: usize,
) -> (Vec<BucketPlan>, Vec<(usize, usize)>) {
    let mut buckets: Vec<BucketPlan> = vec![];
    let mut location = vec![(0, 0); numels.len()];
    for p in (0..numels.len()).rev() {
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

struct State {
    last_micro: bool,
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
    /// Per parameter: offset in the flat layout and element count.
    offsets: Vec<usize>,
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
        {
            let mut data = lock(&self.data[b]);
            for (acc, v) in data[offset..offset + values.len()].iter_mut().zip(values) {
                *acc += v;
            }
        }
        let mut st = lock(&self.state);
        self.mark(&mut st, param);
    }

    fn mark(&self, st: &mut State, param: usize) {
        if st.arrived[param] {
            return;
        }
        st.arrived[param] = true;
        let b = self.location[param].0;
        st.pending[b] -= 1;
        if st.pending[b] == 0 && st.last_micro {
            st.ready[b] = true;
            self.changed.notify_all();
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
    pub(crate) fn new(group: Group, numels: &[usize], bucket_elems: usize) -> Self {
        let (buckets, location) = plan_buckets(numels, bucket_elems);
        let offsets = numels.iter().scan(0, |acc, &n| {
            let o = *acc;
            *acc += n;
            Some(o)
        });
        let shared = Arc::new(Shared {
            group,
            offsets: offsets.collect(),
            numels: numels.to_vec(),
            data: buckets
                .iter()
                .map(|b| Mutex::new(vec![0.0; b.len]))
                .collect(),
            state: Mutex::new(State {
                last_micro: false,
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

    /// Starts a step: zeroes the buffers; the worker waits for the first bucket.
    pub(crate) fn begin_step(&self) {
        for d in &self.shared.data {
            lock(d).iter_mut().for_each(|x| *x = 0.0);
        }
        let mut st = lock(&self.shared.state);
        st.next = 0;
        st.ready.iter_mut().for_each(|r| *r = false);
        st.spans.clear();
        st.error = None;
    }

    /// Starts a micro-batch; on the last one, complete buckets are reduced at once.
    pub(crate) fn begin_micro(&self, last: bool) {
        let mut st = lock(&self.shared.state);
        st.last_micro = last;
        st.arrived.iter_mut().for_each(|a| *a = false);
        st.pending = self.shared.buckets.iter().map(|b| b.params.len()).collect();
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

    /// Adds `flat` (a whole-model gradient in layout order, zero where absent) for the
    /// parameters that have not reported, and marks every parameter final.
    pub(crate) fn add_remaining(&self, flat: &[f32]) {
        let arrived = self.arrived();
        let (offsets, numels) = (&self.shared.offsets, &self.shared.numels);
        for p in (0..arrived.len()).rev() {
            if !arrived[p] {
                self.add(p, &flat[offsets[p]..offsets[p] + numels[p]]);
            }
        }
    }

    /// Waits until every bucket is reduced; copies the sums into `flat` (layout order).
    pub(crate) fn wait(&self, flat: &mut [f32]) -> Result<Spans, CommError> {
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
        let spans = Spans {
            spans: st.spans.clone(),
        };
        drop(st);
        for (b, plan) in self.shared.buckets.iter().enumerate() {
            let data = lock(&self.shared.data[b]);
            for &p in &plan.params {
                let (off, n) = (self.shared.location[p].1, self.shared.numels[p]);
                let start = self.shared.offsets[p];
                flat[start..start + n].copy_from_slice(&data[off..off + n]);
            }
        }
        Ok(spans)
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
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut data = lock(&shared.data[b]);
            shared.group.all_reduce(&mut data, ReduceOp::Sum)
        }))
        .unwrap_or_else(|payload| {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into());
            Err(CommError::Engine {
                engine: "ddp",
                detail: format!("gradient communication thread panicked: {message}"),
            })
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
        let (buckets, loc) = plan_buckets(&[10, 5, 20, 3, 8], 16);
        let order: Vec<Vec<usize>> = buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(order, vec![vec![4, 3], vec![2], vec![1, 0]]);
        assert_eq!(loc[3], (0, 8));
        assert_eq!(loc[0], (2, 5));
        assert_eq!(buckets.iter().map(|b| b.len).sum::<usize>(), 46);
    }
}
