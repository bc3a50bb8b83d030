//! A plan's fully sharded units: the parameters that are all-gathered together, in one
//! collective, and the scope in which a forward gathers them a unit at a time with the next
//! unit prefetched ([`crate::parallelize::Parallelized::forward`]).
//!
//! FSDP2 starts a unit's all-gather in a pre-forward hook. Burn has no module hooks, so a unit
//! is gathered when the forward first reads one of its parameters (`Param::val`, through
//! [`crate::parallelize::Placed`]): inside a [`UnitScope`] that read gathers every parameter of the unit at
//! once and submits the all-gather of the unit after it, which then runs on the rank's
//! communication thread ([`ShardGroup`]) while the unit computes.
//!
//! Every collective a unit issues (gathers, prefetches, its gradients' reduce-scatters) goes
//! through that one thread in submission order. Ranks submit in the same program order, so
//! they issue the same collectives in the same order; a per-parameter gather on the training
//! thread (a read no unit covers) first waits for the prefetches in flight.
//!
//! A recomputed forward ([`recomputing`](crate::recompute::recomputing): activation checkpointing, in forward and again in
//! backward) gathers the units of the module it recomputes on their first reads too, from
//! that module's own parameters, and forgets them when it ends. So a unit whose forward is
//! checkpointed holds its gathered parameters only while it computes, and gathers them again
//! for its backward.
//!
//! FSDP's `reshard_after_forward` without recomputing: on a device with Burn's balanced
//! gradient checkpointing a unit's reads are memory-bound ops (`regathered_pair`), which no
//! backward state keeps; the first backward op that needs one of the unit's values gathers the
//! unit again (once, from the shards the forward read), and the unit's reduce-scatter frees it.
//! On any other device autodiff keeps what the forward read until backward.

mod gather;
mod membership;

pub(crate) use membership::{unit_shards, units_of};

use super::{Pending, ShardGroup};
use crate::data_parallel::LaterHandle;
use crate::error::ParallelError;
use crate::params::ParamLayout;
use crate::plan::ParallelizePlan;
use crate::recompute::{self, depth, replaying};
use burn::module::{Module, ParamId};
use burn::tensor::Tensor;
use flashover_comm::CommError;
use gather::RegatherOrder;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Fully sharded parameters gathered ahead of their reads, a unit (one collective) at a time:
/// by parameter path, the gathered rows flattened. One per rank, shared by its parameters.
#[derive(Debug, Clone, Default)]
pub(crate) struct UnitGathers(Arc<UnitState>);

#[derive(Debug, Default)]
struct UnitState {
    /// By the recomputation depth it was gathered at (see [`crate::recompute::recomputing`]) and parameter
    /// path: its gathered rows.
    gathered: Mutex<HashMap<(usize, String), Tensor<1>>>,
    /// The communication thread of the `fsdp` group (set when the plan shards anything).
    comm: OnceLock<Arc<ShardGroup>>,
    /// The forward running in [`crate::parallelize::Parallelized::forward`], if one is.
    scope: Mutex<Option<UnitScope>>,
    /// All-gathers submitted before their unit's first read.
    ahead: Mutex<HashMap<Unit, Pending>>,
    /// While a pipeline step defers them ([`UnitGathers::defer_scatters`]): the units'
    /// reduce-scatters submitted in backward and not waited for, in submission order.
    deferred: Mutex<Option<Vec<DeferredScatter>>>,
    /// While a pipeline step hands them on ([`UnitGathers::hand_scatters_to`]): by parameter
    /// path, the gradient bucket that takes the rows of its unit's reduce-scatter unwaited.
    handed: Mutex<Option<HashMap<String, LaterHandle>>>,
    /// Which parameters make each unit (set when the plan has units).
    layout: OnceLock<UnitLayout>,
    /// The whole units checkpointed forwards gathered since the scope began, in forward order,
    /// with their stored rows: their reruns in backward come in reverse order, each
    /// prefetching the one before.
    to_rerun: Mutex<Vec<(usize, UnitShards)>>,
    /// The units the current forward gathered to be gathered again in backward (balanced
    /// checkpointing), in forward order ([`UnitGathers::new_forward`] starts a new list).
    regather_order: Mutex<Arc<RegatherOrder>>,
    /// The parameters of at most one dimension (norm scales, biases), by path: their reads
    /// stay in backward states (a vector each), so that the ops Burn recomputes at the start
    /// of backward from them (a residual stream's bias additions) do not gather every unit
    /// again at once; only matrices are gathered again, when their backward needs them.
    vectors: OnceLock<std::collections::HashSet<String>>,
}

/// A unit's fully sharded parameters: each one's path and stored rows, flattened.
type UnitShards = Vec<(String, Tensor<1>)>;

/// A unit's reduce-scatter submitted in backward: its parameters' paths and stored lengths,
/// in the order of the rows it returns.
#[derive(Debug)]
struct DeferredScatter {
    names: Vec<String>,
    lens: Vec<usize>,
    rows: Pending,
}

/// A plan's units on this rank: the fully sharded parameters it holds, grouped.
#[derive(Debug, Default)]
pub(crate) struct UnitLayout {
    /// Which unit each fully sharded parameter (by path) belongs to.
    pub(crate) unit_of: HashMap<String, usize>,
    /// Per unit, its parameters (path and id) in layout order.
    pub(crate) members: Vec<Vec<(String, ParamId)>>,
}

/// A model's fully sharded units on one rank, and the forward scope that gathers them a unit
/// at a time: what [`crate::parallelize::Parallelized::forward`] runs.
#[derive(Debug, Clone, Default)]
pub(crate) struct FullyShardedUnits {
    gathers: UnitGathers,
    /// The units' module paths, numbered as [`UnitLayout`] numbers them.
    paths: Vec<String>,
    /// Per parameter (layout order), its path and unit when it is a held fully sharded one.
    slots: Vec<Option<(String, usize)>>,
}

impl FullyShardedUnits {
    /// The units of the fully sharded parameters `held_shards` names (per parameter of
    /// `layout`, its path when it is one this rank holds), gathered by `gathers` through
    /// `comm` (none: nothing is sharded over more than one rank).
    pub(crate) fn new<'a>(
        plan: &ParallelizePlan,
        layout: &crate::params::ParamLayout,
        held_shards: impl Iterator<Item = Option<&'a str>> + Clone,
        gathers: UnitGathers,
        comm: Option<Arc<ShardGroup>>,
    ) -> Self {
        let (unit_of, paths) = units_of(plan, held_shards.clone().flatten());
        let slots: Vec<Option<(String, usize)>> = held_shards
            .map(|name| name.and_then(|n| Some((n.to_string(), *unit_of.get(n)?))))
            .collect();
        if let Some(comm) = comm.filter(|_| !paths.is_empty()) {
            gathers.set_comm(comm);
        }
        let mut members = vec![vec![]; paths.len()];
        for (slot, held) in layout.slots.iter().zip(&slots) {
            if let Some((name, unit)) = held {
                members[*unit].push((name.clone(), slot.id));
            }
        }
        gathers.set_layout(UnitLayout { unit_of, members });
        FullyShardedUnits {
            gathers,
            paths,
            slots,
        }
    }

    /// `f(model)` with the units gathered a unit at a time (see
    /// [`crate::parallelize::Parallelized::forward`]); `model` as the units were placed, or a cast view of
    /// it (`MixedPrecision::compute_view`), whose reads come in the view's dtype.
    pub fn forward<M: Module, T>(
        &self,
        model: &M,
        f: impl FnOnce(&M) -> T,
    ) -> Result<T, ParallelError> {
        if self.gathers.comm().is_none() {
            return Ok(f(model));
        }
        let shards = unit_shards(model, &self.slots, self.paths.len());
        let scope = UnitScope::new(shards);
        self.gathers.run_scope(scope, || f(model))
    }

    /// The units by module path, in the order [`Self::forward`] prefetches them.
    pub fn paths(&self) -> &[String] {
        &self.paths
    }

    /// The counters of the units' collectives (all-gathers, prefetches, reduce-scatters,
    /// gathered bytes alive and at most, the training thread's waits), when anything is
    /// sharded over more than one rank.
    pub fn stats(&self) -> Option<&crate::zero::GatherStats> {
        self.gathers.comm().map(|c| c.stats())
    }
}

/// A unit whose all-gather may be submitted ahead of its first read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Unit {
    /// Unit `n` of a [`UnitScope`] (numbered in layout order).
    Scoped(usize),
    /// A pipeline rule's layer.
    Layer(usize),
}

/// A forward's units still to gather (numbered as [`UnitLayout`] numbers them).
#[derive(Debug)]
pub(crate) struct UnitScope {
    /// Per unit, its parameters' stored rows (flattened, by path) until it is gathered.
    waiting: Vec<Option<UnitShards>>,
}

/// Locks `m`, recovering from a poisoned lock (a panicking rank's state is read-only here).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl UnitGathers {
    /// Gathers through `comm`'s thread from now on.
    pub(crate) fn set_comm(&self, comm: Arc<ShardGroup>) {
        let _ = self.0.comm.set(comm);
    }

    /// Groups the fully sharded parameters into units from now on.
    pub(crate) fn set_layout(&self, layout: UnitLayout) {
        let _ = self.0.layout.set(layout);
    }

    /// The communication thread's counters (all-gathers, prefetches, gathered bytes alive),
    /// when the plan shards anything over more than one rank.
    pub(crate) fn comm(&self) -> Option<&Arc<ShardGroup>> {
        self.0.comm.get()
    }

    /// Gathers the shards `shards` (each a fully sharded parameter's path and stored rows,
    /// flattened) in one all-gather (whose backward reduce-scatters their gradients in one
    /// collective too), for the parameters' reads until [`Self::release`]. Returns a tensor
    /// on whose graph the reduce-scatter is (to keep it there on a rank that reads none of the
    /// parameters), `None` for no shards.
    pub(crate) fn gather(&self, shards: Vec<(String, Tensor<1>)>) -> Option<Tensor<1>> {
        self.gather_unit(shards, None)
    }

    /// [`Self::gather`] of unit `unit`, whose all-gather [`Self::prefetch`] may have
    /// submitted already.
    pub(crate) fn gather_prefetched(
        &self,
        unit: Unit,
        shards: Vec<(String, Tensor<1>)>,
    ) -> Option<Tensor<1>> {
        let pending = lock(&self.0.ahead).remove(&unit);
        self.gather_unit(shards, pending)
    }

    /// Submits the all-gather of unit `unit`'s `shards` now (unless it is submitted already),
    /// to run on the communication thread until [`Self::gather_prefetched`] takes it. Every
    /// rank must prefetch the same units in the same order, and take each before the values
    /// it was submitted with change.
    pub(crate) fn prefetch(&self, unit: Unit, shards: &[(String, Tensor<1>)]) {
        let Some(comm) = self.comm() else { return };
        let mut ahead = lock(&self.0.ahead);
        if shards.is_empty() || ahead.contains_key(&unit) {
            return;
        }
        let own = Tensor::cat(shards.iter().map(|(_, t)| t.clone().inner()).collect(), 0);
        comm.stats()
            .gathered(own.dims()[0] * comm.group().size() * 4, true);
        ahead.insert(unit, comm.all_gather(own));
    }

    /// From now until [`Self::add_deferred`], a unit's backward submits the reduce-scatter of
    /// its gradient and hands its shard a zero gradient instead of waiting for it: the
    /// backward of the units before it runs while the collective does (FSDP2 waits for its
    /// reduce-scatters at the end of backward too). The caller adds the rows where the
    /// gradients are summed, after the step's last backward. Forgets (after waiting for) any a
    /// failed step left.
    pub(crate) fn defer_scatters(&self) -> Result<(), CommError> {
        let left = lock(&self.0.deferred).replace(vec![]).unwrap_or_default();
        let mut outcome = Ok(());
        for scatter in left {
            if let Err(e) = scatter.rows.wait() {
                outcome = Err(e);
            }
        }
        outcome
    }

    /// Stops deferring, dropping what was deferred (a step that failed: its gradients are
    /// not used).
    pub(crate) fn stop_deferring(&self) {
        lock(&self.0.deferred).take();
    }

    /// From now until [`Self::stop_handing`], a unit whose every parameter is in `buckets`
    /// (by path: the bucket that reduces its shard's gradient over the other data axes, as
    /// HSDP's) hands its reduce-scatter to those buckets unwaited and its shard a zero
    /// gradient: the buckets wait for the rows on their own thread, and backward goes on.
    pub(crate) fn hand_scatters_to(&self, buckets: HashMap<String, LaterHandle>) {
        *lock(&self.0.handed) = Some(buckets);
    }

    /// Ends [`Self::hand_scatters_to`].
    pub(crate) fn stop_handing(&self) {
        lock(&self.0.handed).take();
    }

    /// Waits for the reduce-scatters deferred since [`Self::defer_scatters`] and adds each
    /// parameter's rows to `flat` (gradients in `layout`, by parameter path), in the order
    /// they were submitted; stops deferring. Fails with the first failed collective.
    pub(crate) fn add_deferred(
        &self,
        layout: &ParamLayout,
        mut flat: Tensor<1>,
    ) -> Result<Tensor<1>, CommError> {
        let Some(deferred) = lock(&self.0.deferred).take() else {
            return Ok(flat);
        };
        let offsets: HashMap<&str, usize> = (layout.slots.iter())
            .map(|s| (s.name.as_str(), s.offset))
            .collect();
        for scatter in deferred {
            let (rows, waited) = scatter.rows.wait_timed();
            if let Some(comm) = self.comm() {
                comm.stats().waited(waited);
            }
            let rows = rows?.to_device(&flat.device());
            let mut start = 0;
            for (name, len) in scatter.names.iter().zip(scatter.lens) {
                let offset = *offsets
                    .get(name.as_str())
                    .expect("a unit's parameters are the model's");
                let range = offset..offset + len;
                let sum = flat.clone().slice(range.clone()) + rows.clone().narrow(0, start, len);
                flat = flat.slice_assign(range, sum);
                start += len;
            }
        }
        Ok(flat)
    }

    /// Records which of `layout`'s parameters are vectors (see `UnitState::vectors`).
    pub(crate) fn set_vectors(&self, layout: &ParamLayout) {
        let vectors = (layout.slots.iter())
            .filter(|slot| slot.shape.len() <= 1)
            .map(|slot| slot.name.clone());
        let _ = self.0.vectors.set(vectors.collect());
    }

    /// A new forward begins (a scope's, a micro-batch's): the units it gathers to gather again
    /// in backward are its own list, whose order their backward prefetches follow.
    pub(crate) fn new_forward(&self) {
        *lock(&self.0.regather_order) = Arc::default();
    }

    /// Waits for every all-gather submitted ahead and forgets it (one no read took: a step
    /// that failed half-way must not hand the next one its stale values). Fails with the
    /// first failed collective.
    pub(crate) fn discard_prefetches(&self) -> Result<(), CommError> {
        let ahead = std::mem::take(&mut *lock(&self.0.ahead));
        let mut outcome = Ok(());
        for (_, pending) in ahead {
            if let Err(e) = pending.wait() {
                outcome = Err(e);
            }
        }
        outcome
    }

    /// Forgets the gathered parameters `names` (their next reads gather them again).
    pub(crate) fn release<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        let (mut map, depth) = (lock(&self.0.gathered), depth());
        for name in names {
            map.remove(&(depth, name.to_string()));
        }
    }

    /// Whether parameter `name` is gathered already (at this recomputation depth).
    pub(crate) fn holds(&self, name: &str) -> bool {
        lock(&self.0.gathered).contains_key(&(depth(), name.to_string()))
    }

    /// Parameter `name` gathered: already (at this recomputation depth), or now with the rest
    /// of its unit when a forward scope holds it (prefetching the next unit; not inside a
    /// recomputation). `None` when neither: the caller gathers it alone, on the training
    /// thread, after [`Self::settle`].
    pub(crate) fn get(&self, name: &str) -> Option<Tensor<1>> {
        let key = (depth(), name.to_string());
        if let Some(t) = lock(&self.0.gathered).get(&key) {
            return Some(t.clone());
        }
        if key.0 > 0 {
            return self.get_recomputed(name);
        }
        let unit = *self.0.layout.get()?.unit_of.get(name)?;
        let (shards, next) = {
            let mut scope = lock(&self.0.scope);
            let scope = scope.as_mut()?;
            let shards = scope.waiting[unit].take()?;
            (shards, scope.next_waiting(unit))
        };
        self.gather_prefetched(Unit::Scoped(unit), shards);
        if let Some((next, shards)) = next {
            self.prefetch(Unit::Scoped(next), &shards);
        }
        lock(&self.0.gathered).get(&key).cloned()
    }

    /// [`Self::get`] inside a recomputation: parameter `name` gathered with the rest of its
    /// unit that the recomputed module holds, from that module's stored rows (so that its
    /// gradient reaches them). A whole unit takes the all-gather submitted ahead for it, if
    /// any, and submits the next one's: in forward the enclosing scope's next unit, in
    /// backward the unit checkpointed before it (FSDP's backward prefetch). `None` when the
    /// module holds none of it.
    fn get_recomputed(&self, name: &str) -> Option<Tensor<1>> {
        self.comm()?;
        let layout = self.0.layout.get()?;
        let unit = *layout.unit_of.get(name)?;
        let members = &layout.members[unit];
        let shards: Vec<(String, Tensor<1>)> = recompute::with_stored(|stored| {
            members
                .iter()
                .filter_map(|(n, id)| Some((n.clone(), stored.get(id)?.clone())))
                .collect()
        })?;
        if shards.is_empty() {
            return None;
        }
        // Only a whole unit is what was prefetched, and has a unit after it (in forward: the
        // scope's next; in backward: the one checkpointed before it, rerun next).
        let whole = shards.len() == members.len();
        let next = match (whole, replaying()) {
            (false, _) => None,
            (true, false) => {
                lock(&self.0.to_rerun).push((unit, shards.clone()));
                lock(&self.0.scope).as_mut().and_then(|scope| {
                    scope.waiting[unit] = None;
                    scope.next_waiting(unit)
                })
            }
            (true, true) => {
                let mut to_rerun = lock(&self.0.to_rerun);
                to_rerun.retain(|(u, _)| *u != unit);
                to_rerun.last().cloned()
            }
        };
        let pending = whole
            .then(|| lock(&self.0.ahead).remove(&Unit::Scoped(unit)))
            .flatten();
        self.gather_unit(shards, pending);
        if let Some((next, shards)) = next {
            self.prefetch(Unit::Scoped(next), &shards);
        }
        let gathers = self.clone();
        // Outside a frame nothing was gathered at a recomputation's depth.
        let _ = recompute::on_leave(Box::new(move |depth| gathers.forget_depth(depth)));
        lock(&self.0.gathered)
            .get(&(depth(), name.to_string()))
            .cloned()
    }

    /// Forgets every parameter gathered at recomputation depth `depth`.
    fn forget_depth(&self, depth: usize) {
        lock(&self.0.gathered).retain(|(d, _), _| *d != depth);
    }

    /// Waits for the all-gathers submitted ahead (their results stay for their units), so
    /// that a collective over the same group on the training thread cannot overtake them.
    pub(crate) fn settle(&self) {
        let mut ahead = lock(&self.0.ahead);
        let settled = std::mem::take(&mut *ahead)
            .into_iter()
            .map(|(unit, pending)| (unit, Pending::ready(pending.wait())))
            .collect();
        *ahead = settled;
    }

    /// Runs `f` with `scope`'s units gathered at their first reads; then waits for any
    /// all-gather still in flight and forgets every gathered parameter (autodiff keeps what
    /// backward needs). Fails when a scope is running already or a prefetch failed.
    pub(crate) fn run_scope<T>(
        &self,
        scope: UnitScope,
        f: impl FnOnce() -> T,
    ) -> Result<T, ParallelError> {
        {
            let mut current = lock(&self.0.scope);
            if current.is_some() {
                return Err(ParallelError::Invalid(
                    "Parallelized::forward is already running on this rank: run one forward \
                     at a time"
                        .into(),
                ));
            }
            // A backward that reran fewer units than its forward checkpointed leaves a
            // prefetch behind, of values the optimizer has changed since.
            lock(&self.0.to_rerun).clear();
            self.discard_prefetches().map_err(ParallelError::Comm)?;
            self.new_forward();
            *current = Some(scope);
        }
        // Ends the scope even when `f` panics, so that the rank's next forward can run.
        struct End<'a>(&'a UnitGathers);
        impl End<'_> {
            fn finish(&self) -> Result<(), CommError> {
                lock(&self.0.0.scope).take();
                lock(&self.0.0.gathered).clear();
                self.0.discard_prefetches()
            }
        }
        impl Drop for End<'_> {
            fn drop(&mut self) {
                let _ = self.finish();
            }
        }
        let end = End(self);
        let out = f();
        // (Its drop finds the scope ended and does nothing more.)
        end.finish().map_err(ParallelError::Comm)?;
        Ok(out)
    }
}

thread_local! {
    /// The input of the layer running now, where a caller names it ([`after_input`]).
    static LAYER_INPUT: RefCell<Option<Tensor<1>>> = const { RefCell::new(None) };
}

/// Runs `f`, a layer's forward on `input` (one of its input's tensors): the units it gathers
/// reduce-scatter their gradients right after the layer's backward rather than at the end of
/// backward. Burn runs the backward tape by depth, deepest first, so the op that
/// reduce-scatters a unit is put as deep as the layer's input, not as shallow as the unit's
/// shards (parameters, depth 0).
pub(crate) fn after_input<T>(input: Option<Tensor<1>>, f: impl FnOnce() -> T) -> T {
    let before = LAYER_INPUT.with(|i| i.replace(input));
    struct Restore(Option<Tensor<1>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            LAYER_INPUT.with(|i| *i.borrow_mut() = self.0.take());
        }
    }
    let _restore = Restore(before);
    f()
}

impl UnitScope {
    /// A forward's scope over `shards` (per unit, its parameters' stored rows by path).
    pub(crate) fn new(shards: Vec<UnitShards>) -> Self {
        UnitScope {
            waiting: shards
                .into_iter()
                .map(|s| (!s.is_empty()).then_some(s))
                .collect(),
        }
    }

    /// The first unit after `unit` still to gather, in layout order (forward order in most
    /// models; a unit read out of that order is gathered when read), with its shards: the
    /// one to prefetch.
    fn next_waiting(&self, unit: usize) -> Option<(usize, UnitShards)> {
        (unit + 1..self.waiting.len()).find_map(|u| Some((u, self.waiting[u].clone()?)))
    }
}
