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

use super::reducer::{Mode, Reducer, Spans};
use crate::error::ParallelError;
use crate::hook::{grad_hook, hooks_supported};
use crate::params::ParamSlot;
use crate::placement::{DATA_AXES, ParamPlacement, Tie};
use crate::precision::{Precision, all_reduce_in};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;
use flashover_comm::{CommunicatorExt, Group};
use flashover_runtime::{Axis, RankContext};
use serde::{Deserialize, Serialize};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How a plan's gradients travel between ranks: in buckets of about `bucket_mb` MiB (f32
/// elements; a larger parameter gets a bucket of its own), reduced during backward where the
/// executor lets gradient hooks report them (`overlap`), else right after backward.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GradientBuckets {
    /// Target size of one bucket, in MiB of f32 gradient.
    pub bucket_mb: f64,
    /// Reduce buckets while backward runs (gradient hooks), where the executor and the device
    /// allow; the step's report says whether it did.
    pub overlap: bool,
}

impl Default for GradientBuckets {
    fn default() -> Self {
        GradientBuckets {
            bucket_mb: 4.0,
            overlap: true,
        }
    }
}

impl GradientBuckets {
    /// Buckets of `bucket_mb` MiB.
    pub fn bucket_mb(mut self, bucket_mb: f64) -> Self {
        self.bucket_mb = bucket_mb;
        self
    }

    /// Whether buckets are reduced while backward runs.
    pub fn overlap(mut self, overlap: bool) -> Self {
        self.overlap = overlap;
        self
    }

    /// Elements per bucket; fails when the size holds no f32.
    fn bucket_elems(&self) -> Result<usize, ParallelError> {
        let elems = (self.bucket_mb * (1 << 20) as f64 / 4.0) as usize;
        if self.bucket_mb.is_nan() || elems == 0 {
            return Err(ParallelError::Invalid(format!(
                "gradient buckets of {} MiB hold no f32: use a positive bucket_mb",
                self.bucket_mb
            )));
        }
        Ok(elems)
    }
}

/// What one step's gradient reduction did and cost on this rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReductionReport {
    /// Buckets reduced (over every set of axes).
    pub buckets: usize,
    /// Whether gradient hooks reported the gradients during backward (buckets could be reduced
    /// while it ran); `false`: they were reduced after it.
    pub hooked: bool,
    /// Time the communication threads spent reducing buckets.
    pub comm: Duration,
    /// The part of `comm` that ran before the last backward ended (hidden behind compute).
    pub overlapped: Duration,
    /// Time the training thread waited for the buckets after backward.
    pub exposed: Duration,
}

/// One set of data axes and the parameters reduced over exactly those.
struct ReduceSet {
    group: Group,
    /// The parameters (layout indices of the model), in the set's own numbering.
    params: Vec<usize>,
    reducer: Reducer,
    /// Whether its buckets were re-planned from the arrival order yet.
    rebuilt: bool,
}

/// A step in progress.
#[derive(Default)]
struct StepState {
    /// Whether this step's forwards ran on hooked parameters.
    hooked: bool,
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
    /// Tied copies: the group summing them and their layout indices.
    tie: Option<(Group, Vec<usize>)>,
    bucket_elems: usize,
    wire: Precision,
    overlap: bool,
    step: Mutex<StepState>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A group for every non-empty set of the data axes above degree 1 on `ctx`'s mesh, in one
/// order on every rank (collective over the world: making a group is).
pub(crate) fn reduction_groups(ctx: &RankContext) -> Result<Vec<(Vec<Axis>, Group)>, ParallelError> {
    let axes: Vec<Axis> = DATA_AXES
        .into_iter()
        .filter(|&a| ctx.mesh().degree(a) > 1)
        .collect();
    let mut groups = vec![];
    for mask in 1..(1usize << axes.len()) {
        let set: Vec<Axis> = (0..axes.len())
            .filter(|i| mask & (1 << i) != 0)
            .map(|i| axes[i])
            .collect();
        // A communicator of its own: the buckets' thread must not interleave its collectives
        // with another thread's on the same group (a unit's on `fsdp`, say).
        let group = ctx.subgroup(&set)?;
        groups.push((set, group));
    }
    Ok(groups)
}

impl BucketedReduction {
    /// The reduction of a model whose parameters `entries` lists (layout order, with their
    /// placements); `held[i]`: whether this rank holds parameter `i` (not a placeholder);
    /// `tie`: the group summing tied copies, if any. Collective over the world.
    pub(crate) fn new(
        ctx: &RankContext,
        entries: &[(ParamSlot, &ParamPlacement)],
        held: &[bool],
        tie: Option<&Group>,
        settings: GradientBuckets,
        wire: Precision,
    ) -> Result<Self, ParallelError> {
        let bucket_elems = settings.bucket_elems()?;
        let mesh = ctx.mesh();
        let mut members: Vec<Vec<usize>> = vec![];
        let groups = reduction_groups(ctx)?;
        let mut member = vec![None; entries.len()];
        for (i, (_, entry)) in entries.iter().enumerate() {
            let axes = entry.reduce_axes(mesh);
            if axes.is_empty() || !held.get(i).copied().unwrap_or(true) {
                continue;
            }
            let set = groups.iter().position(|(s, _)| *s == axes).expect("every subset");
            members.resize(groups.len(), vec![]);
            member[i] = Some((set, members[set].len()));
            members[set].push(i);
        }
        members.resize(groups.len(), vec![]);
        let slots: Vec<(usize, usize)> = entries.iter().map(|(s, _)| (s.offset, s.numel)).collect();
        let mut sets = vec![];
        let mut renumber = vec![usize::MAX; groups.len()];
        for (set, ((_, group), params)) in groups.into_iter().zip(members).enumerate() {
            if params.is_empty() {
                continue;
            }
            renumber[set] = sets.len();
            let numels: Vec<usize> = params.iter().map(|&i| slots[i].1).collect();
            let order: Vec<usize> = (0..params.len()).rev().collect();
            let reducer = Reducer::new(group.clone(), &numels, &order, bucket_elems, Mode::AllReduce, wire);
            sets.push(ReduceSet {
                group,
                params,
                reducer,
                rebuilt: false,
            });
        }
        for m in member.iter_mut().flatten() {
            m.0 = renumber[m.0];
        }
        let tied: Vec<usize> = (entries.iter().enumerate())
            .filter(|(_, (_, e))| e.tie != Tie::None)
            .map(|(i, _)| i)
            .collect();
        Ok(BucketedReduction {
            sets: Mutex::new(sets),
            member,
            slots,
            tie: tie.filter(|g| g.size() > 1 && !tied.is_empty()).map(|g| (g.clone(), tied)),
            bucket_elems,
            wire,
            overlap: settings.overlap,
            step: Mutex::new(StepState::default()),
        })
    }

    /// Whether this rank reduces anything over other ranks.
    fn reduces(&self) -> bool {
        !lock(&self.sets).is_empty()
    }

    /// Whether a step whose forwards run on `device` (an autodiff device) reports its
    /// gradients through hooks: overlap asked for, something to reduce, and a device the
    /// hook op is built for.
    pub(crate) fn hooks_on(&self, device: &burn::tensor::Device) -> bool {
        self.overlap && self.reduces() && hooks_supported(device)
    }

    /// Buckets per step, over every set of axes.
    pub(crate) fn buckets(&self) -> usize {
        lock(&self.sets).iter().map(|s| s.reducer.buckets().len()).sum()
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
            backward_end: None,
        };
    }

    /// Starts a micro-batch's backward: its complete buckets are reduced at once when it is
    /// the step's last (earlier ones accumulate).
    pub(crate) fn begin_micro(&self, last: bool) {
        for set in lock(&self.sets).iter() {
            set.reducer.begin_micro(last);
        }
    }

    /// `model` with a gradient hook on every parameter this rank reduces, each handing its
    /// gradient to its bucket (the parameter then receives none).
    pub(crate) fn hooked<M: Module>(&self, model: &M) -> M {
        let sets = lock(&self.sets);
        let mut mapper = HookMapper {
            sets: &sets,
            member: &self.member,
            index: 0,
        };
        model.clone().map(&mut mapper)
    }

    /// After the last micro-batch's backward: adds what the hooks did not report from `flat`
    /// (this rank's gradients in the model's layout, summed over the step's micro-batches;
    /// zero where hooks took them), so every bucket completes and is reduced (whether or not
    /// a micro-batch was marked last).
    pub(crate) fn add_remaining(&self, flat: &[f32]) {
        for set in lock(&self.sets).iter() {
            set.reducer.launch_all();
            let arrived = set.reducer.arrived();
            // Latest parameters first: the buckets fill in the order they are reduced.
            for (local, &i) in set.params.iter().enumerate().rev() {
                if !arrived[local] {
                    let (offset, numel) = self.slots[i];
                    set.reducer.add(local, &flat[offset..offset + numel]);
                }
            }
        }
        lock(&self.step).backward_end = Some(Instant::now());
    }

    /// Waits for every bucket and writes the sums into `flat` (the model's layout; the other
    /// parameters' values are left as they are), then sums the tied copies. Re-plans the
    /// buckets from the arrival order after the first hooked step (collective).
    pub(crate) fn finish(&self, flat: &mut [f32]) -> Result<ReductionReport, ParallelError> {
        let t0 = Instant::now();
        let mut sets = lock(&self.sets);
        let mut spans = vec![];
        for set in sets.iter() {
            let Spans { spans: s } = set.reducer.wait_reduced()?;
            spans.extend(s);
            for (local, values) in set.reducer.drain().into_iter().enumerate() {
                let (offset, numel) = self.slots[set.params[local]];
                flat[offset..offset + numel].copy_from_slice(&values);
            }
        }
        let exposed = t0.elapsed();
        if let Some((group, tied)) = &self.tie {
            self.sum_tied(group, tied, flat)?;
        }
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
            hooked: step.hooked,
            comm: spans.iter().map(|(a, b)| *b - *a).sum(),
            overlapped: spans.iter().map(before_end).sum(),
            exposed,
        })
    }

    /// Sums the tied copies over their group, in f32.
    fn sum_tied(&self, group: &Group, tied: &[usize], flat: &mut [f32]) -> Result<(), ParallelError> {
        let mut packed: Vec<f32> = tied
            .iter()
            .flat_map(|&i| {
                let (offset, numel) = self.slots[i];
                flat[offset..offset + numel].iter().copied()
            })
            .collect();
        all_reduce_in(group, &mut packed, Precision::F32)?;
        let mut at = 0;
        for &i in tied {
            let (offset, numel) = self.slots[i];
            flat[offset..offset + numel].copy_from_slice(&packed[at..at + numel]);
            at += numel;
        }
        Ok(())
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
        set.group.broadcast(&mut order, 0)?;
        let order: Vec<usize> = order.into_iter().map(|p| p as usize).collect();
        let numels: Vec<usize> = set.params.iter().map(|&i| self.slots[i].1).collect();
        set.reducer = Reducer::new(
            set.group.clone(),
            &numels,
            &order,
            self.bucket_elems,
            Mode::AllReduce,
            self.wire,
        );
        set.rebuilt = true;
        Ok(())
    }
}

/// Puts a gradient hook on every parameter a set reduces.
struct HookMapper<'a> {
    sets: &'a [ReduceSet],
    member: &'a [Option<(usize, usize)>],
    index: usize,
}

impl ModuleMapper for HookMapper<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let member = self.member.get(self.index).copied().flatten();
        self.index += 1;
        match member {
            Some((set, local)) => {
                let callback = self.sets[set].reducer.callback(local);
                param.map(|t| grad_hook(t, callback))
            }
            None => param,
        }
    }
}

impl crate::pipeline::BackwardSink for BucketedReduction {
    fn begin_backward(&self, last: bool) {
        self.begin_micro(last);
    }
}
