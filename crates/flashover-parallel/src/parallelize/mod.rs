//! Parallelize a user's own Burn model with a [`ParallelizePlan`], without changing it.
//!
//! ```text
//! let plan = ParallelizePlan::new().fully_shard("blocks").fully_shard("embed");
//! let (model, par) = parallelize(MyModel::new(&config, &device), &plan, &ctx)?;
//! for step in 0..steps {
//!     let (x, y) = my_batch(par.data().batch_share(global_batch, step)?);   // this rank's samples
//!     let loss = model.forward(x, y);                                // the unchanged forward
//!     let (grads, norm) = par.gradients(&model, loss.backward(), Some(1.0), &ctx)?;
//!     let scalars = par.step_scalars(&loss, &norm)?;                 // on the device
//!     model = optim.step(lr, model, grads);                          // any Burn optimizer
//!     println!("{:?}", scalars.read());   // one host read a step: loss (the same on every rank), norm
//! }
//! ```
//!
//! What each mesh axis does to the model:
//! - `dp`: replicas; each reads its share of the batch; gradients averaged.
//! - `fsdp`: as `dp` for the batch; the plan's `fully_shard` modules keep `1/fsdp` of each
//!   parameter per rank (all of them, unless the plan's `keep_whole` names some), gathered
//!   where the forward reads them (Burn's parameter
//!   reparameterization, see [`crate::placed`]), so the model's code does not change and any
//!   Burn optimizer steps the shards.
//! - `tp`: the plan's `tensor_parallel` linear layers hold their columns or rows
//!   ([`TpStyle`]); the model declares them as [`crate::nn::Linear`] (Burn's `Linear` with the
//!   collectives a split needs in its forward) and sizes its attention heads from the
//!   projection's local width ([`crate::nn::Linear::d_output`]). Every `tp` rank reads the
//!   same samples; the parameters outside the rules are computed identically on each.
//!
//! - `pp`: the plan's `pipeline` cuts the model's repeated layers into stages; each rank keeps
//!   its stages' parameters (placeholders for the rest) and trains through
//!   [`PipelineRunner::step`], running its part of the forward ([`PipelineModel`]).
//!
//! - `cp`: the plan's `context_parallel` rule splits every sequence: each rank holds some of
//!   its positions ([`SequenceSplit::share`], [`SequenceSplit::positions`], through [`Parallelized::sequences`]) for the
//!   whole model, and the attention cores it names ([`crate::nn::CausalAttention`]) attend
//!   over the other ranks' keys and values. Losses and gradients are averaged over `cp` as
//!   over the data axes.
//!
//! - `ep`: the plan's `expert_parallel` layers ([`crate::moe::Moe`]) keep `1/ep` of their
//!   routed experts per rank (placeholders for the rest), and their forward
//!   ([`crate::expert_parallel::MoeForward`]) sends each token to the rank holding its expert and back.
//!   `ep` ranks read different samples, as `dp` ranks do.
//!
//! A mesh with `tp`, `pp`, `cp` or `ep` is refused when the plan has no rule for that axis: the
//! model would run unsplit on its ranks, each repeating the others' work.
//!
//! [`Parallelized`] is a few objects, each in its module: [`ShardedModel`] (`sharded`: the
//! placements, the whole model gathered, the units), [`GradientReducer`] (`reduction`: the
//! buckets, and the step calls that reduce, clip and hand over the gradients),
//! [`PipelineRunner`] (`pipeline()?.step`: a pipelined plan's schedule), [`DataSplit`],
//! [`SequenceSplit`], [`PlanPrecision`] (`mixed_precision`: also the backward) and
//! [`ExpertRouting`]. This module builds them and runs a forward.

mod data_split;
mod experts;
mod loop_overlap;
mod mixed_precision;
pub mod pipeline;
mod pipeline_step;
mod place;
mod reduction;
mod replica_check;
mod row_optimizer;
mod sequences;
mod sharded;
mod split_check;
mod step_scalars;

pub use crate::placed::{
    ContextSplit, ExpertSplit, Placed, TpSplit, local_value, tp_split, value_dims,
};
pub use crate::plan::{
    AttachedModule, ContextParallelRule, ModulePath, ParallelizePlan, PipelineRule,
    SequenceParallelRules, TensorParallelRule, TpStyle,
};
pub use mixed_precision::PlanPrecision;
pub use pipeline::PipelineModel;
pub use pipeline_step::{PipelineRunner, PipelineStep};
pub use reduction::GradientReducer;
pub use sequences::SequenceSplit;
use sharded::HeldElsewhere;
pub use sharded::ShardedModel;
pub use split_check::SplitCheck;
pub use step_scalars::{StepScalars, StepValues};

use crate::data_parallel::BucketedReduction;
use crate::error::ParallelError;
use crate::params::{ParamLayout, ParamSlot, broadcast_module, placeholders_except};
use crate::placed::{Elsewhere, WholeReads};
use crate::placement::{Placement, PlacementTable};
use crate::zero::ShardGroup;
use crate::zero::units::{FullyShardedUnits, UnitGathers};
use burn::module::Module;
pub use data_split::DataSplit;
pub use experts::ExpertRouting;
use experts::{ExpertShares, Experts};
use flashover_comm::Group;
use flashover_runtime::{Axis, RankContext};
use pipeline::Stages;
use std::collections::{BTreeSet, HashMap};

/// The axes whose ranks read different samples.
const DATA_AXES: [Axis; 3] = [Axis::Dp, Axis::Fsdp, Axis::Ep];

/// What [`parallelize`] did to a model, and the per-step helpers that follow from it.
pub struct Parallelized {
    /// The model as cut on this rank: placements, gathers, units ([`Self::sharded`]).
    sharded: ShardedModel,
    /// Every gradient summed over the ranks its placement says, in buckets
    /// ([`Self::reducer`]).
    reducer: GradientReducer,
    /// The plan's data split on this rank ([`Self::data`]).
    data_split: DataSplit,
    /// The plan's sequence split on this rank ([`Self::sequences`]).
    sequences: SequenceSplit,
    /// The pipeline's stages, when the plan has one ([`Self::pipeline`]).
    stages: Option<Stages>,
    /// Whether the plan spreads experts over `ep` (this rank holds some of them).
    experts_split: bool,
    /// What the plan's mixture-of-experts layers routed and sent ([`Self::experts`]).
    expert_routing: ExpertRouting,
    /// The plan's mixed precision (f32 throughout without one) and its running loss scale.
    precision: mixed_precision::PlanPrecision,
    /// Under `replicate_hot_experts` (with more than one `ep` rank): the step's hot-expert
    /// copies and the `ep` group their gradients are summed over.
    hot_experts: Option<(crate::expert_parallel::Replicas, Group)>,
}

/// Where `model`'s gradients live: its parameters' device outside autodiff (the rank's for a
/// model without parameters).
pub(crate) fn grad_device<M: Module>(model: &M, ctx: &RankContext) -> burn::tensor::Device {
    match model.devices().into_iter().next() {
        Some(device) => device.inner(),
        None => ctx.device().clone(),
    }
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
    crate::plan::check_plan(plan, &layout.slots, Some(tp.size()))?;
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
    units.set_vectors(&layout);
    let kept_whole = kept_whole(plan, &layout);
    let context = plan
        .context_parallel
        .as_ref()
        .filter(|_| ctx.group(Axis::Cp).size() > 1)
        .map(|rule| ContextSplit::new(ctx.group(Axis::Cp), rule));
    let mut error = None;
    let mut sequence_partial = std::collections::HashSet::new();
    // Buffers matter only where fully_shard cuts rows.
    let buffers = match ctx.group(Axis::Fsdp).size() > 1 && !plan.fully_shard.is_empty() {
        true => place::buffers(&model),
        false => Default::default(),
    };
    let place = place::PlaceParams {
        plan,
        fsdp: ctx.group(Axis::Fsdp).clone(),
        tp: tp.clone(),
        tp_stream: (tp.size() > 1)
            .then(|| flashover_runtime::CommStream::new(&tp, "tensor-parallel stream")),
        context: context.as_ref(),
        routers: &experts.routers,
        all_routers: &experts.all_routers,
        placements: &mut placements,
        whole_reads: whole_reads.clone(),
        units: units.clone(),
        absent: &absent.by_path,
        kept_whole: &kept_whole,
        buffers: &buffers,
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
        let hot = experts.hot.as_ref().map(|(copies, _)| copies.clone());
        stages_as_units(stages, units.clone(), &sharded, policy, hot, ctx)?;
    }
    let units = fully_sharded_units(plan, &layout, &sharded, &absent, units, policy, ctx);
    let buckets = BucketedReduction::new(
        ctx,
        grad_device(&model, ctx),
        &placements.entries_of(&model)?,
        &absent.held,
        stages.as_ref().and_then(Stages::tie_group),
        plan.gradient_buckets,
        policy.reduce_dtype,
    )?;
    let averaged = ctx.subgroup(&[Axis::Dp, Axis::Fsdp, Axis::Ep, Axis::Cp])?;
    let pipeline_ranks = stages.as_ref().and_then(Stages::split_ranks).cloned();
    let expert_routing = ExpertRouting::new(
        averaged.clone(),
        pipeline_ranks.clone(),
        experts.traffic.clone(),
    );
    let after_backward = after_backward(stages.as_ref(), &units, experts.hot.is_some());
    let held_elsewhere = held_elsewhere_of(stages.as_ref(), experts.shares.as_ref(), layout, ctx)?;
    let par = Parallelized {
        sharded: ShardedModel {
            placements,
            whole_reads,
            units,
            absent: absent.by_path.into_keys().collect(),
            held_elsewhere,
            kept_whole,
        },
        reducer: GradientReducer {
            buckets,
            replica_check: (tp.size() > 1).then(|| {
                let sequence_parallel = !plan.sequence_parallel.is_empty();
                replica_check::ReplicaCheck::new(
                    tp.clone(),
                    sequence_parallel,
                    sequence_partial,
                    policy.param_dtype,
                )
            }),
            after_backward,
            loop_overlap: Default::default(),
            last_reduction: Default::default(),
        },
        data_split: DataSplit::new(
            ctx.subgroup(&DATA_AXES)?,
            averaged.clone(),
            dropout_draws(plan, ctx).with_data_ranks(ctx.subgroup(&DATA_AXES)?),
            pipeline_ranks.is_some(),
        ),
        sequences: SequenceSplit::new(
            context,
            (tp.size() > 1 && !plan.sequence_parallel.is_empty()).then(|| tp.clone()),
        ),
        stages,
        expert_routing,
        experts_split: experts.shares.is_some(),
        precision: mixed_precision::PlanPrecision::new(policy),
        hot_experts: experts
            .hot
            .map(|(replicas, _)| (replicas, ctx.group(Axis::Ep).clone())),
    };
    Ok((model, par))
}

/// The parameters under the plan's `fully_shard` paths that its `keep_whole` rule leaves
/// whole, by path. No layer is recognised by its type: a parameter stays whole only where the
/// plan says so (routed experts are sharded too: their layer gathers them all at once on
/// every rank, whatever the routing, `expert_parallel::MoeForward`).
fn kept_whole(plan: &ParallelizePlan, layout: &ParamLayout) -> BTreeSet<String> {
    (layout.slots.iter())
        .map(|slot| slot.name.clone())
        .filter(|name| plan.keep_whole.iter().any(|p| p.contains(name)))
        .filter(|name| plan.shard_path(name).is_some())
        .collect()
}

/// A pipeline's layers made units (each gathers its parameters `sharded` marks at once),
/// computing in `policy`, with `hot` expert copies' gradients handed to them; refuses zb-h1
/// over sharded parameters.
fn stages_as_units(
    stages: &mut Stages,
    units: UnitGathers,
    sharded: &[bool],
    policy: crate::precision::MixedPrecision,
    hot: Option<crate::expert_parallel::Replicas>,
    ctx: &RankContext,
) -> Result<(), ParallelError> {
    if stages.splits_backward() && sharded.iter().any(|s| *s) {
        return Err(ParallelError::Invalid(
            "pipeline schedule: zb-h1 defers a layer's weight gradient past the layer's \
             backward, where a fully sharded weight's gradient is reduce-scattered to its \
             shards: use zb-h1 without fully_shard, or 1f1b with it"
                .into(),
        ));
    }
    stages.gather_layers(units, ctx.group(Axis::Fsdp), sharded);
    stages.compute_in(policy);
    if let Some(copies) = hot {
        stages.hand_gradients_to(copies);
    }
    Ok(())
}

/// The fully sharded units: every parameter `sharded` marks that this rank holds (not another
/// stage's or ep rank's). They gather in the compute dtype (rounded first: what the compute
/// view reads) and reduce-scatter in the reduction's, as FSDP2's policy does.
fn fully_sharded_units(
    plan: &ParallelizePlan,
    layout: &ParamLayout,
    sharded: &[bool],
    absent: &Absent,
    units: UnitGathers,
    policy: crate::precision::MixedPrecision,
    ctx: &RankContext,
) -> FullyShardedUnits {
    let held_shards = layout.slots.iter().zip(sharded).map(|(s, &sharded)| {
        (sharded && !absent.by_path.contains_key(&s.name)).then_some(s.name.as_str())
    });
    let comm = (ctx.group(Axis::Fsdp).size() > 1).then(|| {
        ShardGroup::with_precision(
            ctx.group(Axis::Fsdp),
            policy.param_dtype,
            policy.reduce_dtype,
        )
    });
    FullyShardedUnits::new(plan, layout, held_shards, units, comm)
}

/// Why a loop of one's own reduces its buckets after backward whatever the device can do, if
/// it does: fully sharded units or hot-expert copies without a pipeline, or what the
/// pipeline's schedule rules out.
fn after_backward(
    stages: Option<&Stages>,
    units: &FullyShardedUnits,
    hot_experts: bool,
) -> Option<&'static str> {
    match stages {
        None if !units.paths().is_empty() => Some(
            "fully sharded units reduce-scatter their gradients themselves; the other \
             buckets follow backward",
        ),
        None if hot_experts => {
            Some("hot-expert copies fold their gradients into their owners' after backward")
        }
        None => None,
        Some(stages) => stages.hooks_ruled_out(),
    }
}

/// For a model cut into stages or experts: the ranks that hold its other parts (`pp` x `ep`),
/// the whole model's parameters `whole`, and which of them this rank counts when the whole
/// model is gathered (each on one rank: its stage's, its expert's holder). Collective.
fn held_elsewhere_of(
    stages: Option<&Stages>,
    shares: Option<&ExpertShares>,
    whole: ParamLayout,
    ctx: &RankContext,
) -> Result<Option<HeldElsewhere>, ParallelError> {
    if stages.is_none() && shares.is_none() {
        return Ok(None);
    }
    let counted = (0..whole.slots.len())
        .map(|i| stages.is_none_or(|s| s.counts(i)) && shares.is_none_or(|e| e.counts(i)))
        .collect();
    Ok(Some(HeldElsewhere {
        group: ctx.subgroup(&[Axis::Pp, Axis::Ep])?,
        whole,
        counted,
    }))
}

/// `plan`'s dropout draws on this mesh, and what they cannot place: [`crate::nn`]'s dropout
/// knows a tensor's samples, heads and hidden features, and a sequence's positions only inside
/// a stack that split it (`sequence_split_stacks`).
fn dropout_draws(plan: &ParallelizePlan, ctx: &RankContext) -> crate::dropout::draws::Draws {
    let vocab = (plan.tensor_parallel.iter()).any(|r| r.style == TpStyle::Vocab);
    let split_outside =
        ctx.group(Axis::Tp).size() > 1 && !plan.sequence_parallel.is_empty() && vocab;
    // A stack splitting sequences over cp places its positions; models that split them
    // before their blocks (attention cores) do not tell the dropout where.
    let context = ctx.group(Axis::Cp).size() > 1
        && plan.context_parallel.is_some()
        && plan.sequence_split_stacks.is_empty();
    crate::dropout::draws::Draws::new(plan.dropout_seed, 0, 0..0)
        .refused(context.then_some(
            "context parallelism splits sequences by position, which flashover::nn's dropout \
             draws do not place yet: train it with dropout 0",
        ))
        .split_outside_stacks(split_outside.then_some(
            "sequence parallelism from a vocabulary-parallel embedding splits activations by \
             position outside the layer stacks, which flashover::nn's dropout draws do not \
             place: split whole sequences in a sequence_split_stacks stack instead, or train \
             with dropout 0",
        ))
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
    /// The model as the plan cut it on this rank: every parameter's placement, the whole
    /// model gathered back, the fully sharded units and their counters.
    pub fn sharded(&self) -> &ShardedModel {
        &self.sharded
    }

    /// The gradient reduction: its buckets and when they run, the last step's report, and
    /// the rows ZeRO-1/2 keeps.
    pub fn reducer(&self) -> &GradientReducer {
        &self.reducer
    }

    /// `f(model)`, the model's forward, with the plan's fully sharded units gathered a unit at
    /// a time: the first read of a unit's parameter all-gathers every parameter of the unit
    /// in one collective, and submits the all-gather of the next unit (in the model's
    /// parameter order), which runs on this rank's communication thread while the unit
    /// computes (FSDP2's forward prefetch; Burn has no module hooks to start it from). Each
    /// element of the first list of layers inside a `fully_shard` module is a unit, the rest
    /// of the module another (`fully_shard("")`: `blocks.0`, `blocks.1`, ... and the
    /// embedding, final norm and head together); [`ShardedModel::units`] lists them. Outside it,
    /// each parameter is gathered where it is read, one collective per parameter: the same
    /// values, more collectives. The gathered parameters are kept until backward has used
    /// them, as without units. Under the plan's `mixed_precision`, `f` computes on
    /// [`crate::precision::MixedPrecision::compute_view`] of the model (every float parameter cast inside the
    /// graph, so gradients reach the f32 parameters in f32; cast float inputs yourself), and
    /// the units are all-gathered in the compute dtype. Where the plan's gradient buckets can
    /// be reduced during backward ([`GradientReducer::buckets`]), `f` computes on parameters
    /// whose gradient hooks hand each gradient to its bucket (see [`Self::gradients`]). Fails
    /// when a step runs more micro-batches than the step before under that overlap, when `f`
    /// runs inside another `forward`, or when a prefetch failed; a failed gather inside `f` panics with the collective's
    /// error, which the launcher reports. A plan cut into pipeline stages runs its layers as
    /// units in [`PipelineRunner::step`] instead.
    pub fn forward<M: Module, T>(
        &self,
        model: &M,
        f: impl FnOnce(&M) -> T,
    ) -> Result<T, ParallelError> {
        if self.is_pipelined() {
            return Err(ParallelError::Invalid(
                "the plan cuts the model into pipeline stages: a rank's forward is a stage's, \
                 so train with Parallelized::pipeline()?.step, which gathers each layer as a unit"
                    .into(),
            ));
        }
        let hooked;
        let model = match self.loop_hooks_ruled_out(model) {
            None => {
                self.reducer
                    .loop_overlap
                    .before_forward(&self.reducer.buckets)?;
                hooked = self.reducer.buckets.hooked(model);
                &hooked
            }
            Some(_) => model,
        };
        // The view inside the scope: the units gather the stored f32 shards, each read is cast,
        // and the reduce-scattered gradient reaches the shard in f32 (a scope over the view
        // would round it to the compute dtype once more).
        self.sharded
            .units
            .forward(model, |m| match self.precision.forward_view(m) {
                Some(view) => f(&view),
                None => f(m),
            })
    }

    /// The plan's data split on this rank: its share of each step's batch (which sets its
    /// dropout draws), the whole batch's mean loss, and the ranks that read different samples.
    pub fn data(&self) -> &DataSplit {
        &self.data_split
    }

    /// What the plan's mixture-of-experts layers routed and sent on this rank: the whole
    /// batch's routing loads (for auxiliary-loss-free balancing) and the token rows the
    /// expert-parallel all-to-alls moved.
    pub fn experts(&self) -> &ExpertRouting {
        &self.expert_routing
    }

    /// The plan's sequence split on this rank: its positions of each sequence, the forward
    /// context of a model whose attention runs through one, and the sequence checks.
    pub fn sequences(&self) -> &SequenceSplit {
        &self.sequences
    }

    /// Whether the plan cuts the model into pipeline stages on this mesh (a rank then trains
    /// through [`PipelineRunner::step`]).
    pub(crate) fn is_pipelined(&self) -> bool {
        self.pipeline_ranks().is_some()
    }

    /// The `pp` ranks, when the plan cuts the model into stages over more than one.
    fn pipeline_ranks(&self) -> Option<&Group> {
        self.stages.as_ref().and_then(Stages::split_ranks)
    }
}
