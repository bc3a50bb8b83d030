//! How one rank holds and steps the reference transformer: [`build`] reads the mesh and the
//! job and returns the [`RankStrategy`] that runs them, and the training loop only ever talks to
//! that trait.
//!
//! There is one implementation per way of executing a step, each in its own module, not one
//! per combination of axes: where parameters live is recorded in the placement table
//! (`flashover_parallel::placement`), so the same implementation serves many layouts.
//! - [`replicated`]: whole replicas or tensor-parallel shares, gradients reduced in buckets
//!   overlapped with backward (DDP; dp x tp x cp);
//! - [`zero`]: the same with AdamW state and gradients sharded over the buckets (ZeRO-1/2);
//! - [`fsdp`]: the model's plan under `fully_shard("")`, parameters cut by rows in units
//!   gathered just before use (ZeRO-3 / HSDP, over tensor-parallel shares and context-parallel
//!   ranks too);
//! - [`plan_pipeline`]: pipelines and mixtures of experts through the model's plan
//!   (`parallelize` with a pipeline rule; one stage without `pp`), any schedule, with tp, sp,
//!   cp, experts over ep (hot-expert copies too), ZeRO rows ([`held_rows`]: ZeRO-1/2, and
//!   ZeRO-3 under zb-h1 or with hot-expert copies) or ZeRO-3 units inside.
//!
//! What they share is here: the step's outcome, the precision policy's loss scale, the norm
//! from placements and the checkpoint view of a rank's state.

mod fsdp;
mod held_rows;
pub(crate) mod plan_pipeline;
mod replicated;
mod routing;
mod rows;
mod zero;

use super::checkpoint::{LocalState, Segment};
use super::config::{GradientReduction, TrainConfig};
use super::parallelize::{RankModel, Shares};
use super::report::MoeRecord;
use super::tp_model::TpTransformer;
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Int, Tensor};
use flashover_models::{ForwardContext, Transformer};
use flashover_parallel::context_parallel::AttentionWork;
use flashover_parallel::data_parallel::{
    DataParallel, DataParallelConfig, MicroBatches, ReduceReport,
};
use flashover_parallel::params::ParamSlot;
use flashover_parallel::pipeline::{Action, PipelineStepReport};
use flashover_parallel::placement::{GradientReducer, ParamPlacement, global_grad_norm};
use flashover_parallel::precision::{LossScaler, MixedPrecision};
use flashover_parallel::zero::MemoryReport;
use flashover_parallel::{FlatAdamW, FlatAdamWConfig, clip_scale};
use flashover_runtime::{Axis, Group, RankContext, RankError};
use std::time::{Duration, Instant};

/// A step's micro-batches: `batches(i)` gives micro-batch `i`'s inputs, targets and forward
/// context (dropout, positions, hooks).
pub(crate) type Batches<'a> =
    &'a mut dyn FnMut(usize) -> (Tensor<2, Int>, Tensor<2, Int>, ForwardContext);

/// A rank's [`LocalState`] and, for its parameters and then its moments, `(index, count)` of
/// the ranks holding the same data, which share writing it.
pub(crate) type SharedState = (LocalState, (usize, usize), (usize, usize));

/// How one rank holds the model and takes optimizer steps; see the module docs.
pub(crate) trait RankStrategy {
    /// One optimizer step over `micro_batches` micro-batches from `batches`, at learning rate
    /// `lr`, clipping the global gradient norm to `clip`.
    fn step(
        self: Box<Self>,
        ctx: &RankContext,
        clip: Option<f32>,
        batches: Batches<'_>,
        micro_batches: usize,
        lr: f64,
        precision: &mut Precisions,
    ) -> Result<(Box<dyn RankStrategy>, StepOutcome), RankError>;

    /// Gradient buckets per step and whether their reduction overlaps backward.
    fn buckets(&self) -> (usize, bool) {
        (0, false)
    }

    /// This rank's parameters and optimizer state with where each part belongs in the whole
    /// model, and which ranks hold the same data (they share the writing).
    fn local_state(&self, ctx: &RankContext, grad_group: &Group) -> Result<SharedState, RankError>;

    /// Puts a loaded [`LocalState`] (from `local_state`, filled by a checkpoint) back.
    fn restore(&mut self, state: LocalState) -> Result<(), RankError>;

    /// Mixture of experts: every layer's routing bias (`None` for dense models).
    fn moe_bias(&self) -> Option<Vec<Vec<f32>>> {
        None
    }

    /// Restores `moe_bias`'s output.
    fn set_moe_bias(&mut self, _bias: &[Vec<f32>]) -> Result<(), RankError> {
        Ok(())
    }

    /// The whole model's parameters by name, on world rank 0 (collective where the model is
    /// split; empty elsewhere).
    fn full_params(&self, ctx: &RankContext) -> Result<Vec<(String, Vec<f32>)>, RankError>;
}

/// The strategy that executes `model` (the parameter transforms' output, see
/// [`crate::train::parallelize`]) on `ctx`'s mesh as `config` says; `grad_group`: the ranks
/// whose gradients are averaged (`dp x fsdp x ep x cp`).
pub(crate) fn build(
    ctx: &RankContext,
    config: &TrainConfig,
    model: RankModel,
    grad_group: &Group,
) -> Result<Box<dyn RankStrategy>, RankError> {
    let adamw = FlatAdamWConfig::new().with_weight_decay(config.optim.weight_decay as f32);
    let RankModel { shares } = model;
    let ddp = DataParallelConfig::new()
        .with_bucket_bytes((config.parallel.bucket_mb * (1 << 20) as f64) as usize)
        .with_overlap(config.parallel.overlap)
        .with_average(config.parallel.gradient_reduction == GradientReduction::Mean)
        .with_reduce_dtype(config.precision.reduce_dtype);
    match (config.parallel.zero, shares) {
        (3, Shares::Split(model)) => fsdp::build(ctx, config, model, grad_group, &adamw),
        (3, Shares::Whole(..)) => Err(RankError::from(
            "ZeRO-3 runs fully sharded units, which transform 1 cuts (TrainConfig::zero3_in_units)",
        )),
        // ZeRO-1/2 of tensor-parallel shares cuts the optimizer state by rows.
        (0, shares) | (_, shares @ Shares::Split(_)) => {
            replicated::build(ctx, config, shares, grad_group, ddp, &adamw)
        }
        (_, Shares::Whole(model, _)) => zero::build(config, *model, grad_group, ddp, adamw),
    }
}

/// Whether a checkpoint's routing biases (`checkpoint` layers) fit the model (`model` layers).
fn routing_bias_layers(checkpoint: usize, model: usize) -> Result<(), RankError> {
    match checkpoint == model {
        true => Ok(()),
        false => Err(RankError::from(format!(
            "the checkpoint has routing biases for {checkpoint} layers, the model has {model}"
        ))),
    }
}

/// One step's outcome on one rank.
pub(crate) struct StepOutcome {
    pub loss_sum: f64,
    pub grad_norm: f32,
    pub comm: Duration,
    pub overlapped: Duration,
    pub exposed: Duration,
    pub memory: MemoryReport,
    /// Pipeline actions and receive waits (pipelines only).
    pub events: Vec<(Action, Instant, Instant)>,
    /// Pipeline: most micro-batches held at once.
    pub in_flight: usize,
    /// Pipeline: wall time of the schedule.
    pub pipeline: Duration,
    /// Mixture of experts: the step's routing over the global batch.
    pub moe: Option<MoeRecord>,
    /// Mixture of experts: this rank's time in all-to-alls.
    pub a2a: Duration,
    /// Loss scaling: the scale of this step (none without scaling).
    pub loss_scale: Option<f32>,
    /// Layer forwards run again in backward that the strategy counted itself (a plan's).
    pub recomputed: usize,
    /// The step's attention across `cp`, when the strategy's own (a plan's) computed it.
    pub attention: Option<AttentionWork>,
    /// The optimizer step was skipped (a scaled gradient overflowed).
    pub skipped: bool,
}

impl StepOutcome {
    /// The outcome of a step whose gradients a data-parallel reducer reduced.
    fn reduced(loss_sum: f64, report: &ReduceReport, memory: MemoryReport) -> Self {
        StepOutcome {
            memory,
            comm: report.comm,
            overlapped: report.overlapped,
            exposed: report.exposed,
            ..Self::new(loss_sum, report.grad_norm)
        }
    }

    /// `self` with what a pipeline schedule measured on this rank: its wall time, its idle
    /// part (the bubble: receive waits and hand-offs), the most micro-batches in flight and
    /// every action.
    fn scheduled(self, report: PipelineStepReport) -> Self {
        StepOutcome {
            exposed: report.wall.saturating_sub(report.forward + report.backward),
            pipeline: report.wall,
            in_flight: report.peak_in_flight,
            events: report.events,
            ..self
        }
    }

    /// An outcome with nothing but the loss and the norm measured.
    fn new(loss_sum: f64, grad_norm: f32) -> Self {
        StepOutcome {
            loss_sum,
            grad_norm,
            comm: Duration::ZERO,
            overlapped: Duration::ZERO,
            exposed: Duration::ZERO,
            memory: MemoryReport::default(),
            events: vec![],
            in_flight: 0,
            pipeline: Duration::ZERO,
            moe: None,
            a2a: Duration::ZERO,
            loss_scale: None,
            skipped: false,
            recomputed: 0,
            attention: None,
        }
    }
}

/// A job's precision policy and its running loss scale (equal on every rank).
pub(crate) struct Precisions {
    pub policy: MixedPrecision,
    pub scaler: LossScaler,
}

impl Precisions {
    /// After a step's gradients were reduced: records the loss scale and whether the step is
    /// skipped (a scaled gradient overflowed: the global norm is not finite, the same on
    /// every rank); returns whether to apply it.
    fn apply(&mut self, outcome: &mut StepOutcome) -> bool {
        let (apply, scale) = self.decide(outcome.grad_norm);
        outcome.loss_scale = scale;
        outcome.skipped = !apply;
        apply
    }

    /// [`Precisions::apply`] from the step's global gradient norm: whether to apply the step,
    /// and the loss scale it ran with (none without scaling).
    fn decide(&mut self, grad_norm: f32) -> (bool, Option<f32>) {
        if !self.scaler.is_active() {
            return (true, None);
        }
        let scale = self.scaler.scale();
        (self.scaler.update(grad_norm.is_finite()), Some(scale))
    }
}

/// A model a training step takes the next-token loss of (the whole model, or this rank's
/// tensor-parallel part of it).
pub(crate) trait NextTokenLoss: Module {
    fn loss(
        &self,
        inputs: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        fwd: &ForwardContext,
    ) -> Tensor<1>;
}

impl NextTokenLoss for Transformer {
    fn loss(
        &self,
        inputs: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        fwd: &ForwardContext,
    ) -> Tensor<1> {
        self.forward_loss(inputs, targets, fwd)
    }
}

impl NextTokenLoss for TpTransformer {
    fn loss(
        &self,
        inputs: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        fwd: &ForwardContext,
    ) -> Tensor<1> {
        self.forward_loss(inputs, targets, fwd)
    }
}

/// Every micro-batch of a step under a bucketed reducer (DDP, ZeRO-1/2, TP + DDP): forward
/// through `loss`, backward, gradients handed over. Returns the sum of the micro-batch losses.
fn run_micro_batches<S: MicroBatches, M: NextTokenLoss>(
    sync: &mut S,
    model: &M,
    batches: Batches<'_>,
    micro_batches: usize,
    precision: &Precisions,
) -> Result<f64, RankError> {
    sync.begin_step(micro_batches);
    let mut loss_sum = 0.0;
    for micro in 0..micro_batches {
        let (inputs, targets, fwd) = batches(micro);
        // Under a reduced-precision policy the forward runs on a cast view of the f32
        // parameters; backward brings their gradients back in f32.
        let compute = precision.policy.compute_view(sync.prepare(model));
        let l = compute.loss(inputs, targets, &fwd);
        loss_sum += l.clone().into_scalar::<f32>() as f64;
        let l = precision.scaler.scale_loss(l);
        let grads = GradientsParams::from_grads(l.backward(), model);
        sync.backward_done(model, grads)?;
    }
    Ok(loss_sum)
}

/// What a replica holds under DDP: whole parameters, the gradient's peak, and Burn's AdamW
/// with two f32 moments per parameter.
fn replicated_memory(ddp: &DataParallel) -> MemoryReport {
    let numel = ddp.layout().numel;
    MemoryReport {
        params: numel * 4,
        grads: ddp.peak_grad_bytes(),
        optimizer: numel * 8,
        gathered_peak: 0,
    }
}

/// The global norm of a flat gradient laid out as `entries` say, clipped to `clip` in place;
/// returns the norm before clipping.
fn clip_placed(
    entries: &[(ParamSlot, &ParamPlacement)],
    flat: &mut [f32],
    clip: Option<f32>,
    ctx: &RankContext,
) -> Result<f32, RankError> {
    let parts = entries
        .iter()
        .map(|(slot, entry)| (*entry, &flat[slot.offset..slot.offset + slot.numel]));
    let norm = global_grad_norm(parts, ctx)?;
    if let Some(scale) = clip_scale(norm, clip)? {
        flat.iter_mut().for_each(|g| *g *= scale);
    }
    Ok(norm)
}

/// How a strategy whose parameters' placements describe them reduces a step's gradients:
/// summed over the ranks each placement names, then the mean over the ranks that read
/// different samples and the micro-batches (or the sum), then clipped to the global norm.
pub(crate) struct PlacedReduction {
    reducer: GradientReducer,
    /// Every rank reading its own samples (`dp x fsdp x ep x cp`).
    batch: Group,
    /// Gradients are means over the batch (sums otherwise).
    average: bool,
}

impl PlacedReduction {
    /// The job's reduction over `batch` (collective: makes the reducer's groups).
    fn new(ctx: &RankContext, config: &TrainConfig, batch: &Group) -> Result<Self, RankError> {
        Ok(PlacedReduction {
            reducer: GradientReducer::new(ctx, config.precision.reduce_dtype)?,
            batch: batch.clone(),
            average: config.parallel.gradient_reduction == GradientReduction::Mean,
        })
    }

    /// Reduces `grads` (this rank's, summed over `micro_batches`, laid out as `entries`) and
    /// clips them to `clip`; returns the global norm before clipping.
    fn reduce_and_clip(
        &self,
        entries: &[(ParamSlot, &ParamPlacement)],
        grads: &mut [f32],
        micro_batches: usize,
        clip: Option<f32>,
        ctx: &RankContext,
    ) -> Result<f32, RankError> {
        let scale = match self.average {
            true => 1.0 / (self.batch.size() * micro_batches) as f32,
            false => 1.0,
        };
        self.reducer.reduce(entries, grads, scale, None)?;
        clip_placed(entries, grads, clip, ctx)
    }
}

/// `entries` held by value, seen as `clip_placed` and `placed_segments` take them.
fn borrowed(entries: &[(ParamSlot, ParamPlacement)]) -> Vec<(ParamSlot, &ParamPlacement)> {
    entries.iter().map(|(s, e)| (s.clone(), e)).collect()
}

/// This rank's index among the ranks that differ from it only along `axes` (row-major over
/// `axes`), and their number: the ranks that hold the same data and share writing it.
fn replica_index(ctx: &RankContext, axes: &[Axis]) -> (usize, usize) {
    axes.iter().fold((0, 1), |(index, count), &axis| {
        let group = ctx.group(axis);
        (index * group.size() + group.rank(), count * group.size())
    })
}

/// The axes whose ranks hold the same (whole or split) model and share writing it: the dp
/// replicas and the cp ranks.
const SHARING: [Axis; 2] = [Axis::Dp, Axis::Cp];

/// A rank's state for a checkpoint: `params` and `adam`'s moments, both laid out as
/// `segments` say.
fn with_moments(params: Vec<f32>, segments: Vec<Segment>, adam: &FlatAdamW) -> LocalState {
    let (m1, m2) = adam.moments();
    LocalState {
        params,
        moment_segments: segments.clone(),
        param_segments: segments,
        moments: [m1.to_vec(), m2.to_vec()],
        steps_taken: adam.steps_taken(),
    }
}

/// How a rank's model turns back into the whole one (values only; collective over tp).
trait WholeModel: NextTokenLoss + 'static {
    fn whole(&self) -> Result<Transformer, RankError>;
}

impl WholeModel for Transformer {
    fn whole(&self) -> Result<Transformer, RankError> {
        Ok(self.clone().valid())
    }
}

impl WholeModel for TpTransformer {
    fn whole(&self) -> Result<Transformer, RankError> {
        Ok(self.unshard()?)
    }
}

/// `module` with a checkpointed state's parameters, and `adam` with its moments and step
/// count: the restore of a strategy that holds its parameters as one module.
fn restore_flat<M: Module>(
    module: M,
    state: LocalState,
    adam: &mut FlatAdamW,
) -> Result<M, RankError> {
    let LocalState {
        params,
        moments: [m1, m2],
        steps_taken,
        ..
    } = state;
    adam.restore(steps_taken, m1, m2)?;
    Ok(flashover_parallel::params::load_flat(module, &params))
}

/// Named flat values of a whole model (world rank 0 reports them).
fn named_params<M: Module>(full: &M) -> Vec<(String, Vec<f32>)> {
    let layout = flashover_parallel::params::ParamLayout::of(full);
    let flat = flashover_parallel::params::flatten_params(full);
    layout
        .slots
        .iter()
        .map(|s| (s.name.clone(), flat[s.offset..s.offset + s.numel].to_vec()))
        .collect()
}
