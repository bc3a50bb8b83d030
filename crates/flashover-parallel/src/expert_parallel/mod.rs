//! Expert parallelism over the `ep` mesh axis.
//!
//! **What is split:** the routed experts of every mixture-of-experts layer: rank `r` of the ep
//! group holds experts `r * E/ep .. (r + 1) * E/ep`. Everything else (attention, norms, router,
//! shared expert) is replicated, and every rank of the batch group (`dp x ep`) reads its own
//! slice of the batch, as in data parallelism.
//!
//! **Communication:** per layer, forward: the per-expert row counts (one small all-to-all), then
//! the routed token rows to the ranks that own their experts and the outputs back (two
//! variable all-to-alls); backward: the two all-to-alls again, reversed. An all-reduce cannot do
//! this: each token row must reach one particular rank, not every rank, and the rows each pair
//! of ranks exchanges differ in number and content (see `docs/expert_parallel.md`).
//!
//! **Gradients:** replicated parameters are averaged over the whole batch group, as in DDP.
//! An expert's gradient on its owner already sums the contributions of every ep rank's tokens
//! (they came back through the all-to-all's backward), so it is reduced over the `dp` replicas
//! of that expert only, then scaled like the rest. [`place_experts`] records that the experts
//! are owned over `ep`, and a plan's gradient buckets (by each entry's `reduce_axes`) do the rest.

mod combine_op;
mod moe_forward;
mod replicas;

use crate::placed::{ExpertSplit, SharedExpertState};
use crate::placement::PlacementTable;
use crate::precision::cast_params;
pub use moe_forward::MoeForward;
pub(crate) use replicas::Replicas;

use crate::collective_op::{collective_pair, ok, tensor_fn};
use crate::error::ParallelError;
use crate::moe::SwiGlu;
use crate::moe::{ExpertDispatch, Moe, Routing, run_experts};
use crate::tensor_util::index_tensor;
use burn::module::{Module, ParamId};
use burn::tensor::Tensor;
use flashover_comm::{CommunicatorExt, Group, control};
use flashover_runtime::Axis;
use flashover_runtime::TensorCollectives;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Per float parameter of `module`, in visiting order: whether it sits in the `experts` of a
/// [`Moe`] layer, wherever that layer is in the model and whatever its field is called.
pub fn expert_slots<M: Module>(module: &M) -> Vec<bool> {
    expert_paths(module, 0)
        .into_iter()
        .map(|(_, global)| global.is_some())
        .collect()
}

/// Records in `placements` that `module`'s routed experts (the `experts` of every [`Moe`]
/// layer, found by type) are this expert-parallel rank's own: each owned over `ep` and named by
/// its global index, `first` being the global index of this rank's first expert.
pub fn place_experts<M: Module>(
    placements: &mut PlacementTable,
    module: &M,
    first: usize,
) -> Result<(), ParallelError> {
    for (id, global) in expert_paths(module, first) {
        if let Some(name) = global {
            placements.own(id, Axis::Ep)?;
            placements.rename(id, name)?;
        }
    }
    Ok(())
}

/// Per float parameter of `module`, in visiting order: its id and, when it sits in the
/// `experts` of a [`Moe`] layer, its path with the expert's local index shifted by `first` (its
/// name in the whole model).
fn expert_paths<M: Module>(module: &M, first: usize) -> Vec<(ParamId, Option<String>)> {
    crate::moe::moe_params(module)
        .into_iter()
        .map(|param| (param.id, param.global_path(first)))
        .collect()
}

/// Rows the token all-to-alls sent to other ranks, forward and backward, counted by the sender
/// (rows a rank sends itself move no bytes between ranks and are not counted).
#[derive(Debug, Default)]
pub struct ExpertTraffic {
    /// Rows sent to other ranks.
    pub remote_rows: AtomicU64,
}

impl ExpertTraffic {
    /// Rows sent to other ranks so far; resets the counter.
    pub fn take(&self) -> u64 {
        self.remote_rows.swap(0, Ordering::Relaxed)
    }

    fn count(&self, rank: usize, rows: &[usize]) {
        let remote: usize = rows.iter().sum::<usize>() - rows[rank];
        self.remote_rows.fetch_add(remote as u64, Ordering::Relaxed);
    }
}

/// What the expert-parallel layers of one plan share: the rows their dispatches sent, and the
/// step's hot-expert copies (none without `replicate_hot_experts`).
struct Shared {
    traffic: Arc<ExpertTraffic>,
    replicas: Replicas,
}

/// The state a plan's expert-parallel layers share, for their routers' records
/// ([`ExpertSplit`]): their dispatches count into `traffic` and copy hot experts into
/// `replicas`.
pub(crate) fn share(traffic: Arc<ExpertTraffic>, replicas: Replicas) -> SharedExpertState {
    SharedExpertState(Arc::new(Shared { traffic, replicas }))
}

/// The ep group and which experts each of its ranks holds; the [`ExpertDispatch`] that sends
/// tokens to their experts' ranks.
#[derive(Debug, Clone)]
pub struct ExpertParallel {
    group: Group,
    n_experts: usize,
    traffic: Arc<ExpertTraffic>,
    replicas: Replicas,
}

impl ExpertParallel {
    /// `n_experts` experts spread evenly over `group`; fails unless the group size divides them.
    pub fn new(group: &Group, n_experts: usize) -> Result<Self, ParallelError> {
        if n_experts == 0 || !n_experts.is_multiple_of(group.size()) {
            return Err(ParallelError::Invalid(format!(
                "{n_experts} experts do not divide over the {} ranks of expert-parallel group `{}`",
                group.size(),
                group.name()
            )));
        }
        Ok(ExpertParallel {
            group: group.clone(),
            n_experts,
            traffic: Arc::default(),
            replicas: Replicas::default(),
        })
    }

    /// The dispatch of a layer a plan spread over `ep` (`split`, from its router's record):
    /// counting the rows it sends, and copying hot experts, into what the plan's layers share
    /// ([`share`]).
    pub(crate) fn placed(split: &ExpertSplit) -> Result<Self, ParallelError> {
        let shared = (split.shared.0.downcast_ref::<Shared>())
            .expect("an expert split's shared state is made by expert_parallel::share");
        Ok(ExpertParallel {
            traffic: shared.traffic.clone(),
            replicas: shared.replicas.clone(),
            ..Self::new(&split.group, split.n_experts)?
        })
    }

    /// The ep group.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// Experts per rank.
    pub fn per_rank(&self) -> usize {
        self.n_experts / self.group.size()
    }

    /// The global indices of the experts rank `rank` of the group holds.
    pub fn experts_of(&self, rank: usize) -> Range<usize> {
        rank * self.per_rank()..(rank + 1) * self.per_rank()
    }

    /// The rows this rank's token all-to-alls have sent.
    pub fn traffic(&self) -> &ExpertTraffic {
        &self.traffic
    }
}

/// Variable all-to-all of the rows of `x: [rows, d]`: `send[q]` consecutive rows to rank `q`;
/// returns the `recv[q]` rows from each rank `q`, in rank order. Backward sends the gradients
/// back the same way.
fn exchange_rows(
    x: Tensor<2>,
    send: Vec<usize>,
    recv: Vec<usize>,
    ep: &ExpertParallel,
) -> Tensor<2> {
    ep.traffic.count(ep.group.rank(), &send);
    let forward = {
        let (ep, send, recv) = (ep.clone(), send.clone(), recv.clone());
        tensor_fn::<2>(move |t| ok(ep.group.all_to_all_tensor(t, &send, &recv)))
    };
    let backward = {
        let ep = ep.clone();
        tensor_fn::<2>(move |t| {
            ep.traffic.count(ep.group.rank(), &recv);
            ok(ep.group.all_to_all_tensor(t, &recv, &send))
        })
    };
    collective_pair(x, forward, backward)
}

impl ExpertDispatch for ExpertParallel {
    fn gather(&self, x: Tensor<2>, rows: &[usize]) -> Tensor<2> {
        if combine_op::gathers(&x, rows) {
            combine_op::gather_fused(x, rows)
        } else {
            let index = index_tensor(rows, [rows.len()], &x.device());
            x.select(0, index)
        }
    }

    fn combine(&self, outputs: Tensor<2>, weights: Tensor<2>, routing: &Routing) -> Tensor<2> {
        if combine_op::fuses(&outputs, &weights) {
            combine_op::combine_fused(outputs, weights, routing)
        } else {
            crate::moe::combine(outputs, weights, routing)
        }
    }

    fn dispatch(&self, moe: &Moe, tokens: Tensor<2>, counts: &[usize]) -> Tensor<2> {
        let (p, per) = (self.group.size(), self.per_rank());
        // This step's replicated (hot) experts of this layer: every rank holds a copy and keeps
        // its own tokens for them. Each rank's slots: its own experts, then the copies.
        let (hot, copies) = ok(self.replicas.copies_for(moe, &self.group, per, counts));
        let slots = per + hot.len();
        let (order, outgoing) = self.send_order(&hot, counts, slots);
        let send: Vec<usize> = outgoing
            .chunks(slots)
            .map(|c| c.iter().sum::<u64>() as usize)
            .collect();
        let reordered = order.iter().enumerate().any(|(i, &r)| i != r);
        let device = tokens.device();
        let index = |v: &[usize]| index_tensor(v, [v.len()], &device);
        let tokens = if reordered {
            tokens.select(0, index(&order))
        } else {
            tokens
        };
        // Each rank learns how many rows per slot every rank sends it.
        let mut incoming = vec![0u64; p * slots];
        ok(control(|| {
            (self.group).all_to_all_v(&outgoing, &vec![slots; p], &mut incoming, &vec![slots; p])
        }));
        let incoming: Vec<usize> = incoming.iter().map(|&c| c as usize).collect();
        let recv: Vec<usize> = incoming.chunks(slots).map(|c| c.iter().sum()).collect();
        let received = exchange_rows(tokens, send.clone(), recv.clone(), self);
        let total: usize = recv.iter().sum();
        // The copies are f32 leaves of their own; under a precision policy they compute in the
        // tokens' dtype like the experts of the (cast) model.
        let dtype = received.dtype().into();
        let copies = copies.into_iter().map(|c| cast_params(c, dtype));
        let experts: Vec<SwiGlu> = moe.experts.iter().cloned().chain(copies).collect();
        let outputs = match total {
            0 => keep_tracked(&experts, received),
            _ => run_by_slot(&experts, received, &incoming, slots),
        };
        let back = exchange_rows(outputs, recv, send, self);
        if reordered {
            back.select(0, index(&inverse(&order)))
        } else {
            back
        }
    }
}

impl ExpertParallel {
    /// The rows of `counts` (tokens grouped by expert) in send order, per destination rank
    /// and per slot (its own experts, then on this rank the `hot` copies it keeps), and how
    /// many rows go to each (rank, slot).
    fn send_order(&self, hot: &[usize], counts: &[usize], slots: usize) -> (Vec<usize>, Vec<u64>) {
        let (p, per, me) = (self.group.size(), self.per_rank(), self.group.rank());
        let mut starts = vec![0; counts.len()];
        for x in 1..counts.len() {
            starts[x] = starts[x - 1] + counts[x - 1];
        }
        let (mut order, mut outgoing) = (Vec::new(), vec![0u64; p * slots]);
        for q in 0..p {
            for (j, x) in self.experts_of(q).enumerate() {
                if !hot.contains(&x) {
                    outgoing[q * slots + j] = counts[x] as u64;
                    order.extend(starts[x]..starts[x] + counts[x]);
                }
            }
            if q == me {
                for (i, &h) in hot.iter().enumerate() {
                    outgoing[q * slots + per + i] = counts[h] as u64;
                    order.extend(starts[h]..starts[h] + counts[h]);
                }
            }
        }
        (order, outgoing)
    }
}

/// No rows arrived: nothing to compute, but the way back must still run (it is a
/// collective), in backward too. The ranks that ran experts track it through their
/// parameters, so it is tracked here as well when the experts train, even if the layer's
/// input is not (a layer reading the data directly): an empty leaf carries the tracking, the
/// received rows stay on the graph beside it.
fn keep_tracked(experts: &[SwiGlu], received: Tensor<2>) -> Tensor<2> {
    let experts_train = experts.iter().any(|e| e.w_gate.weight.base().is_tracked());
    match experts_train {
        true => received.clone() + received.detach().require_grad(),
        false => received,
    }
}

/// The `experts` (one per slot) run on the `received` rows, which come grouped by (source
/// rank, slot) with `incoming[source * slots + slot]` rows each; the outputs in the same
/// order.
fn run_by_slot(
    experts: &[SwiGlu],
    received: Tensor<2>,
    incoming: &[usize],
    slots: usize,
) -> Tensor<2> {
    let total: usize = incoming.iter().sum();
    if slots == 1 {
        return run_experts(experts, received, &[total]);
    }
    let p = incoming.len() / slots;
    // Received rows come (source, slot); experts want (slot, source).
    let mut at = 0;
    let mut first = vec![0; p * slots];
    for (i, &n) in incoming.iter().enumerate() {
        first[i] = at;
        at += n;
    }
    let mut grouped = Vec::with_capacity(total);
    for j in 0..slots {
        for src in 0..p {
            let i = src * slots + j;
            grouped.extend(first[i]..first[i] + incoming[i]);
        }
    }
    let per_slot: Vec<usize> = (0..slots)
        .map(|j| (0..p).map(|src| incoming[src * slots + j]).sum())
        .collect();
    let device = received.device();
    let index = |v: &[usize]| index_tensor(v, [v.len()], &device);
    let rows = received.select(0, index(&grouped));
    run_experts(experts, rows, &per_slot).select(0, index(&inverse(&grouped)))
}

/// The permutation that undoes `order` (`order[i]` is the row placed at `i`).
fn inverse(order: &[usize]) -> Vec<usize> {
    let mut inverse = vec![0; order.len()];
    for (pos, &row) in order.iter().enumerate() {
        inverse[row] = pos;
    }
    inverse
}
