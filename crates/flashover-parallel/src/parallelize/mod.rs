//! Parallelize a user's own Burn model with a [`ParallelizePlan`], without changing it.
//!
//! ```text
//! let plan = ParallelizePlan::new().fully_shard("blocks").fully_shard("embed");
//! let (model, par) = parallelize(MyModel::new(&config, &device), &plan, &ctx)?;
//! for step in 0..steps {
//!     let (x, y) = my_batch(par.batch_share(global_batch, step)?);   // this rank's samples
//!     let loss = model.forward(x, y);                                // the unchanged forward
//!     println!("{}", par.mean_loss(loss.clone().into_scalar())?);   // the same on every rank
//!     let (grads, norm) = par.gradients(&model, loss.backward(), Some(1.0), &ctx)?;
//!     model = optim.step(lr, model, grads);                          // any Burn optimizer
//! }
//! ```
//!
//! What each mesh axis does to the model:
//! - `dp`: replicas; each reads its share of the batch; gradients averaged.
//! - `fsdp`: as `dp` for the batch; the plan's `fully_shard` modules keep `1/fsdp` of each
//!   parameter per rank (but see [`Parallelized::kept_whole`]), gathered where the forward reads them (Burn's parameter
//!   reparameterization, see [`placed`]), so the model's code does not change and any
//!   Burn optimizer steps the shards.
//! - `tp`: the plan's `tensor_parallel` linear layers hold their columns or rows
//!   ([`TpStyle`]); the model declares them as [`crate::nn::Linear`] (Burn's `Linear` with the
//!   collectives a split needs in its forward) and sizes its attention heads from the
//!   projection's local width ([`crate::nn::Linear::d_output`]). Every `tp` rank reads the
//!   same samples; the parameters outside the rules are computed identically on each.
//!
//! - `pp`: the plan's `pipeline` cuts the model's repeated layers into stages; each rank keeps
//!   its stages' parameters (placeholders for the rest) and trains through
//!   [`Parallelized::pipeline_step`], running its part of the forward ([`PipelineModel`]).
//!
//! - `cp`: the plan's `context_parallel` rule splits every sequence: each rank holds some of
//!   its positions ([`Parallelized::sequence_share`], [`Parallelized::positions`]) for the
//!   whole model, and the attention cores it names ([`crate::nn::CausalAttention`]) attend
//!   over the other ranks' keys and values. Losses and gradients are averaged over `cp` as
//!   over the data axes.
//!
//! - `ep`: the plan's `expert_parallel` layers ([`flashover_models::Moe`]) keep `1/ep` of their
//!   routed experts per rank (placeholders for the rest), and their forward
//!   ([`crate::nn::MoeForward`]) sends each token to the rank holding its expert and back.
//!   `ep` ranks read different samples, as `dp` ranks do.
//!
//! A mesh with `tp`, `pp`, `cp` or `ep` is refused when the plan has no rule for that axis: the
//! model would run unsplit on its ranks, each repeating the others' work.

mod experts;
mod loop_overlap;
mod mixed_precision;
pub mod pipeline;
pub mod placed;
mod plan;
mod sequence_check;
pub mod transformer;
pub(crate) mod units;
mod validate;

pub use pipeline::PipelineModel;
pub use placed::{ContextSplit, ExpertSplit, Placed, TpSplit, local_value, tp_split};
pub use plan::{
    ContextParallelRule, ModulePath, ParallelizePlan, PipelineRule, TensorParallelRule, TpStyle,
};

use crate::clip_scale;
use crate::data_parallel::{
    BucketedReduction, GradientRowLayout, ReductionReport, ReductionTiming,
};
use crate::error::ParallelError;
use crate::params::{
    ParamLayout, ParamSlot, accumulate_grads, broadcast_module, flatten_params, grads_from_flat,
    load_shaped, placeholders_except,
};
use crate::pipeline::PipelineStepReport;
use crate::placement::{ParamPlacement, Placement, PlacementTable, global_grad_norm};
use crate::precision::{LossScaler, MixedPrecision};
use crate::zero::ShardGroup;
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Int, Tensor, TensorData};
use experts::{ExpertShares, Experts};
use flashover_comm::{CommunicatorExt, Group, ReduceOp};
use flashover_runtime::{Axis, RankContext};
use pipeline::Stages;
use placed::{Elsewhere, WholeReads};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;
use units::FullyShardedUnits;
use units::UnitGathers;

/// The axes whose ranks read different samples.
const DATA_AXES: [Axis; 3] = [Axis::Dp, Axis::Fsdp, Axis::Ep];

/// What [`parallelize`] did to a model, and the per-step helpers that follow from it.
pub struct Parallelized {
    placements: PlacementTable,
    /// Every gradient summed over the ranks its placement says, in buckets.
    buckets: BucketedReduction,
    /// The ranks that read different samples (`dp` x `fsdp` x `ep`), in which this rank is
    /// `data.rank()`.
    data: Group,
    /// The ranks whose mean losses make the whole batch's (`dp` x `fsdp` x `ep` x `cp`): each
    /// holds as many of the batch's tokens.
    averaged: Group,
    /// The sequence split, when the plan splits sequences over `cp` on this mesh.
    context: Option<ContextSplit>,
    whole_reads: WholeReads,
    /// The pipeline's stages, when the plan has one.
    stages: Option<Stages>,
    /// Which experts this rank holds, when the plan spreads them over `ep`.
    experts: Option<ExpertShares>,
    /// Token rows the `expert_parallel` layers sent to other `ep` ranks.
    expert_traffic: Arc<crate::expert_parallel::ExpertTraffic>,
    /// The parameters this rank keeps placeholders for (other stages', other ep ranks'
    /// experts), by path.
    absent: HashSet<String>,
    /// For a model cut into stages or experts: the ranks that hold its other parts (`pp` x
    /// `ep`), which `whole` gathers over, and the whole model's parameters.
    held_elsewhere: Option<(Group, ParamLayout)>,
    /// Parameters under `fully_shard` paths left whole, with the layer type that needs it.
    kept_whole: BTreeMap<String, &'static str>,
    /// Under sequence parallelism, the first step's check that every whole parameter that runs
    /// on sequence shards is named.
    sequence_check: Option<sequence_check::SequenceCheck>,
    /// The fully sharded units (one collective per unit inside [`Self::forward`]).
    units: FullyShardedUnits,
    /// With sequences split over `cp`: the attention work counted at the last reduction (each
    /// step must attend across the ranks, or its positions saw only their own).
    attended: std::sync::Mutex<u64>,
    /// The plan's mixed precision (f32 throughout without one) and its running loss scale.
    precision: mixed_precision::PlanPrecision,
    /// Under `replicate_hot_experts` (with more than one `ep` rank): the step's hot-expert
    /// copies and the `ep` group their gradients are summed over.
    hot_experts: Option<(crate::expert_parallel::Replicas, Group)>,
    /// Where a loop of one's own is in its step, for gradient buckets reduced during its
    /// backward ([`Self::forward`] on hooked parameters).
    loop_overlap: loop_overlap::LoopOverlap,
    /// What the last gradient reduction did and cost.
    last_reduction: std::sync::Mutex<ReductionReport>,
}

/// What one run of a rank's pipeline stages computed.
struct StagesRun {
    /// This rank's gradients in the model's layout, not yet reduced: sums over the
    /// micro-batches of the scaled losses' gradients (zero where hooks took them).
    flat: Vec<f32>,
    /// What `flat` is divided by to make it the unscaled mean over micro-batches.
    divisor: f32,
    /// The share's mean loss and auxiliary loss (the same on every rank of `pp`).
    losses: [f32; 2],
    report: PipelineStepReport,
    recomputed: usize,
}

/// What one [`Parallelized::pipeline_step`] (or [`Parallelized::pipeline_gradients`])
/// computed.
pub struct PipelineStep {
    /// This rank's gradients, reduced and clipped as [`Parallelized::gradients`] returns them.
    pub grads: GradientsParams,
    /// The whole batch's mean loss (of `head_loss`: layers' auxiliary losses are left out),
    /// the same on every rank.
    pub loss: f32,
    /// The whole batch's mean of the layers' auxiliary losses ([`PipelineModel::layer_with_aux`];
    /// 0 without any): `loss + aux_loss` is the objective trained.
    pub aux_loss: f32,
    /// The global gradient norm before clipping (NaN from
    /// [`Parallelized::pipeline_gradients`], which does not reduce them).
    pub norm: f32,
    /// What the schedule measured on this rank (time in forwards, backwards and waits).
    pub report: PipelineStepReport,
    /// Layer forwards this rank ran again in backward (the plan's activation checkpointing).
    pub recomputed: usize,
    /// The loss scale the step ran with, under a plan whose `mixed_precision` scales the
    /// loss.
    pub loss_scale: Option<f32>,
    /// Whether the step's gradients overflowed under loss scaling: `grads` is then empty (an
    /// optimizer step with it changes no parameter) and a dynamic scale was halved.
    pub skipped: bool,
    /// What the gradient reduction did and cost (empty from
    /// [`Parallelized::pipeline_gradients`], which does not reduce).
    pub reduction: ReductionReport,
    /// Under the plan's `gradient_buckets.rows` (ZeRO-1/2): this rank's rows of the reduced,
    /// clipped gradients, laid out as [`Parallelized::gradient_rows`] says (`grads` is then
    /// empty); empty otherwise.
    pub rows: Vec<f32>,
}

/// Applies `plan` to `model` on this rank: the whole model as world rank 0 holds it
/// (collective: every rank calls it with a model of the same structure), then each
/// `tensor_parallel` layer cut to this rank's columns or rows over `tp`, then each
/// `fully_shard` module's parameters cut by rows over `fsdp`. Fails, naming the path and the
/// reason, when the plan does not fit the model (a path that names nothing, a
/// tensor-parallel path that is not a linear layer, a width that does not divide), and,
/// naming the axis, when the mesh has an axis the plan does not split the model over.
pub fn parallelize<M: Module>(
    model: M,
    plan: &ParallelizePlan,
    ctx: &RankContext,
) -> Result<(M, Parallelized), ParallelError> {
    check_axes(plan, ctx)?;
    let policy = plan.mixed_precision.unwrap_or_default();
    policy.check(ctx.device())?;
    let tp = ctx.group(Axis::Tp).clone();
    let layout = ParamLayout::of(&model);
    validate::check_plan(plan, &layout.slots, Some(tp.size()))?;
    let experts = Experts::of(&model, plan, &layout, ctx.group(Axis::Ep))?;
    let mut stages = match &plan.pipeline {
        Some(rule) => Some(Stages::new(
            rule,
            &plan.activation_checkpointing,
            layout.clone(),
            ctx.group(Axis::Pp),
        )?),
        None => None,
    };
    let mut placements = PlacementTable::whole(&model);
    let model = broadcast_module(model, ctx.world(), 0)?;
    let absent = held_elsewhere(
        stages.as_ref(),
        experts.shares.as_ref(),
        &layout,
        &mut placements,
    )?;
    let model = placeholders_except(model, &absent.held);
    let whole_reads = WholeReads::default();
    let units = UnitGathers::default();
    // Routed experts are sharded too: their layer gathers them all at once on every rank,
    // whatever the routing (`nn::MoeForward`).
    let kept_whole = if plan.fully_shard.is_empty() {
        Default::default()
    } else {
        placed::reads_stored_shape(&model)
    };
    let context = plan
        .context_parallel
        .as_ref()
        .filter(|_| ctx.group(Axis::Cp).size() > 1)
        .map(|rule| ContextSplit::new(ctx.group(Axis::Cp), rule));
    let mut error = None;
    let mut sequence_partial = std::collections::HashSet::new();
    let place = placed::PlaceParams {
        plan,
        fsdp: ctx.group(Axis::Fsdp).clone(),
        tp: tp.clone(),
        context: context.as_ref(),
        routers: &experts.routers,
        all_routers: &experts.all_routers,
        placements: &mut placements,
        whole_reads: whole_reads.clone(),
        units: units.clone(),
        absent: &absent.by_path,
        kept_whole: &kept_whole,
        sequence_partials: &mut sequence_partial,
        error: &mut error,
    };
    let model = model.apply_reparameterization(place);
    if let Some(e) = error {
        return Err(e);
    }
    let sharded = rows_over_fsdp(&placements, &layout);
    experts.check_unsharded(&layout, &sharded)?;
    if let Some(stages) = &mut stages {
        // A pipeline's layers are units: each gathers its sharded parameters at once.
        if stages.splits_backward() && sharded.iter().any(|s| *s) {
            return Err(ParallelError::Invalid(
                "pipeline schedule: zb-h1 defers a layer's weight gradient past the layer's \
                 backward, where a fully sharded weight's gradient is reduce-scattered to its \
                 shards: use zb-h1 without fully_shard, or 1f1b with it"
                    .into(),
            ));
        }
        stages.gather_layers(units.clone(), ctx.group(Axis::Fsdp), &sharded);
        stages.compute_in(policy);
        if let Some((copies, _)) = &experts.hot {
            stages.hand_gradients_to(copies.clone());
        }
    }
    // The units: every sharded parameter this rank holds (not another stage's or ep rank's).
    let held_shards = layout.slots.iter().zip(&sharded).map(|(s, &sharded)| {
        (sharded && !absent.by_path.contains_key(&s.name)).then_some(s.name.as_str())
    });
    // Units gather in the compute dtype (rounded first: what the compute view reads) and
    // reduce-scatter in the reduction's, as FSDP2's policy does.
    let comm = (ctx.group(Axis::Fsdp).size() > 1).then(|| {
        ShardGroup::with_precision(
            ctx.group(Axis::Fsdp),
            policy.param_dtype,
            policy.reduce_dtype,
        )
    });
    let units = FullyShardedUnits::new(plan, &layout, held_shards, units, comm);
    let buckets = BucketedReduction::new(
        ctx,
        &placements.entries_of(&model)?,
        &absent.held,
        stages.as_ref().and_then(Stages::tie_group),
        plan.gradient_buckets,
        policy.reduce_dtype,
    )?;
    let par = Parallelized {
        placements,
        buckets,
        data: ctx.subgroup(&DATA_AXES)?,
        averaged: ctx.subgroup(&[Axis::Dp, Axis::Fsdp, Axis::Ep, Axis::Cp])?,
        context,
        whole_reads,
        held_elsewhere: match stages.is_some() || experts.shares.is_some() {
            true => Some((ctx.subgroup(&[Axis::Pp, Axis::Ep])?, layout)),
            false => None,
        },
        absent: absent.by_path.into_keys().collect(),
        stages,
        expert_traffic: experts.traffic.clone(),
        experts: experts.shares,
        kept_whole,
        sequence_check: (tp.size() > 1 && !plan.sequence_parallel.is_empty())
            .then(|| sequence_check::SequenceCheck::new(tp.clone(), sequence_partial)),
        units,
        attended: Default::default(),
        precision: mixed_precision::PlanPrecision::new(policy),
        hot_experts: experts
            .hot
            .map(|(replicas, _)| (replicas, ctx.group(Axis::Ep).clone())),
        loop_overlap: Default::default(),
        last_reduction: Default::default(),
    };
    Ok((model, par))
}

/// Per parameter of `layout`, whether `placements` cut its rows over `fsdp`.
fn rows_over_fsdp(placements: &PlacementTable, layout: &ParamLayout) -> Vec<bool> {
    let sharded = |s: &ParamSlot| {
        placements
            .get(s.id)
            .is_some_and(|e| e.on(Axis::Fsdp) != Placement::Replicate)
    };
    layout.slots.iter().map(sharded).collect()
}

/// The parameters other ranks hold: by path with why, and per parameter (layout order)
/// whether this rank holds it.
struct Absent {
    by_path: HashMap<String, Elsewhere>,
    held: Vec<bool>,
}

/// What other ranks hold of a model of parameters `whole` (other pipeline stages'
/// parameters, other ep ranks' experts), recorded in `placements` as owned over `pp` and `ep`.
fn held_elsewhere(
    stages: Option<&Stages>,
    shares: Option<&ExpertShares>,
    whole: &ParamLayout,
    placements: &mut PlacementTable,
) -> Result<Absent, ParallelError> {
    if let Some(stages) = stages {
        stages.place(placements)?;
    }
    if let Some(shares) = shares {
        shares.place(whole, placements)?;
    }
    let mut absent = Absent {
        by_path: HashMap::new(),
        held: vec![true; whole.slots.len()],
    };
    for (i, slot) in whole.slots.iter().enumerate() {
        let why = if stages.is_some_and(|s| !s.held[i]) {
            Elsewhere::Stage
        } else if shares.is_some_and(|e| !e.held[i]) {
            Elsewhere::Expert
        } else {
            continue;
        };
        absent.held[i] = false;
        absent.by_path.insert(slot.name.clone(), why);
    }
    Ok(absent)
}

/// Refuses a mesh axis the plan does not split the model over: its ranks would run the model
/// unsplit, repeating each other's work.
fn check_axes(plan: &ParallelizePlan, ctx: &RankContext) -> Result<(), ParallelError> {
    for axis in Axis::ALL {
        let degree = ctx.mesh().degree(axis);
        if degree == 1 || [Axis::Dp, Axis::Fsdp].contains(&axis) {
            continue;
        }
        let why = match axis {
            Axis::Tp if !plan.tensor_parallel.is_empty() => continue,
            Axis::Tp => "the plan splits no layer over tp (add tensor_parallel rules)",
            Axis::Pp if plan.pipeline.is_some() => continue,
            Axis::Pp => "the plan has no pipeline (add a pipeline rule)",
            Axis::Cp if plan.context_parallel.is_some() => continue,
            Axis::Ep if !plan.expert_parallel.is_empty() => continue,
            Axis::Ep => {
                "the plan spreads no experts over ep (add expert_parallel naming the \
                 mixture-of-experts layers)"
            }
            Axis::Cp => {
                "the plan splits no sequence over cp (add a context_parallel rule naming the \
                 attention cores)"
            }
            _ => "parallelize plans split a model over dp, fsdp, tp, pp, cp and ep only",
        };
        return Err(ParallelError::Invalid(format!(
            "the mesh has {}={degree}, but {why}: the model would run unsplit on the {} ranks, \
             each repeating the others' work",
            axis.name(),
            axis.name()
        )));
    }
    Ok(())
}

impl Parallelized {
    /// Where every parameter of the parallelized model lives (for norms, checkpoints).
    pub fn placements(&self) -> &PlacementTable {
        &self.placements
    }

    /// The parameters under the plan's `fully_shard` paths that stay whole, each with the Burn
    /// layer it belongs to: layers whose forward reads the parameter's stored shape
    /// (`RmsNorm`, `BatchNorm`, `PositionWiseFeedForward` in Burn 0.22.1), which a shard would
    /// answer wrongly. Empty for most models. (Mixture-of-experts layers' routed experts are
    /// sharded: `nn::MoeForward` gathers them all before routing, on every rank.)
    pub fn kept_whole(&self) -> &BTreeMap<String, &'static str> {
        &self.kept_whole
    }

    /// The parameters of `model` this rank holds (all but other pipeline stages'
    /// placeholders), each with its slot in `model`'s flat layout and its placement: what a
    /// checkpoint saves and restores on this rank.
    pub fn held_entries<'a, M: Module>(
        &'a self,
        model: &M,
    ) -> Result<Vec<(ParamSlot, &'a ParamPlacement)>, ParallelError> {
        Ok(self
            .placements
            .entries_of(model)?
            .into_iter()
            .filter(|(slot, _)| !self.absent.contains(&slot.name))
            .collect())
    }

    /// The whole model on every rank: each split or sharded parameter gathered, each
    /// pipeline stage's parameters from the rank that holds them (collective: every rank
    /// calls it). To read or export the weights, or to evaluate on one rank. The parameters
    /// are new leaves (their gradient requirement kept): nothing differentiates through the
    /// gathers.
    pub fn whole<M: Module>(&self, model: M) -> Result<M, ParallelError> {
        let model = {
            let _allowed = self.whole_reads.allow();
            model.materialize()
        };
        let Some((group, whole)) = &self.held_elsewhere else {
            return Ok(model);
        };
        // Each parameter counted on one rank of pp x ep: its stage's, its expert's holder.
        let counted = |i: usize| {
            self.stages.as_ref().is_none_or(|s| s.counts(i))
                && self.experts.as_ref().is_none_or(|e| e.counts(i))
        };
        let local = ParamLayout::of(&model);
        let values = sum_counted(whole, &flatten_params(&model), &local, counted, group)?;
        Ok(load_shaped(model, whole, &values))
    }

    /// `f(model)`, the model's forward, with the plan's fully sharded units gathered a unit at
    /// a time: the first read of a unit's parameter all-gathers every parameter of the unit
    /// in one collective, and submits the all-gather of the next unit (in the model's
    /// parameter order), which runs on this rank's communication thread while the unit
    /// computes (FSDP2's forward prefetch; Burn has no module hooks to start it from). Each
    /// element of the first list of layers inside a `fully_shard` module is a unit, the rest
    /// of the module another (`fully_shard("")`: `blocks.0`, `blocks.1`, ... and the
    /// embedding, final norm and head together); [`Self::units`] lists them. Outside it,
    /// each parameter is gathered where it is read, one collective per parameter: the same
    /// values, more collectives. The gathered parameters are kept until backward has used
    /// them, as without units. Under the plan's `mixed_precision`, `f` computes on
    /// [`MixedPrecision::compute_view`] of the model (every float parameter cast inside the
    /// graph, so gradients reach the f32 parameters in f32; cast float inputs yourself), and
    /// the units are all-gathered in the compute dtype. Where the plan's gradient buckets can
    /// be reduced during backward ([`Self::gradient_buckets`]), `f` computes on parameters
    /// whose gradient hooks hand each gradient to its bucket (see [`Self::gradients`]). Fails
    /// when a step runs more micro-batches than the step before under that overlap, when `f`
    /// runs inside another `forward`, or when a prefetch failed; a failed gather inside `f` panics with the collective's
    /// error, which the launcher reports. A plan cut into pipeline stages runs its layers as
    /// units in [`Self::pipeline_step`] instead.
    pub fn forward<M: Module, T>(
        &self,
        model: &M,
        f: impl FnOnce(&M) -> T,
    ) -> Result<T, ParallelError> {
        if self.is_pipelined() {
            return Err(ParallelError::Invalid(
                "the plan cuts the model into pipeline stages: a rank's forward is a stage's, \
                 so train with Parallelized::pipeline_step, which gathers each layer as a unit"
                    .into(),
            ));
        }
        let hooked;
        let model = match self.loop_hooks_ruled_out(model) {
            None => {
                self.loop_overlap.before_forward(&self.buckets)?;
                hooked = self.buckets.hooked(model);
                &hooked
            }
            Some(_) => model,
        };
        // The view inside the scope: the units gather the stored f32 shards, each read is cast,
        // and the reduce-scattered gradient reaches the shard in f32 (a scope over the view
        // would round it to the compute dtype once more).
        self.units
            .forward(model, |m| match self.precision.forward_view(m) {
                Some(view) => f(&view),
                None => f(m),
            })
    }

    /// Why the forward of a loop of one's own does not run on hooked parameters that hand
    /// their gradients to the buckets during backward, or `None` when it does.
    fn loop_hooks_ruled_out<M: Module>(&self, model: &M) -> Option<&'static str> {
        let Some(device) = model.devices().into_iter().next() else {
            return Some("the model has no parameters");
        };
        match self.gradient_buckets(&device).1 {
            ReductionTiming::AfterBackward(why) => Some(why),
            ReductionTiming::DuringBackward => None,
        }
    }

    /// `loss.backward()`, with the loss first scaled by the running loss scale when the plan's
    /// `mixed_precision` scales it (f16): [`Self::gradients`] then unscales the gradients and
    /// skips a step that overflowed. Take every backward of a step with it under such a
    /// plan (the reduction refuses gradients of an unscaled loss there). Under
    /// `replicate_hot_experts` it also takes the hot-expert copies' gradients for the
    /// reduction (which refuses a step whose copies' gradients it did not get).
    pub fn backward(&self, loss: Tensor<1>) -> Gradients {
        let mut grads = self.precision.backward(loss);
        if let Some((replicas, _)) = &self.hot_experts {
            replicas.take_grads(&mut grads);
        }
        grads
    }

    /// The plan's precision policy (f32 throughout without `mixed_precision`).
    pub fn precision(&self) -> MixedPrecision {
        self.precision.policy()
    }

    /// The plan's fully sharded units on this rank, by module path, in the order
    /// [`Self::forward`] prefetches them.
    pub fn units(&self) -> &[String] {
        self.units.paths()
    }

    /// The counters of this rank's unit collectives (all-gathers, prefetches, reduce-scatters,
    /// gathered bytes alive and at most), when the plan shards parameters over `fsdp`.
    pub fn unit_stats(&self) -> Option<&crate::zero::GatherStats> {
        self.units.stats()
    }

    /// `f` run with every parameter of the parallelized model reading as what this rank
    /// stores (its shard or split part, a placeholder's zeros) through `Param::val`, with no
    /// collective: for code that records a module's parameters as they are stored, such as
    /// Burn's `Module::into_record` of this rank's part. Not for a forward.
    pub fn with_stored_reads<T>(&self, f: impl FnOnce() -> T) -> T {
        let _stored = self.whole_reads.stored_parts();
        f()
    }

    /// This rank's samples of step `step`, numbered over the whole run: step `s`'s batch is
    /// samples `s * global_batch .. (s + 1) * global_batch` of the data set, and each data
    /// rank (`dp` x `fsdp` x `ep`) takes a contiguous share of it (rank 1 of 2 at step 1 of a batch
    /// of 8: `12..16`). Fails when the batch does not split evenly, and when the plan cuts the
    /// model into pipeline stages (a rank's forward is then a stage's:
    /// [`Self::pipeline_step`] reads the batch and runs the schedule).
    pub fn batch_share(
        &self,
        global_batch: usize,
        step: usize,
    ) -> Result<Range<usize>, ParallelError> {
        if self.is_pipelined() {
            return Err(ParallelError::Invalid(
                "the plan cuts the model into pipeline stages: a rank's forward is a stage's, \
                 so train with Parallelized::pipeline_step, which reads each micro-batch and \
                 runs the schedule"
                    .into(),
            ));
        }
        self.share(global_batch, step)
    }

    /// [`Self::batch_share`], pipelined or not.
    fn share(&self, global_batch: usize, step: usize) -> Result<Range<usize>, ParallelError> {
        let n = self.data.size();
        if !global_batch.is_multiple_of(n) {
            return Err(ParallelError::Invalid(format!(
                "a global batch of {global_batch} samples does not split over {n} data-parallel \
                 ranks (dp x fsdp x ep): use a multiple of {n}"
            )));
        }
        let per = global_batch / n;
        let start = step * global_batch + self.data.rank() * per;
        Ok(start..start + per)
    }

    /// The mean over the data ranks (and, with context parallelism, the `cp` ranks) of each
    /// rank's mean `loss`: the loss of the whole batch, the same on every rank (collective
    /// over `dp` x `fsdp` x `ep` x `cp`).
    pub fn mean_loss(&self, loss: f32) -> Result<f32, ParallelError> {
        let mut value = [loss];
        self.mean_over_ranks(&mut value)?;
        Ok(value[0])
    }

    /// [`Self::mean_loss`] of several values at once.
    fn mean_over_ranks(&self, values: &mut [f32]) -> Result<(), ParallelError> {
        if self.averaged.size() > 1 {
            self.averaged.all_reduce(values, ReduceOp::Avg)?;
        }
        Ok(())
    }

    /// This rank's positions of `x`'s sequences along dimension `dim` (`x: [batch, seq]`
    /// tokens or targets, `dim = 1`): all of them, or, when the plan splits sequences over
    /// `cp`, the positions [`Self::positions`] lists, in that order. Fails when the sequence
    /// does not cut into the rank's chunks.
    pub fn sequence_share<const D: usize, K>(
        &self,
        x: Tensor<D, K>,
        dim: usize,
    ) -> Result<Tensor<D, K>, ParallelError>
    where
        K: burn::tensor::kind::Basic,
    {
        if self.context.is_none() {
            return Ok(x);
        }
        let positions: Vec<i64> = self
            .positions(x.dims()[dim])?
            .into_iter()
            .map(|p| p as i64)
            .collect();
        let len = positions.len();
        let index = Tensor::<1, Int>::from_data(TensorData::new(positions, [len]), &x.device());
        Ok(x.select(dim, index))
    }

    /// `ctx` with attention over whole sequences of `seq` positions across the `cp` ranks
    /// (`heads` attention heads on this rank: the model's, divided by `tp` where the plan splits
    /// them), and this rank's positions for rotary embeddings: for a model whose attention
    /// runs through a [`flashover_models::ForwardContext`] (the reference transformer:
    /// [`transformer::split_sequences`]) rather than through
    /// [`crate::nn::CausalAttention`] cores, under a `context_parallel` rule that names none
    /// (`ContextParallelRule::ring(&[])`). `ctx` itself without a sequence split. Fails when
    /// the sequence or the heads do not cut over `cp`.
    pub fn context_forward(
        &self,
        ctx: flashover_models::ForwardContext,
        seq: usize,
        heads: usize,
    ) -> Result<flashover_models::ForwardContext, ParallelError> {
        match &self.context {
            None => Ok(ctx),
            Some(split) => Ok(split.attention(seq, heads)?.forward_context(ctx)),
        }
    }

    /// The attention this rank has computed across the `cp` ranks so far (scores, and the
    /// time in attention blocks), when the plan splits sequences on this mesh: per-rank
    /// attention work for reports (load balancing shows in it).
    pub fn attention_work(&self) -> Option<crate::context_parallel::AttentionWork> {
        self.context.as_ref().map(ContextSplit::work)
    }

    /// Fails when sequences are split over `cp` and no attention reached across the ranks
    /// since the last check (on any pipeline stage): the model computed each rank's
    /// positions alone, which no reduction can repair. Collective over `pp` when pipelined.
    fn check_attended(&self) -> Result<(), ParallelError> {
        let Some(split) = &self.context else {
            return Ok(());
        };
        let now = split.attended();
        let mut seen = self.attended.lock().unwrap_or_else(|p| p.into_inner());
        let mut advanced = [u64::from(now != *seen)];
        *seen = now;
        if let Some(pp) = self.pipeline_ranks() {
            pp.all_reduce(&mut advanced, ReduceOp::Max)?;
        }
        match advanced[0] {
            0 => Err(ParallelError::Invalid(
                "the plan splits sequences over cp, but no attention attended across the cp \
                 ranks this step: each rank's positions saw only each other. Name the \
                 attention cores (flashover::nn::CausalAttention) in context_parallel's \
                 `attention`, or run the forward in Parallelized::context_forward's context"
                    .into(),
            )),
            _ => Ok(()),
        }
    }

    /// The positions of a `seq`-long sequence this rank computes, in the order its share
    /// holds them ([`Self::sequence_share`]): `0..seq`, or with context parallelism this
    /// rank's chunks (for position embeddings and rotary tables). Fails when `seq` does not cut
    /// into `cp` equal shares (`2 x cp` chunks when load-balanced).
    pub fn positions(&self, seq: usize) -> Result<Vec<usize>, ParallelError> {
        match &self.context {
            None => Ok((0..seq).collect()),
            Some(split) => Ok(split.layout(seq)?.positions(split.group.rank())),
        }
    }

    /// The gradients of the whole batch's mean loss for this rank's parameters, from
    /// `backward` of this rank's mean loss: summed over the ranks that hold the same values
    /// and read different samples (the placements say which) and divided by the number of
    /// data ranks. Then, with `max_norm`, clipped by their global norm (every element of the
    /// whole model counted once): scaled by `max_norm / (norm + 1e-6)` when `norm > max_norm`,
    /// as [`crate::clip_global_norm`] does on one device. Returns them with the norm before
    /// clipping. Under a `mixed_precision` that scales the loss, the gradients of
    /// [`Self::backward`] are unscaled first, and a step whose norm overflowed (not finite)
    /// returns no gradients (an optimizer step with them changes nothing) and moves the
    /// scale. Fails under a `mixed_precision` whose forward ran outside [`Self::forward`] or
    /// whose backward did not scale the loss. Collective: every rank calls it once per step.
    ///
    /// When the step's forwards ran through [`Self::forward`], the buckets are filled by
    /// gradient hooks while backward runs, and from the second step on the backward of the
    /// step's last micro-batch (as many as the step before ran: a forward, then its backward)
    /// reduces each bucket as it completes, as DDP does ([`Self::gradient_buckets`] says
    /// whether, [`Self::last_reduction`] how much ran before backward ended). Forwards that
    /// run outside it are reduced after backward, in the same order with the same sums.
    pub fn gradients<M: Module>(
        &self,
        model: &M,
        backward: Gradients,
        max_norm: Option<f32>,
        ctx: &RankContext,
    ) -> Result<(GradientsParams, f32), ParallelError> {
        let grads = self.taken_gradients(model, backward)?;
        self.reduce_gradients(model, grads, max_norm, ctx)
    }

    /// [`Self::gradients`] under the plan's `gradient_buckets.rows` (ZeRO-1/2 in a loop of
    /// one's own): this rank's rows of the reduced, clipped gradients, laid out as
    /// [`Self::gradient_rows`] says (what [`crate::zero::RowAdamW::step`] steps), with the
    /// norm before clipping. The rows are empty on a step whose scaled gradients overflowed.
    /// Fails without `gradient_buckets.rows`, and under a pipelined plan (whose rows come in
    /// [`PipelineStep::rows`]). Collective: every rank calls it once per step.
    pub fn row_gradients<M: Module>(
        &self,
        model: &M,
        backward: Gradients,
        max_norm: Option<f32>,
        ctx: &RankContext,
    ) -> Result<(Vec<f32>, f32), ParallelError> {
        let grads = self.taken_gradients(model, backward)?;
        let reduced = self.reduce_taken(model, grads, max_norm, ctx, true)?;
        Ok((reduced.rows, reduced.norm))
    }

    /// The gradients of `model`'s parameters in `backward` (hot-expert copies' taken for their
    /// owners first). Fails under a pipelined plan.
    fn taken_gradients<M: Module>(
        &self,
        model: &M,
        mut backward: Gradients,
    ) -> Result<GradientsParams, ParallelError> {
        if let Some((replicas, _)) = &self.hot_experts {
            replicas.take_grads(&mut backward);
        }
        if self.is_pipelined() {
            return Err(ParallelError::Invalid(
                "the plan cuts the model into pipeline stages: a rank's forward is a stage's, \
                 so train with Parallelized::pipeline_step, which runs the schedule"
                    .into(),
            ));
        }
        Ok(GradientsParams::from_grads(backward, model))
    }

    /// [`Self::gradients`] of gradients already taken from the backward pass (what a
    /// burn-train `TrainStep` returns, or several passes' accumulated); under a pipelined
    /// plan, of [`Self::pipeline_gradients`] (tied copies summed too). Collective.
    pub fn reduce_gradients<M: Module>(
        &self,
        model: &M,
        grads: GradientsParams,
        max_norm: Option<f32>,
        ctx: &RankContext,
    ) -> Result<(GradientsParams, f32), ParallelError> {
        let reduced = self.reduce_taken(model, grads, max_norm, ctx, false)?;
        Ok((reduced.grads, reduced.norm))
    }

    /// `grads` (taken from the backward pass) reduced and clipped after backward: whole, or
    /// as this rank's rows when `rows` (which must match the plan's `gradient_buckets.rows`).
    fn reduce_taken<M: Module>(
        &self,
        model: &M,
        grads: GradientsParams,
        max_norm: Option<f32>,
        ctx: &RankContext,
        rows: bool,
    ) -> Result<Reduced, ParallelError> {
        // A pipeline's stages computed in the policy and unscaled their gradients themselves.
        let unscale = match self.is_pipelined() {
            true => None,
            false => self.precision.begin_reduction()?,
        };
        // Parameters without a gradient contribute zeros: every rank reduces the same layout.
        let mut flat = vec![0.0; ParamLayout::of(model).numel];
        accumulate_grads(model, &grads, &mut flat, &[]);
        if !self.is_pipelined() {
            // The copies' gradients are summed like the model's (scaled alike under f16).
            self.fold_hot_experts(model, &mut flat, 1.0)?;
        }
        match (self.buckets.row_layout().is_some(), rows) {
            (true, false) => {
                return Err(ParallelError::Invalid(
                    "the plan keeps gradient rows (gradient_buckets.rows, ZeRO-1/2): take them \
                     with Parallelized::row_gradients (a pipeline's come in \
                     PipelineStep::rows), or leave gradient_buckets.rows unset for whole \
                     gradients"
                        .into(),
                ));
            }
            (false, true) => {
                return Err(ParallelError::Invalid(
                    "Parallelized::row_gradients: the plan keeps no gradient rows; set its \
                     gradient_buckets.rows (ZeRO-1/2), or take whole gradients with \
                     Parallelized::gradients"
                        .into(),
                ));
            }
            _ => {}
        }
        // Unless the forwards ran on hooked parameters, the buckets are filled and reduced now.
        if !self.loop_overlap.end_step() {
            self.buckets.begin_step(false);
        }
        self.reduce_and_clip(model, flat, unscale.unwrap_or(1.0), max_norm, ctx)
    }

    /// The whole batch's routing loads of a step, the same on every rank: `stats`, what this
    /// rank's forwards counted ([`crate::nn::MoeForward::forward_counted`] into a hook,
    /// layers by index, `n_experts` each), summed over the ranks that route different tokens
    /// (`dp` x `fsdp` x `ep`, and `cp`, whose ranks route their own positions) and over the
    /// pipeline stages (each counts its own layers). `tp` ranks route the same tokens, and
    /// are not summed. Per layer (`layers` of them) and expert: what `Moe::update_bias` takes.
    /// Fails when `stats` counts more layers or experts. Collective.
    pub fn routing_loads(
        &self,
        stats: &flashover_models::moe::MoeStats,
        layers: usize,
        n_experts: usize,
    ) -> Result<Vec<Vec<u64>>, ParallelError> {
        let too_many = stats.routed.len() > layers
            || stats.routed.iter().any(|counts| counts.len() > n_experts);
        if too_many {
            return Err(ParallelError::Invalid(format!(
                "routing statistics of {} layers, up to {} experts each, do not fit {layers} \
                 layers of {n_experts} experts",
                stats.routed.len(),
                stats.routed.iter().map(Vec::len).max().unwrap_or(0)
            )));
        }
        let mut sums = vec![0u64; layers * n_experts];
        for (layer, counts) in stats.routed.iter().enumerate() {
            sums[layer * n_experts..][..counts.len()].copy_from_slice(counts);
        }
        if self.averaged.size() > 1 {
            self.averaged.all_reduce(&mut sums, ReduceOp::Sum)?;
        }
        if let Some(pp) = self.pipeline_ranks() {
            pp.all_reduce(&mut sums, ReduceOp::Sum)?;
        }
        Ok(sums
            .chunks(n_experts.max(1))
            .take(layers)
            .map(<[u64]>::to_vec)
            .collect())
    }

    /// Token rows this rank's `expert_parallel` layers sent to other `ep` ranks since the last
    /// call (forward and backward, counted by the sender; a rank's rows to itself move no
    /// bytes and are not counted): what the all-to-alls moved between ranks.
    pub fn expert_rows_sent(&self) -> u64 {
        self.expert_traffic.take()
    }

    /// The ranks that read different samples (`dp` x `fsdp` x `ep`): a global batch is cut
    /// into `data_ranks().size()` equal shares, this rank's is share `data_ranks().rank()`.
    pub fn data_ranks(&self) -> &Group {
        &self.data
    }

    /// Whether the plan cuts the model into pipeline stages on this mesh (a rank then trains
    /// through [`Self::pipeline_step`]).
    pub fn is_pipelined(&self) -> bool {
        self.pipeline_ranks().is_some()
    }

    /// The `pp` ranks, when the plan cuts the model into stages over more than one.
    fn pipeline_ranks(&self) -> Option<&Group> {
        let stages = self.stages.as_ref().filter(|s| s.schedule.pp > 1)?;
        Some(stages.pipeline_group())
    }

    /// The ranks of the first and the last pipeline stage when this rank holds a module both
    /// run (an embedding tied to the head): they sum its copies' gradients. For a caller that
    /// reduces [`Self::pipeline_gradients`] itself; [`Self::reduce_gradients`] sums them.
    pub fn tied_copies(&self) -> Option<&Group> {
        self.stages.as_ref().and_then(Stages::tie_group)
    }

    /// The `cp` ranks that hold the other positions of this rank's sequences, when the plan
    /// splits sequences on this mesh (to put per-position outputs back together).
    pub fn sequence_ranks(&self) -> Option<&Group> {
        self.context.as_ref().map(|split| &split.group)
    }

    /// Whether the plan has a pipeline rule (its stages may be one, on a mesh without `pp`).
    pub fn has_pipeline(&self) -> bool {
        self.stages.is_some()
    }

    /// Whether the plan splits sequences over `cp` on this mesh (a rank then computes its
    /// positions of every sequence: [`Self::sequence_share`]).
    pub fn splits_sequences(&self) -> bool {
        self.context.is_some()
    }

    /// One training step of a pipelined plan: this rank's samples of step `step` of batches of
    /// `global_batch` (as [`Self::batch_share`]) cut into the plan's micro-batches, each
    /// built by `micro_batch(samples)` on every stage (layers may read it:
    /// [`PipelineModel::layer_for`]), run through the plan's schedule over this rank's stages
    /// of `model` ([`PipelineModel`]). What travels between
    /// stages has the shape of the first stage's `embed` output, learned on the first step
    /// (every micro-batch of a run has one shape). The gradients are reduced and clipped as
    /// [`Self::gradients`] does; tied copies (an embedding the first and the last stage both
    /// hold) summed. Collective.
    pub fn pipeline_step<M, const D: usize>(
        &self,
        model: &M,
        global_batch: usize,
        step: usize,
        micro_batch: &(dyn Fn(Range<usize>) -> M::Batch + Sync),
        max_norm: Option<f32>,
        ctx: &RankContext,
    ) -> Result<PipelineStep, ParallelError>
    where
        M: PipelineModel<D> + Sync + 'static,
    {
        let share = self.share(global_batch, step)?;
        let head = |m: &M, x, batch: &M::Batch, _| m.head_loss(x, batch);
        let loss_scale = self.precision.loss_scale();
        let device = step_device(model, ctx);
        let hooked = self.pipeline_stages()?.hooks_allowed() && self.buckets.hooks_on(&device);
        self.buckets.begin_step(hooked);
        let hooks = hooked.then_some(&self.buckets);
        let mut run = self.run_stages(model, share, micro_batch, &head, loss_scale, hooks, ctx)?;
        self.mean_over_ranks(&mut run.losses)?;
        let [loss, aux_loss] = run.losses;
        let reduced = self.reduce_and_clip(model, run.flat, run.divisor, max_norm, ctx)?;
        Ok(PipelineStep {
            grads: reduced.grads,
            loss,
            aux_loss,
            norm: reduced.norm,
            report: run.report,
            recomputed: run.recomputed,
            loss_scale,
            skipped: !reduced.applied,
            reduction: reduced.report,
            rows: reduced.rows,
        })
    }

    /// The loss scale the next step runs with, under a `mixed_precision` that scales the loss.
    pub fn loss_scale(&self) -> Option<f32> {
        self.precision.loss_scale()
    }

    /// The running loss scale and its overflow-free steps, under a `mixed_precision` that
    /// scales the loss: what a checkpoint keeps so that a resumed run scales as the
    /// uninterrupted one.
    pub fn loss_scale_state(&self) -> Option<(f32, usize)> {
        self.precision.scaler().as_ref().map(LossScaler::state)
    }

    /// Resumes the running loss scale from [`Self::loss_scale_state`]. Fails without a
    /// policy that scales the loss.
    pub fn restore_loss_scale(&self, state: (f32, usize)) -> Result<(), ParallelError> {
        let mut scaler = self.precision.scaler();
        let scaler = scaler.as_mut().ok_or_else(|| {
            ParallelError::Invalid(
                "no loss scale to restore: the plan's mixed_precision scales no loss".into(),
            )
        })?;
        scaler.restore(state);
        Ok(())
    }

    /// One step's gradients of a pipelined plan over the `samples` samples this rank reads
    /// (its share of the global batch, as a data loader that batches each data rank's share
    /// gives it: `flashover::learner` does), cut into the plan's micro-batches: micro-batch
    /// `k` is `micro_batch(k * n..(k + 1) * n)` of them (`n = samples / micro-batches`), and
    /// its loss on the last stage is `head(model, x, &micro_batch, k)` of the layers' output
    /// `x` (`PipelineModel::head_loss`, or a head that also keeps what metrics read). Unlike
    /// [`Self::pipeline_step`], the gradients are this rank's, not yet reduced: sum several
    /// steps' to accumulate, then reduce them with [`Self::reduce_gradients`]. The losses are
    /// this rank's share's means. Under a `mixed_precision` that scales the loss, each
    /// micro-batch's loss is scaled by the running scale ([`PipelineStep::loss_scale`]) and the
    /// gradients come back unscaled; whether the step overflowed is decided from the reduced
    /// norm, by [`Self::reduce_gradients`] (which then returns no gradients and moves the
    /// scale). Collective over `pp`.
    pub fn pipeline_gradients<M, const D: usize>(
        &self,
        model: &M,
        samples: usize,
        micro_batch: &(dyn Fn(Range<usize>) -> M::Batch + Sync),
        head: &pipeline::HeadLoss<'_, M, D>,
        ctx: &RankContext,
    ) -> Result<PipelineStep, ParallelError>
    where
        M: PipelineModel<D> + Sync + 'static,
    {
        let loss_scale = self.loss_scale();
        let mut run =
            self.run_stages(model, 0..samples, micro_batch, head, loss_scale, None, ctx)?;
        run.flat.iter_mut().for_each(|g| *g /= run.divisor);
        let [loss, aux_loss] = run.losses;
        Ok(PipelineStep {
            grads: grads_from_flat(model, &run.flat),
            loss,
            aux_loss,
            norm: f32::NAN,
            report: run.report,
            recomputed: run.recomputed,
            loss_scale,
            skipped: false,
            reduction: ReductionReport::default(),
            rows: vec![],
        })
    }

    /// The forwards and backwards of this rank's stages over `share`, each micro-batch's loss
    /// scaled by `loss_scale`; with `hooks`, the forwards run on hooked parameters that hand
    /// their gradients to the buckets.
    #[allow(clippy::too_many_arguments)]
    fn run_stages<M, const D: usize>(
        &self,
        model: &M,
        share: Range<usize>,
        micro_batch: &(dyn Fn(Range<usize>) -> M::Batch + Sync),
        head: &pipeline::HeadLoss<'_, M, D>,
        loss_scale: Option<f32>,
        hooks: Option<&BucketedReduction>,
        ctx: &RankContext,
    ) -> Result<StagesRun, ParallelError>
    where
        M: PipelineModel<D> + Sync + 'static,
    {
        let stages = self.pipeline_stages()?;
        let device = step_device(model, ctx);
        let before = stages.recomputed();
        let (mut flat, losses, report) =
            stages.step(model, share, &device, micro_batch, head, loss_scale, hooks)?;
        // The stages' gradients and the copies' are both sums of the scaled losses'.
        self.fold_hot_experts(model, &mut flat, 1.0)?;
        let micro_batches = stages.schedule.micro_batches as f32;
        Ok(StagesRun {
            flat,
            divisor: micro_batches * loss_scale.unwrap_or(1.0),
            losses,
            report,
            recomputed: stages.recomputed() - before,
        })
    }

    /// Adds the step's hot-expert copies' gradients, summed over `ep` and times `scale`, to
    /// the experts this rank owns in `flat` (`model`'s layout), under `replicate_hot_experts`
    /// (collective over `ep`).
    fn fold_hot_experts<M: Module>(
        &self,
        model: &M,
        flat: &mut [f32],
        scale: f32,
    ) -> Result<(), ParallelError> {
        if let Some((replicas, ep)) = &self.hot_experts {
            let folded = replicas.fold(ep, scale)?;
            accumulate_grads(model, &folded, flat, &[]);
        }
        Ok(())
    }

    /// The plan's pipeline stages, or why there are none.
    fn pipeline_stages(&self) -> Result<&Stages, ParallelError> {
        self.stages.as_ref().ok_or_else(|| {
            ParallelError::Invalid(
                "a pipeline step needs a plan with a pipeline rule (ParallelizePlan::pipeline)"
                    .into(),
            )
        })
    }

    /// The layers' output of `batch` through the plan's pipeline, forward only (validation,
    /// inference; `model` on a plain device): `Some` on the ranks that run the last stage,
    /// where the model's head reads it, `None` on the others. The first stage embeds `batch`
    /// (its whole samples, no micro-batches); each stage's output travels to the next one's
    /// rank in f32. Collective over `pp`.
    pub fn pipeline_forward<M, const D: usize>(
        &self,
        model: &M,
        batch: &M::Batch,
    ) -> Result<Option<Tensor<D>>, ParallelError>
    where
        M: PipelineModel<D>,
    {
        self.pipeline_stages()?.forward(model, batch)
    }

    /// Whether this rank runs the last pipeline stage, where the loss and the model's
    /// outputs are computed (every rank does without a pipeline).
    pub fn runs_last_stage(&self) -> bool {
        self.stages.as_ref().is_none_or(Stages::runs_last_stage)
    }

    /// `flat` (this rank's gradients in `model`'s layout, not yet reduced: what hooks did not
    /// hand to the buckets of the step begun) summed over the ranks that hold the same values
    /// and read different samples, divided by `divisor` (micro-batches and loss scale) and by
    /// the data ranks, clipped by the global norm; with the norm before clipping. Under loss
    /// scaling, a step whose norm overflowed gets no gradients (every rank sees the same norm,
    /// so every rank's scaler decides alike).
    fn reduce_and_clip<M: Module>(
        &self,
        model: &M,
        mut flat: Vec<f32>,
        divisor: f32,
        max_norm: Option<f32>,
        ctx: &RankContext,
    ) -> Result<Reduced, ParallelError> {
        self.check_attended()?;
        self.buckets.add_remaining(&flat);
        // Whole gradients in the model's layout, or this rank's rows of them.
        let row_entries;
        let (mut values, entries, report) = match self.buckets.row_layout() {
            None => {
                let report = self.buckets.finish(&mut flat)?;
                (flat, self.placements.entries_of(model)?, report)
            }
            Some(rows) => {
                let (values, report) = self.buckets.finish_rows(&mut flat)?;
                row_entries = rows
                    .shards
                    .placed(&rows.layout, &self.placements, rows.axis, 0)?;
                let entries = row_entries.iter().map(|(s, e)| (s.clone(), e)).collect();
                (values, entries, report)
            }
        };
        // The tp ranks of one data coordinate reduce equal values over the same data ranks.
        if let Some(check) = &self.sequence_check {
            check.first_step(&entries, &values)?;
        }
        // One division by the whole denominator (micro-batches, loss scale, data ranks), as
        // DDP divides: the same bits as DDP's whatever the number of ranks.
        let denominator = divisor * self.averaged.size() as f32;
        if denominator != 1.0 {
            values.iter_mut().for_each(|g| *g /= denominator);
        }
        let parts = entries
            .iter()
            .map(|(slot, entry)| (*entry, &values[slot.offset..slot.offset + slot.numel]));
        let norm = global_grad_norm(parts, ctx)?;
        let applied = self.precision.apply(norm);
        if applied && let Some(clip) = clip_scale(norm, max_norm)? {
            values.iter_mut().for_each(|g| *g *= clip);
        }
        *self
            .last_reduction
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = report.clone();
        let (grads, rows) = match (applied, self.buckets.row_layout()) {
            (false, _) => (GradientsParams::new(), vec![]),
            (true, Some(_)) => (GradientsParams::new(), values),
            (true, None) => (grads_from_flat(model, &values), vec![]),
        };
        Ok(Reduced {
            grads,
            rows,
            norm,
            applied,
            report,
        })
    }

    /// What the last gradient reduction did and cost (a pipeline step's is also its
    /// [`PipelineStep::reduction`]): whether hooks reported the gradients during backward, and
    /// how much of the communication ran before backward ended.
    pub fn last_reduction(&self) -> ReductionReport {
        self.last_reduction
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Under the plan's `gradient_buckets.rows` (ZeRO-1/2): which rows of which parameters
    /// [`PipelineStep::rows`] holds.
    pub fn gradient_rows(&self) -> Option<&GradientRowLayout> {
        self.buckets.row_layout()
    }

    /// Gradient buckets per step (over every set of reduction axes), and when a step of this
    /// plan reduces them on `device`: during backward where the plan's
    /// `gradient_buckets.overlap` asks, the device has the gradient hook op, and the step's
    /// backwards cover every parameter (a pipeline's schedule) or its forwards run through
    /// [`Self::forward`] (a loop of one's own, from its second step: see
    /// [`Self::gradients`]); after backward otherwise, and why.
    pub fn gradient_buckets(&self, device: &burn::tensor::Device) -> (usize, ReductionTiming) {
        let schedule = match &self.stages {
            None if !self.units.paths().is_empty() => Some(
                "fully sharded units reduce-scatter their gradients themselves; the other \
                 buckets follow backward",
            ),
            None if self.hot_experts.is_some() => {
                Some("hot-expert copies fold their gradients into their owners' after backward")
            }
            None => None,
            Some(stages) => stages.hooks_ruled_out(),
        };
        let timing = match schedule {
            Some(why) => ReductionTiming::AfterBackward(why),
            None => self.buckets.timing(device),
        };
        (self.buckets.buckets(), timing)
    }
}

/// A step's gradients after the reduction.
struct Reduced {
    grads: GradientsParams,
    /// Under gradient rows: this rank's rows (and `grads` empty).
    rows: Vec<f32>,
    /// The global norm before clipping.
    norm: f32,
    /// Whether the step applies (false: a scaled gradient overflowed).
    applied: bool,
    report: ReductionReport,
}

/// The autodiff device `model` computes on (with Burn's balanced checkpointing, if it chose
/// it), or the rank's.
fn step_device<M: Module>(model: &M, ctx: &RankContext) -> burn::tensor::Device {
    model
        .devices()
        .into_iter()
        .next()
        .unwrap_or_else(|| ctx.device().clone().autodiff())
}

/// The whole model's parameter values in `whole`'s layout, from this rank's `local` ones (laid
/// out as `local_layout`, parameter for parameter, each gathered whole over `tp` and `fsdp`
/// already): the parameters `counted` marks (by index) copied, the rest zero, summed over
/// `group`. Each parameter must be counted by exactly one rank of the group (collective).
fn sum_counted(
    whole: &ParamLayout,
    local: &[f32],
    local_layout: &ParamLayout,
    counted: impl Fn(usize) -> bool,
    group: &Group,
) -> Result<Vec<f32>, ParallelError> {
    let mut values = vec![0.0; whole.numel];
    for (i, (slot, here)) in whole.slots.iter().zip(&local_layout.slots).enumerate() {
        if counted(i) {
            values[slot.offset..slot.offset + slot.numel]
                .copy_from_slice(&local[here.offset..here.offset + here.numel]);
        }
    }
    if group.size() > 1 {
        group.all_reduce(&mut values, ReduceOp::Sum)?;
    }
    Ok(values)
}

/// A module visitor's path (one name per level entered; the root's is empty) as a dotted
/// parameter path (`blocks.0.attn.weight`).
fn dotted(path: &[String]) -> String {
    path.iter()
        .map(String::as_str)
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(".")
}
