//! The shared side of the reducer: gradients added per parameter as hooks hand them over,
//! buckets laid out when complete, and the communication thread that reduces them strictly
//! in bucket order.

use super::{MAX_BUFFERS_IN_FLIGHT, Mode, Shared, State, bytes, lock};
use crate::params::part;
use burn::tensor::{DType, Tensor};
use flashover_comm::{CommError, ReduceOp};
use flashover_runtime::TensorCollectives;
use std::sync::Mutex;
use std::time::Instant;

impl Shared {
    pub(super) fn add(&self, param: usize, grad: Tensor<1>) {
        let b = self.location[param].0;
        if self.mode == Mode::ReduceScatter && !lock(&self.state).open[b] {
            self.wait_for_room();
            lock(&self.state).open[b] = true;
        }
        // The zero a hook reports after its gradient was handed later is not added.
        let owed = std::mem::take(&mut lock(&self.later[param]).zero_owed);
        if !owed {
            self.sum_into(&self.grads[param], grad.cast(DType::F32));
        }
        let mut st = lock(&self.state);
        self.mark(&mut st, param);
    }

    /// Marks parameter `param` final for this micro-batch without a gradient (it got none).
    pub(super) fn mark_absent(&self, param: usize) {
        let mut st = lock(&self.state);
        self.mark(&mut st, param);
    }

    /// Backpressure for reduce-scatter mode: before another bucket starts holding gradients,
    /// waits while [`MAX_BUFFERS_IN_FLIGHT`] do and the communication thread can make progress
    /// without this thread (its next bucket is complete). Waiting only then cannot deadlock
    /// when backward fills buckets out of order.
    pub(super) fn wait_for_room(&self) {
        let mut st = lock(&self.state);
        while st.open.iter().filter(|&&open| open).count() >= MAX_BUFFERS_IN_FLIGHT
            && st.next < self.buckets.len()
            && st.ready[st.next]
            && st.error.is_none()
            && !st.shutdown
        {
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Adds `value` into `slot` (taking it as the sum when the slot is empty, counted as held).
    pub(super) fn sum_into(&self, slot: &Mutex<Option<Tensor<1>>>, value: Tensor<1>) {
        let mut slot = lock(slot);
        *slot = Some(match slot.take() {
            Some(sum) => sum + value,
            None => {
                self.hold(bytes(&value));
                value
            }
        });
    }

    /// Counts `bytes` more gradient held.
    pub(super) fn hold(&self, bytes: usize) {
        let mut held = lock(&self.held);
        held.0 += bytes;
        held.1 = held.1.max(held.0);
    }

    /// Counts `bytes` of gradient released.
    pub(super) fn release(&self, bytes: usize) {
        let mut held = lock(&self.held);
        held.0 = held.0.saturating_sub(bytes);
    }

    pub(super) fn mark(&self, st: &mut State, param: usize) {
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

    pub(super) fn zeros(&self, len: usize) -> Tensor<1> {
        Tensor::zeros([len], &self.device)
    }

    /// Parameter `param`'s gradient, taken: what was added, and the rows handed later, waited
    /// for now (on the communication thread).
    pub(super) fn take_grad(&self, param: usize) -> Result<Option<Tensor<1>>, CommError> {
        let mut grad = lock(&self.grads[param]).take();
        let handed = std::mem::take(&mut *lock(&self.later[param]));
        for later in handed.grads {
            let rows = later.rows.get()?.narrow(0, later.start, later.len);
            let rows = rows.to_device(&self.device).cast(DType::F32);
            self.hold(bytes(&rows));
            grad = Some(match grad {
                Some(sum) => sum + rows,
                None => rows,
            });
        }
        Ok(grad)
    }

    /// Bucket `b` as one tensor, its parameters' gradients taken (zeros for those without
    /// one): end to end, padded to whole chunks, or rank-major by rows under rows. Fails when
    /// a reduce-scatter whose rows were handed to it failed.
    pub(super) fn assemble(&self, b: usize) -> Result<Tensor<1>, CommError> {
        let params = &self.buckets[b].params;
        let grads: Vec<Option<Tensor<1>>> = params
            .iter()
            .map(|&p| self.take_grad(p))
            .collect::<Result<_, _>>()?;
        self.release(grads.iter().flatten().map(bytes).sum());
        let (_, size) = self.chunk_rank_size();
        let total = self.chunks[b] * size;
        let mut pieces = vec![];
        match &self.rows {
            None => {
                for (&p, grad) in params.iter().zip(grads) {
                    pieces.push(grad.unwrap_or_else(|| self.zeros(self.numels[p])));
                }
                let len = self.buckets[b].len;
                if total > len {
                    pieces.push(self.zeros(total - len));
                }
            }
            Some(rows) => {
                let values = (params.iter().zip(grads))
                    .map(|(&p, grad)| grad.unwrap_or_else(|| self.zeros(self.numels[p])));
                pieces.push(rows.shards[b].rank_major_of(values.collect(), &self.device));
            }
        }
        let bucket = match pieces.is_empty() {
            true => self.zeros(total),
            false => Tensor::cat(pieces, 0),
        };
        self.hold(bytes(&bucket));
        Ok(bucket)
    }
}

impl Shared {
    /// The rank and size of the group a bucket's chunks are cut over.
    pub(super) fn chunk_rank_size(&self) -> (usize, usize) {
        match &self.rows {
            Some(rows) => (rows.split.group.rank(), rows.split.group.size()),
            None => (self.group.rank(), self.group.size()),
        }
    }
}

pub(super) fn worker_loop(shared: &Shared) {
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

/// Reduces bucket `b` in the wire dtype: whole (all-reduce), or into this rank's chunk of the
/// shard (all-reduce then shard, reduce-scatter).
fn reduce_bucket(shared: &Shared, b: usize) -> Result<(), CommError> {
    let bucket = shared.assemble(b)?;
    let full = bytes(&bucket);
    let wire = bucket.cast(shared.wire.float_dtype());
    let chunk = match shared.mode {
        Mode::AllReduce => {
            let sum = shared.group.all_reduce_tensor(wire, ReduceOp::Sum)?;
            *lock(&shared.reduced[b]) = Some(sum.cast(DType::F32));
            return Ok(());
        }
        Mode::AllReduceShard => {
            let sum = shared.group.all_reduce_tensor(wire, ReduceOp::Sum)?;
            let c = shared.chunks[b];
            part(&sum, shared.chunk_rank_size().0 * c, c)
        }
        Mode::ReduceScatter => match &shared.rows {
            None => shared.group.reduce_scatter_tensor(wire, 0, ReduceOp::Sum)?,
            Some(rows) => {
                let chunk = rows
                    .split
                    .group
                    .reduce_scatter_tensor(wire, 0, ReduceOp::Sum)?;
                match &rows.split.rest {
                    Some(rest) => rest.all_reduce_tensor(chunk, ReduceOp::Sum)?,
                    None => chunk,
                }
            }
        },
    };
    shared.release(full);
    lock(&shared.state).open[b] = false;
    shared.sum_into(&shared.shard[b], chunk.cast(DType::F32));
    Ok(())
}
