//! A plan's gradient reduction: every gradient summed over the ranks that hold the same
//! parameter and read different data (the data axes its placement replicates it on,
//! [`ParamPlacement::reduce_axes`]), in buckets, each set of axes with its own bucket list and
//! communication thread (the bucketed reducer DDP uses, [`super::reducer`]).
//!
//! Gradients reach the buckets two ways. An executor that knows a step's micro-batches (a
//! plan's pipeline step, one stage or many) runs every forward on [`BucketedReduction::hooked`]
//! parameters: a gradient hook hands each parameter's gradient to its bucket as backward
//! finalises it, and during the last micro-batch a complete bucket is reduced while backward
//! goes on (PyTorch DDP's and Megatron's overlap). Otherwise the step's gradients are added
//! after backward ([`BucketedReduction::add_remaining`]) and the buckets are reduced then, in the
//! same order with the same sums, so both ways give the same bits. After the first step that
//! used hooks, each bucket list is re-planned in the order rank 0's gradients arrived.
//!
//! Tied copies (an embedding the first and the last pipeline stage both hold) are summed over
//! their tie group after the buckets. A parameter this rank keeps only a placeholder for
//! (another stage's, another expert rank's) is not reduced: its gradient is zero everywhere.
//!
//! ZeRO-1/2 ([`GradientBuckets::rows`]) keep only this rank's rows of every gradient, the
//! parameters cut along their first dimension over `fsdp` (or `dp` without one) as
//! [`crate::zero::UnitShards`] cuts them: the buckets are laid out by rows, so an all-reduce
//! leaves each rank its rows in one chunk (ZeRO-1, the same sums as without rows) and a
//! reduce-scatter hands each rank only the sum of its rows (ZeRO-2, every micro-batch when
//! hooks report the gradients, so a rank holds its rows and the buckets in flight).

mod layout;

use super::reducer::{LaterHandle, Mode, Reducer, Spans};
use crate::error::ParallelError;
use crate::hook::{
    GradCallback, ReadDepths, ReadPlacement, grad_hook, grad_hook_after, hooks_supported,
};
use crate::params::{ParamLayout, part};
use crate::plan::GradientRows;
use crate::precision::Precision;
use crate::unit_shards::UnitShards;
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Device, Tensor};
use flashover_comm::{CommunicatorExt, Group, ReduceOp, control};
use flashover_runtime::{Axis, TensorCollectives};
use layout::SetLayout;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// When a plan's gradient buckets are reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReductionTiming {
    /// While backward runs: gradient hooks hand each gradient to its bucket, and a complete
    /// bucket is reduced at once during the step's last backward.
    DuringBackward,
    /// After backward, for the reason given.
    AfterBackward(&'static str),
}

impl std::fmt::Display for ReductionTiming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReductionTiming::DuringBackward => f.write_str("during backward (gradient hooks)"),
            ReductionTiming::AfterBackward(why) => write!(f, "after backward: {why}"),
        }
    }
}

/// What one step's gradient reduction did and cost on this rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReductionReport {
    /// Buckets reduced (over every set of axes).
    pub buckets: usize,
    /// Whether gradient hooks reported the gradients during backward and the buckets were
    /// reduced as they completed while it ran; `false`: they were reduced after it (a loop's
    /// first step, whose hooks only fill the buckets: [`crate::parallelize::Parallelized::gradients`]).
    pub reduced_during_backward: bool,
    /// Time the communication threads spent reducing buckets.
    pub comm: Duration,
    /// The part of `comm` that ran before the last backward ended (hidden behind compute).
    pub overlapped: Duration,
    /// Time the training thread waited for the buckets after backward.
    pub exposed: Duration,
    /// The most gradient bytes the buckets (and, under rows, this rank's summed rows) held at
    /// once this step.
    pub peak_bytes: usize,
}

/// One set of data axes and the parameters reduced over exactly those.
struct ReduceSet {
    group: Group,
    /// The parameters (layout indices of the model), in the set's own numbering.
    params: Vec<usize>,
    reducer: Reducer,
    /// Whether its buckets were re-planned from the arrival order yet.
    rebuilt: bool,
    /// Under rows: the rows' group and the rest of the set's axes (communicators of the
    /// set's thread alone).
    row_groups: Option<(Group, Option<Group>)>,
}

/// Where a rank's rows of the reduced gradients are, under [`crate::plan::GradientBuckets::rows`].
pub struct GradientRowLayout {
    /// The axis the rows are cut over.
    pub axis: Axis,
    /// The parameters this rank holds, laid end to end (the model's layout without the
    /// placeholders).
    pub layout: ParamLayout,
    /// Their cut over the axis: this rank's rows are laid out as its shard.
    pub shards: UnitShards,
    /// How the rows are reduced.
    pub rows: GradientRows,
}

/// A step in progress.
#[derive(Default)]
struct StepState {
    /// Whether this step's forwards ran on hooked parameters.
    hooked: bool,
    /// Whether a hooked backward of this step reduced buckets as they completed (its last
    /// micro-batch's; every one's under reduce-scatter).
    reduced_during: bool,
    /// When the last backward ended (all gradients handed over).
    backward_end: Option<Instant>,
}

/// See the module docs.
pub(crate) struct BucketedReduction {
    sets: Mutex<Vec<ReduceSet>>,
    /// Per parameter of the model's layout: its set and its index there, when it is reduced.
    member: Vec<Option<(usize, usize)>>,
    /// Per parameter of the model's layout: its offset and length in the flat gradient.
    slots: Vec<(usize, usize)>,
    /// Per parameter of the model's layout: its rows and elements per row.
    shapes: Vec<(usize, usize)>,
    /// Tied copies: the group summing them and their layout indices.
    tie: Option<(Group, Vec<usize>)>,
    /// Under rows: where this rank's rows go, and per parameter of the model's layout its
    /// index among the held ones.
    rows: Option<(GradientRowLayout, Vec<Option<usize>>)>,
    bucket_elems: usize,
    wire: Precision,
    overlap: bool,
    mode: Mode,
    /// The device the gradients live on (the parameters', outside autodiff).
    device: Device,
    step: Mutex<StepState>,
    /// Where a loop of one's own's hooks go in backward ([`Self::hooked`]).
    read_depths: Arc<ReadDepths>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl BucketedReduction {
    /// Whether this rank reduces anything over other ranks.
    fn reduces(&self) -> bool {
        !lock(&self.sets).is_empty()
    }

    /// Whether a step whose forwards run on `device` (an autodiff device) reports its
    /// gradients through hooks: overlap asked for, something to reduce, and a device the
    /// hook op is built for.
    pub(crate) fn hooks_on(&self, device: &burn::tensor::Device) -> bool {
        self.timing(device) == ReductionTiming::DuringBackward
    }

    /// When a step whose forwards run on `device` reduces its buckets, as far as the
    /// reduction itself decides (the executor may rule hooks out too).
    pub(crate) fn timing(&self, device: &burn::tensor::Device) -> ReductionTiming {
        use ReductionTiming::AfterBackward;
        if !self.overlap {
            AfterBackward("gradient_buckets.overlap (parallel.overlap) is off")
        } else if !self.reduces() {
            AfterBackward("no gradient is summed over other ranks on this mesh")
        } else if !hooks_supported(device) {
            AfterBackward("the gradient hook op is built for Flex and the CubeCL backend only")
        } else {
            ReductionTiming::DuringBackward
        }
    }

    /// Whether a bucket reduces parameter `index` (the model's layout order).
    pub(crate) fn reduces_param(&self, index: usize) -> bool {
        lock(&self.sets).iter().any(|s| s.params.contains(&index))
    }

    /// Buckets per step, over every set of axes.
    pub(crate) fn buckets(&self) -> usize {
        lock(&self.sets)
            .iter()
            .map(|s| s.reducer.buckets().len())
            .sum()
    }

    /// Starts a step whose forwards run on [`Self::hooked`] parameters (`hooked`) or not.
    pub(crate) fn begin_step(&self, hooked: bool) {
        for set in lock(&self.sets).iter() {
            set.reducer.begin_step();
            // No gradient has arrived yet (a step without hooks begins no micro-batch).
            set.reducer.begin_micro(false);
        }
        *lock(&self.step) = StepState {
            hooked,
            ..StepState::default()
        };
    }

    /// Starts a micro-batch's backward: its complete buckets are reduced at once when it is
    /// the step's last (earlier ones accumulate).
    pub(crate) fn begin_micro(&self, last: bool) {
        for set in lock(&self.sets).iter() {
            set.reducer.begin_micro(last);
        }
        let mut step = lock(&self.step);
        step.reduced_during = step.hooked && (last || self.mode == Mode::ReduceScatter);
    }

    /// After a micro-batch's backward whose forward ran on hooked parameters: the parameters
    /// the hooks did not report got no gradient from it (so their buckets complete). Under
    /// reduce-scatter rows (ZeRO-2) every micro-batch's buckets are reduced, and an earlier
    /// micro-batch's are waited for here, before the next one fills them.
    pub(crate) fn end_micro(&self) -> Result<(), ParallelError> {
        for set in lock(&self.sets).iter() {
            let arrived = set.reducer.arrived();
            for local in (0..set.params.len()).rev() {
                if !arrived[local] {
                    set.reducer.mark_absent(local);
                }
            }
            if self.mode == Mode::ReduceScatter && !set.reducer.is_last_micro() {
                set.reducer.wait_reduced()?;
            }
        }
        Ok(())
    }

    /// Whether a backward of hooked parameters has reported a gradient in the micro-batch
    /// under way.
    pub(crate) fn any_arrived(&self) -> bool {
        lock(&self.sets)
            .iter()
            .any(|s| s.reducer.arrived().contains(&true))
    }

    /// Whether every micro-batch's buckets are reduced as they fill, last or not (ZeRO-2's
    /// reduce-scatter, which keeps only this rank's rows between micro-batches).
    pub(crate) fn reduces_every_micro(&self) -> bool {
        self.mode == Mode::ReduceScatter
    }

    /// Whether the micro-batch under way was begun as the step's last (its complete buckets
    /// are reduced as they fill).
    pub(crate) fn in_last_micro(&self) -> bool {
        lock(&self.sets).iter().any(|s| s.reducer.is_last_micro())
    }

    /// Where this rank's rows of the reduced gradients are, under rows (ZeRO-1/2).
    pub(crate) fn row_layout(&self) -> Option<&GradientRowLayout> {
        self.rows.as_ref().map(|(layout, _)| layout)
    }

    /// Per parameter (layout order), where a collective still computing its gradient can hand
    /// it to the parameter's bucket ([`LaterHandle::hand`]); `None` for those no bucket
    /// reduces. Valid for one step (the first step's end re-plans the buckets).
    pub(crate) fn later_handles(&self) -> Vec<Option<LaterHandle>> {
        let sets = lock(&self.sets);
        (self.member.iter())
            .map(|m| m.map(|(set, local)| sets[set].reducer.later_handle(local)))
            .collect()
    }

    /// `model` with a gradient hook on every parameter this rank reduces, each handing its
    /// gradient to its bucket (the parameter then receives none), for one forward of a loop of
    /// one's own. Each hook is made when the forward first reads its parameter (Burn's lazy
    /// parameter), placed in backward by that read's order ([`ReadDepths`]): it runs right
    /// after the backward of the op that read the parameter, while the layers below run
    /// theirs. [`Self::hooked_where`] places a pipeline layer's after the layer's input.
    pub(crate) fn hooked<M: Module>(&self, model: &M) -> M {
        let placement = ReadPlacement::by_read_order(&self.read_depths);
        self.hooked_at_reads(model, &|_| true, placement)
    }

    /// [`Self::hooked`] on the parameters `select` picks (by layout index), each hook placed
    /// at its parameter's first read as `placement` says.
    pub(crate) fn hooked_at_reads<M: Module>(
        &self,
        model: &M,
        select: &dyn Fn(usize) -> bool,
        placement: ReadPlacement,
    ) -> M {
        let sets = lock(&self.sets);
        let mut mapper = ReadHookMapper {
            sets: &sets,
            member: &self.member,
            select,
            placement: Arc::new(placement),
            index: 0,
        };
        model.clone().map(&mut mapper)
    }

    /// [`Self::hooked`] on the parameters `select` picks (by layout index), each hook placed
    /// right after `after` when given: `after` is the input of the layer that reads them, so
    /// their buckets fill as backward leaves that layer, not at its end (Burn runs the tape by
    /// depth, and a parameter is as shallow as a node gets).
    pub(crate) fn hooked_where<M: Module>(
        &self,
        model: &M,
        select: &dyn Fn(usize) -> bool,
        after: Option<&Tensor<1>>,
    ) -> M {
        let sets = lock(&self.sets);
        let mut mapper = HookMapper {
            sets: &sets,
            member: &self.member,
            select,
            after,
            index: 0,
        };
        model.clone().map(&mut mapper)
    }

    /// After the last micro-batch's backward: adds what the hooks did not report from `flat`
    /// (this rank's gradients in the model's layout, summed over the step's micro-batches;
    /// zero where hooks took them), so every bucket completes and is reduced (whether or not
    /// a micro-batch was marked last).
    pub(crate) fn add_remaining(&self, flat: &Tensor<1>) {
        for set in lock(&self.sets).iter() {
            set.reducer.launch_all();
            let arrived = set.reducer.arrived();
            // Latest parameters first: the buckets fill in the order they are reduced.
            for (local, &i) in set.params.iter().enumerate().rev() {
                if !arrived[local] {
                    let (offset, numel) = self.slots[i];
                    set.reducer.add(local, part(flat, offset, numel));
                }
            }
        }
        lock(&self.step).backward_end = Some(Instant::now());
    }

    /// Waits for every bucket and returns `flat` (the model's layout) with the sums in place
    /// of the reduced parameters' gradients (the others' left as they are), the tied copies
    /// summed. Re-plans the buckets from the arrival order after the first hooked step
    /// (collective).
    pub(crate) fn finish(
        &self,
        flat: Tensor<1>,
    ) -> Result<(Tensor<1>, ReductionReport), ParallelError> {
        let t0 = Instant::now();
        let mut sets = lock(&self.sets);
        let mut spans = vec![];
        let mut peak = 0;
        let mut sums: Vec<Option<Tensor<1>>> = vec![None; self.slots.len()];
        for set in sets.iter() {
            let Spans { spans: s } = set.reducer.wait_reduced()?;
            spans.extend(s);
            peak += set.reducer.held_bytes().1;
            for (local, sum) in set.reducer.drain().into_iter().enumerate() {
                sums[set.params[local]] = Some(sum);
            }
        }
        let exposed = t0.elapsed();
        let mut flat = match sums.iter().any(Option::is_some) {
            true => Tensor::cat(
                (sums.into_iter().zip(&self.slots))
                    .map(|(sum, &(offset, numel))| {
                        sum.unwrap_or_else(|| part(&flat, offset, numel))
                    })
                    .collect(),
                0,
            ),
            false => flat,
        };
        if let Some((group, tied)) = &self.tie {
            let places: Vec<(usize, usize)> = tied.iter().map(|&i| self.slots[i]).collect();
            flat = sum_tied(group, &places, flat)?;
        }
        let report = self.end_step(&mut sets, spans, t0, exposed, peak)?;
        Ok((flat, report))
    }

    /// [`Self::finish`] under rows (ZeRO-1/2): this rank's rows of every held parameter's
    /// reduced gradient, laid out as [`GradientRowLayout::shards`] lays out its shard.
    pub(crate) fn finish_rows(
        &self,
        flat: Tensor<1>,
    ) -> Result<(Tensor<1>, ReductionReport), ParallelError> {
        let (layout, index) = self.rows.as_ref().expect("rows were asked for");
        if self.mode == Mode::AllReduce {
            // Rows over one rank are whole parameters, laid out end to end as the shard is.
            let (flat, report) = self.finish(flat)?;
            let held: Vec<Tensor<1>> = (index.iter().enumerate())
                .filter(|(_, h)| h.is_some())
                .map(|(i, _)| {
                    let (offset, numel) = self.slots[i];
                    part(&flat, offset, numel)
                })
                .collect();
            let rows = match held.is_empty() {
                true => Tensor::zeros([0], &self.device),
                false => Tensor::cat(held, 0),
            };
            return Ok((rows, report));
        }
        let t0 = Instant::now();
        let mut sets = lock(&self.sets);
        let mut spans = vec![];
        // Per held parameter: its rows (padding included), from the set that reduced it.
        let mut pieces: Vec<Option<Tensor<1>>> = vec![None; layout.layout.slots.len()];
        let mut peak = 0;
        for set in sets.iter() {
            peak += set.reducer.held_bytes().1;
            let (shard, Spans { spans: s }) = set.reducer.wait_shard()?;
            spans.extend(s);
            for (local, &i) in set.params.iter().enumerate() {
                let (at, len) = set.reducer.rows_in_shard(local).expect("laid out by rows");
                let held = index[i].expect("a reduced parameter is held");
                pieces[held] = Some(part(&shard, at, len));
            }
        }
        let exposed = t0.elapsed();
        let shards = &layout.shards;
        let rows_of = |h: usize| shards.len_in_shard(h);
        // The shard lays the held parameters' rows end to end in their order (zeros for one
        // no set reduced).
        let parts: Vec<Tensor<1>> = (pieces.into_iter().enumerate())
            .map(|(h, piece)| piece.unwrap_or_else(|| Tensor::zeros([rows_of(h)], &self.device)))
            .collect();
        let mut rows = match parts.is_empty() {
            true => Tensor::zeros([0], &self.device),
            false => Tensor::cat(parts, 0),
        };
        if let Some((group, tied)) = &self.tie {
            let places: Vec<(usize, usize)> = (tied.iter())
                .filter_map(|&i| index[i])
                .map(|h| (shards.offset_in_shard(h), rows_of(h)))
                .collect();
            rows = sum_tied(group, &places, rows)?;
        }
        Ok((rows, self.end_step(&mut sets, spans, t0, exposed, peak)?))
    }

    /// The step's report; re-plans the buckets after the first hooked step (collective).
    fn end_step(
        &self,
        sets: &mut [ReduceSet],
        spans: Vec<(Instant, Instant)>,
        t0: Instant,
        exposed: Duration,
        peak_bytes: usize,
    ) -> Result<ReductionReport, ParallelError> {
        let step = std::mem::take(&mut *lock(&self.step));
        if step.hooked {
            for set in sets.iter_mut().filter(|s| !s.rebuilt) {
                self.rebuild(set)?;
            }
        }
        let end = step.backward_end.unwrap_or(t0);
        let before_end = |&(a, b): &(Instant, Instant)| match a < end {
            true => b.min(end) - a,
            false => Duration::ZERO,
        };
        Ok(ReductionReport {
            buckets: spans.len(),
            reduced_during_backward: step.reduced_during,
            comm: spans.iter().map(|(a, b)| *b - *a).sum(),
            overlapped: spans.iter().map(before_end).sum(),
            exposed,
            peak_bytes,
        })
    }

    /// Re-plans `set`'s buckets in the order its first rank's gradients arrived (broadcast,
    /// so every rank issues the same collectives), parameters that never arrived last, as
    /// PyTorch DDP rebuilds its buckets after the first iteration.
    fn rebuild(&self, set: &mut ReduceSet) -> Result<(), ParallelError> {
        let n = set.params.len();
        let mut seen = vec![false; n];
        let mut order: Vec<u64> = vec![];
        for p in set.reducer.arrival_order().into_iter().chain((0..n).rev()) {
            if !std::mem::replace(&mut seen[p], true) {
                order.push(p as u64);
            }
        }
        control(|| set.group.broadcast(&mut order, 0))?;
        let order: Vec<usize> = order.into_iter().map(|p| p as usize).collect();
        let layout = SetLayout {
            group: &set.group,
            params: &set.params,
            row_groups: set.row_groups.as_ref(),
            slots: &self.slots,
            shapes: &self.shapes,
            device: &self.device,
        };
        set.reducer = layout.reducer(&order, self.bucket_elems, self.mode, self.wire);
        set.rebuilt = true;
        Ok(())
    }
}

/// `flat` with the tied copies (each at `(offset, len)`) summed over their group, in f32.
fn sum_tied(
    group: &Group,
    places: &[(usize, usize)],
    flat: Tensor<1>,
) -> Result<Tensor<1>, ParallelError> {
    if places.is_empty() {
        return Ok(flat);
    }
    let packed = Tensor::cat(
        (places.iter())
            .map(|&(offset, len)| part(&flat, offset, len))
            .collect(),
        0,
    );
    let summed = group.all_reduce_tensor(packed, ReduceOp::Sum)?;
    let mut flat = flat;
    let mut at = 0;
    for &(offset, len) in places {
        let part = part(&summed, at, len);
        flat = flat.slice_assign(offset..offset + len, part);
        at += len;
    }
    Ok(flat)
}

/// Puts a gradient hook on every selected parameter a set reduces.
struct HookMapper<'a> {
    sets: &'a [ReduceSet],
    member: &'a [Option<(usize, usize)>],
    /// Which parameters (layout index) to hook.
    select: &'a dyn Fn(usize) -> bool,
    /// What the hooks run right after in backward, if not at its end.
    after: Option<&'a Tensor<1>>,
    index: usize,
}

impl ModuleMapper for HookMapper<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let index = self.index;
        self.index += 1;
        let member = self.member.get(index).copied().flatten();
        match member.filter(|_| (self.select)(index)) {
            Some((set, local)) => {
                let callback = self.sets[set].reducer.callback(local);
                match self.after {
                    Some(after) => param.map(|t| grad_hook_after(t, after.clone(), callback)),
                    None => param.map(|t| grad_hook(t, callback)),
                }
            }
            None => param,
        }
    }
}

/// Makes every selected parameter a set reduces a lazy one whose first read hooks it where
/// its placement says ([`BucketedReduction::hooked_at_reads`]).
struct ReadHookMapper<'a> {
    sets: &'a [ReduceSet],
    member: &'a [Option<(usize, usize)>],
    /// Which parameters (layout index) to hook.
    select: &'a dyn Fn(usize) -> bool,
    placement: Arc<ReadPlacement>,
    index: usize,
}

impl ModuleMapper for ReadHookMapper<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let index = self.index;
        self.index += 1;
        let member = self.member.get(index).copied().flatten();
        let Some((set, local)) = member.filter(|_| (self.select)(index)) else {
            return param;
        };
        let callback: GradCallback = self.sets[set].reducer.callback(local);
        // A view for one forward: the load and save mappers it drops are the stored model's.
        let (id, value, _) = param.consume();
        let (device, shape) = (value.device(), value.shape());
        let require_grad = value.is_require_grad();
        let placement = self.placement.clone();
        let first_read = move |_: &Device, _: bool| placement.hooked(value, callback);
        Param::uninitialized(id, first_read, device, require_grad, shape)
    }
}

impl crate::pipeline::BackwardSink for BucketedReduction {
    fn begin_backward(&self, last: bool) {
        self.begin_micro(last);
    }

    fn end_backward(&self) -> Result<(), ParallelError> {
        self.end_micro()
    }
}
