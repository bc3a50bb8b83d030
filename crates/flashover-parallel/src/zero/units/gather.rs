//! One unit's all-gather, the ops its parameters' reads take their values from, and its
//! backward, which reduce-scatters the unit's gradient (FSDP's unit gather and its
//! reduce-scatter). Under Burn's balanced gradient checkpointing the unit is gathered again
//! for its backward ([`Regather`]).

use super::{DeferredScatter, LAYER_INPUT, UnitGathers, UnitShards, lock};
use crate::collective_op::{
    TensorFn, collective_pair, collective_pair_after, computed, ok, regathered_pair, tensor_fn,
};
use crate::data_parallel::{LaterGrad, LaterHandle};
use crate::recompute::{self, depth};
use crate::zero::{Pending, ShardGroup};
use burn::tensor::{DType, FloatDType, GradientCheckpointingStrategy, Tensor};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// One forward's units that gather again in backward, in the order it gathered them.
pub(super) type RegatherOrder = Mutex<Vec<std::sync::Weak<Regather>>>;

/// A unit's values gathered again for backward (under balanced checkpointing), from the
/// shards its forward read.
#[derive(Debug)]
pub(super) struct Regather {
    comm: Arc<ShardGroup>,
    /// The unit's stored rows, as the forward read them.
    stored: Tensor<1>,
    ranks: usize,
    total: usize,
    bytes: usize,
    state: Mutex<Regathered>,
    /// Its forward's units in order: the next to prefetch is the latest not gathered again.
    order: Arc<RegatherOrder>,
    /// Its reads gathered again in backward that have not taken their values yet: at 0 the
    /// gathered values go (each read's own rows stay in Burn's backward states until used).
    reads: std::sync::atomic::AtomicUsize,
}

/// Where a unit's second all-gather stands.
#[derive(Debug)]
enum Regathered {
    /// Not asked for yet.
    No,
    /// Submitted ahead (prefetched by the unit backward reached before it).
    Pending(Pending),
    /// Gathered, `[ranks, total]`: every backward op that needs a value of the unit reads it.
    Ready(Box<Tensor<2>>),
    /// Every read took its rows: the gathered values are gone.
    Spent,
    /// Its reduce-scatter ran: the unit's backward is over.
    Done,
}

impl Regather {
    /// The unit's gathered values, `[ranks, total]`: gathered now, or the prefetch taken,
    /// once; the first time, the all-gather of the unit its forward gathered last before the
    /// ones gathered again already is submitted (FSDP2's backward prefetch).
    fn values(&self) -> Tensor<2> {
        let mut state = lock(&self.state);
        if let Regathered::Ready(full) = &*state {
            return (**full).clone();
        }
        let pending = match std::mem::replace(&mut *state, Regathered::No) {
            Regathered::Pending(pending) => pending,
            _ => {
                self.comm.stats().gathered(self.bytes, false);
                self.comm.all_gather(self.stored.clone())
            }
        };
        let (full, waited) = pending.wait_timed();
        self.comm.stats().waited(waited);
        let full = ok(full).reshape([self.ranks, self.total]);
        *state = Regathered::Ready(Box::new(full.clone()));
        drop(state);
        self.prefetch_next();
        full
    }

    /// Submits the all-gather of the latest unit of this forward not gathered again yet.
    fn prefetch_next(&self) {
        let order = lock(&self.order);
        for unit in order.iter().rev().filter_map(std::sync::Weak::upgrade) {
            if std::ptr::eq(Arc::as_ptr(&unit), self) {
                continue;
            }
            let mut state = lock(&unit.state);
            if matches!(*state, Regathered::No) {
                unit.comm.stats().gathered(unit.bytes, true);
                *state = Regathered::Pending(unit.comm.all_gather(unit.stored.clone()));
                return;
            }
        }
    }

    /// `len` rows at `offset` of every rank (a read's values), gathered again; the unit's
    /// gathered values go once its last read took its rows.
    fn rows(&self, offset: usize, len: usize) -> Tensor<1> {
        let rows = param_rows(&self.values(), offset, len);
        if self.reads.fetch_sub(1, Ordering::AcqRel) == 1 {
            let mut state = lock(&self.state);
            if matches!(*state, Regathered::Ready(_)) {
                *state = Regathered::Spent;
                self.comm.stats().released(self.bytes);
            }
        }
        rows
    }

    /// Ends the unit's backward; whether gathered values are still held for it (to release).
    fn finish(&self) -> bool {
        let was = std::mem::replace(&mut *lock(&self.state), Regathered::Done);
        matches!(was, Regathered::Ready(_) | Regathered::Pending(_))
    }
}

/// Per parameter of a unit (its order), the gradient its reads' backwards summed so far.
type UnitGrad = Arc<Mutex<Vec<Option<Tensor<1>>>>>;

/// One all-gather of a unit: its parameters and the sizes its collectives move.
#[derive(Clone)]
struct UnitGather {
    comm: Arc<ShardGroup>,
    /// The parameters' paths, in the unit's order.
    names: Vec<String>,
    /// Each parameter's stored length (its rows on this rank), in the same order.
    lens: Vec<usize>,
    /// Their sum: the unit's shard.
    total: usize,
    ranks: usize,
    /// What the gathered unit holds, in bytes (f32).
    bytes: usize,
}

impl UnitGather {
    /// The unit `names` whose shards are `tensors`, gathered over `comm`.
    fn new(comm: Arc<ShardGroup>, names: Vec<String>, tensors: &[Tensor<1>]) -> Self {
        let lens: Vec<usize> = tensors.iter().map(|t| t.dims()[0]).collect();
        let total: usize = lens.iter().sum();
        let ranks = comm.group().size();
        UnitGather {
            comm,
            names,
            lens,
            total,
            ranks,
            bytes: total * ranks * 4,
        }
    }

    /// The unit gathered, `[ranks, total]`: the all-gather submitted ahead (`prefetched`), or
    /// one submitted now.
    fn all_gather(&self, shard: &Tensor<1>, prefetched: Option<Pending>) -> Tensor<2> {
        let pending = prefetched.unwrap_or_else(|| {
            self.comm.stats().gathered(self.bytes, false);
            self.comm.all_gather(shard.clone().inner())
        });
        let (full, waited) = pending.wait_timed();
        self.comm.stats().waited(waited);
        ok(full).reshape([self.ranks, self.total])
    }

    /// A gather no backward will release (an untracked shard): its bytes go when the
    /// recomputation that gathered them ends, or now.
    fn release_without_backward(&self) {
        let (comm, bytes) = (self.comm.clone(), self.bytes);
        let release = Box::new(move |_depth: usize| comm.stats().released(bytes));
        if let Err(now) = recompute::on_leave(release) {
            now(0);
        }
    }
}

impl UnitGathers {
    /// [`Self::gather`], taking the all-gather's result from `prefetched` when it was
    /// submitted ahead.
    pub(super) fn gather_unit(
        &self,
        shards: UnitShards,
        prefetched: Option<Pending>,
    ) -> Option<Tensor<1>> {
        if shards.is_empty() {
            return None;
        }
        let comm = self
            .comm()
            .expect("parallelize sets the fsdp communication thread of sharded parameters")
            .clone();
        let (names, tensors): (Vec<String>, Vec<Tensor<1>>) = shards.into_iter().unzip();
        let unit = UnitGather::new(comm, names, &tensors);
        let shard = Tensor::cat(tensors, 0);
        let full = unit.all_gather(&shard, prefetched);
        let dtype = shard.dtype();
        let regathered = self.regather_for_backward(&unit, &shard);
        if !shard.is_tracked() {
            unit.release_without_backward();
        }
        // Two kinds of op, so that backward moves each gradient once: every read of a
        // parameter is its own op, whose backward adds the parameter's gradient to the unit's
        // (one slot per parameter); all of them take the output of one op on the unit's shard,
        // whose backward runs after theirs (autodiff orders nodes by depth) and reduce-scatters
        // the unit's gradient into the shard's. That output is a one-element token, so what
        // the reads hand it back in backward is one zero each, not a shard of zeros.
        let unit_grad: UnitGrad = Arc::new(Mutex::new(vec![None; unit.lens.len()]));
        let reduce_scatter = self.unit_backward(&unit, unit_grad.clone(), regathered.clone());
        let token = Tensor::<1>::zeros([1], &shard.device()).cast(dtype);
        let input = LAYER_INPUT
            .with(|i| i.borrow().clone())
            .filter(|_| depth() == 0);
        let linked = match input {
            Some(input) => collective_pair_after(shard, input, computed(token), reduce_scatter),
            None => collective_pair(shard, computed(token), reduce_scatter),
        };
        self.record_reads(
            &unit,
            &full,
            &linked,
            dtype,
            &unit_grad,
            regathered.as_ref(),
        );
        Some(linked)
    }

    /// Under Burn's balanced gradient checkpointing the reads are memory bound: no backward
    /// state keeps them, so the gathered values go with the unit's forward, and the backward
    /// ops that need a parameter's value gather the unit again (FSDP2's reshard after
    /// forward, without recomputing the unit): that second gather. Not inside a
    /// recomputation, which gathers for its backward anyway.
    fn regather_for_backward(&self, unit: &UnitGather, shard: &Tensor<1>) -> Option<Arc<Regather>> {
        let regathers = shard.is_tracked()
            && depth() == 0
            && shard.device().gradient_checkpointing_strategy()
                == Some(GradientCheckpointingStrategy::Balanced);
        regathers.then(|| {
            unit.comm.stats().released(unit.bytes);
            let order = lock(&self.0.regather_order).clone();
            let regather = Arc::new(Regather {
                comm: unit.comm.clone(),
                stored: shard.clone().inner(),
                ranks: unit.ranks,
                total: unit.total,
                bytes: unit.bytes,
                state: Mutex::new(Regathered::No),
                order: order.clone(),
                reads: Default::default(),
            });
            lock(&order).push(Arc::downgrade(&regather));
            regather
        })
    }

    /// The backward of the unit's shard, after every read's: the values gathered for the reads
    /// (in forward, or `again` for backward) go, and the unit's gradient (`grads`, rank by rank)
    /// is reduce-scattered into the shard's. Where a step hands gradients on (to buckets) or
    /// defers them, the rows go there and the shard's own gradient is zero.
    ///
    /// Runs inside Burn's backward, which cannot return errors: a failed collective panics
    /// with the `CommError` as payload, which the launcher reports like a returned error.
    fn unit_backward(
        &self,
        unit: &UnitGather,
        grads: UnitGrad,
        again: Option<Arc<Regather>>,
    ) -> TensorFn {
        let (unit, state) = (unit.clone(), self.0.clone());
        tensor_fn::<1>(move |token_grad| {
            if again.as_ref().is_none_or(|again| again.finish()) {
                unit.comm.stats().released(unit.bytes);
            }
            let grads = std::mem::take(&mut *lock(&grads));
            let device = token_grad.device();
            let full = rank_major(grads, &unit.lens, unit.ranks, &device);
            let pending = unit.comm.reduce_scatter(full);
            let handles: Option<Vec<LaterHandle>> = (lock(&state.handed).as_ref())
                .and_then(|buckets| unit.names.iter().map(|n| buckets.get(n).cloned()).collect());
            if let Some(handles) = handles {
                let rows = Arc::new(pending.shared());
                let mut start = 0;
                for (handle, &len) in handles.iter().zip(&unit.lens) {
                    let rows = rows.clone();
                    handle.hand(LaterGrad { rows, start, len });
                    start += len;
                }
                // The shard's hook reports it final with this zero gradient, after the above.
                return Tensor::zeros([unit.total], &device);
            }
            if let Some(deferred) = lock(&state.deferred).as_mut() {
                deferred.push(DeferredScatter {
                    names: unit.names.clone(),
                    lens: unit.lens.clone(),
                    rows: pending,
                });
                // The rows arrive with `add_deferred`; the shard's own gradient is none.
                return Tensor::zeros([unit.total], &device);
            }
            let (rows, waited) = pending.wait_timed();
            unit.comm.stats().waited(waited);
            ok(rows)
        })
    }

    /// Each parameter's read of the gathered unit `full`, kept for the forward's reads: an op
    /// on `linked` (the shard's token) whose value is the parameter's rows of every rank and
    /// whose backward adds the parameter's gradient to its slot of `grads`. Under `regathered`
    /// the backward ops that need the value take it from the unit gathered again (a vector
    /// parameter keeps its value: too small to matter).
    fn record_reads(
        &self,
        unit: &UnitGather,
        full: &Tensor<2>,
        linked: &Tensor<1>,
        dtype: DType,
        grads: &UnitGrad,
        regathered: Option<&Arc<Regather>>,
    ) {
        let mut map = lock(&self.0.gathered);
        let mut offset = 0;
        for (slot, (name, &len)) in unit.names.iter().zip(&unit.lens).enumerate() {
            let whole = param_rows(full, offset, len).cast(dtype);
            let add_to_unit = add_to_slot(grads.clone(), slot);
            let vector = self.0.vectors.get().is_some_and(|v| v.contains(name));
            let read = match regathered {
                Some(again) if !vector => {
                    // Once per backward for the whole unit, at the first read a backward op
                    // needs: the stored rows are the forward's (the optimizer steps after).
                    again.reads.fetch_add(1, Ordering::AcqRel);
                    let again = again.clone();
                    let regather = tensor_fn::<1>(move |_| again.rows(offset, len).cast(dtype));
                    regathered_pair(linked.clone(), computed(whole), add_to_unit, regather)
                }
                _ => collective_pair(linked.clone(), computed(whole), add_to_unit),
            };
            map.insert((depth(), name.clone()), read);
            offset += len;
        }
    }
}

/// A read's backward: adds its gradient (in f32) to slot `slot` of its unit's `grads`, and hands
/// the unit's token a zero.
fn add_to_slot(grads: UnitGrad, slot: usize) -> TensorFn {
    tensor_fn::<1>(move |grad| {
        let device = grad.device();
        let grad = grad.cast(FloatDType::F32);
        let mut unit = lock(&grads);
        unit[slot] = Some(match unit[slot].take() {
            Some(sum) => sum + grad,
            None => grad,
        });
        Tensor::zeros([1], &device)
    })
}

/// Parameter `offset..offset + len` of every rank's shard of a unit, gathered (`full`:
/// `[ranks, total]`, rank `r`'s shard in row `r`): the parameter's rows of every rank together,
/// in rank order, as a read wants them.
pub(super) fn param_rows(full: &Tensor<2>, offset: usize, len: usize) -> Tensor<1> {
    let ranks = full.dims()[0];
    full.clone().narrow(1, offset, len).reshape([ranks * len])
}

/// The inverse of [`param_rows`] for a unit's gradient: per parameter its gradient (`None`:
/// zero; each `ranks * lens[i]` long), laid out rank by rank (rank `r`'s rows of every
/// parameter together), which the reduce-scatter cuts into the ranks' shards.
fn rank_major(
    grads: Vec<Option<Tensor<1>>>,
    lens: &[usize],
    ranks: usize,
    device: &burn::tensor::Device,
) -> Tensor<1> {
    let blocks: Vec<Tensor<2>> = grads
        .into_iter()
        .zip(lens)
        .map(|(grad, &len)| match grad {
            Some(g) => g.reshape([ranks, len]),
            None => Tensor::zeros([ranks, len], device),
        })
        .collect();
    let total: usize = lens.iter().sum();
    Tensor::cat(blocks, 1).reshape([ranks * total])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathered_rows_reorder_by_parameter_and_back() {
        // Two ranks, parameters of 2 and 1 elements per rank: rank r holds [a_r0, a_r1, b_r].
        let device = burn::tensor::Device::flex();
        let full = Tensor::<2>::from_floats([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], &device);
        let a = param_rows(&full, 0, 2);
        let b = param_rows(&full, 2, 1);
        let values = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().unwrap();
        assert_eq!(values(a.clone()), [1.0, 2.0, 4.0, 5.0]);
        assert_eq!(values(b.clone()), [3.0, 6.0]);
        let back = rank_major(vec![Some(a), Some(b)], &[2, 1], 2, &device);
        assert_eq!(values(back), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let zeros = rank_major(
            vec![None, Some(Tensor::ones([2], &device))],
            &[2, 1],
            2,
            &device,
        );
        assert_eq!(values(zeros), [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]);
    }
}
