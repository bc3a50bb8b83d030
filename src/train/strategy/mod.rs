//! How one rank holds and steps the reference transformer: [`plan_pipeline::build`]
//! parallelizes it with the job's plan and returns the [`PlanPipeline`] that runs its steps;
//! the training loop talks to it only.
//!
//! Every layout runs through the plan ([`plan_pipeline`]): `parallelize` with a pipeline rule
//! (one stage without `pp`), then `PipelineRunner::step` each step, AdamW on what the
//! rank holds or, under ZeRO-1/2 (and ZeRO-3 by rows), on its rows (the library's `RowAdamW`).
//!
//! What is shared is here: the step's outcome, the precision policy's loss scale and the
//! checkpoint view of a rank's state.

pub(crate) mod plan_pipeline;

pub(crate) use plan_pipeline::PlanPipeline;
mod routing;

use super::checkpoint::{LocalState, Segment};
use burn::module::Module;
use burn::tensor::{Int, Tensor};
use flashover_models::ForwardContext;
use flashover_parallel::FlatAdamW;
use flashover_parallel::context_parallel::AttentionWork;
use flashover_parallel::parallelize::StepScalars;
use flashover_parallel::params::ParamSlot;
use flashover_parallel::pipeline::{Action, PipelineStepReport};
use flashover_parallel::placement::ParamPlacement;
use flashover_parallel::zero::MemoryReport;
use flashover_runtime::{Axis, RankContext, RankError};
use std::time::{Duration, Instant};

/// A step's micro-batches: `batches(i)` gives micro-batch `i`'s inputs, targets and forward
/// context (dropout, positions, hooks).
pub(crate) type Batches<'a> =
    &'a mut dyn FnMut(usize) -> (Tensor<2, Int>, Tensor<2, Int>, ForwardContext);

/// A rank's [`LocalState`] and, for its parameters and then its moments, `(index, count)` of
/// the ranks holding the same data, which share writing it.
pub(crate) type SharedState = (LocalState, (usize, usize), (usize, usize));

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
    /// The step's loss and norm, on the device until the job reads them.
    pub scalars: PendingScalars,
    /// Pipeline: the schedule's idle part (receive waits and hand-offs); zero without one.
    pub bubble: Duration,
    pub memory: MemoryReport,
    /// Pipeline actions and receive waits (pipelines only).
    pub events: Vec<(Action, Instant, Instant)>,
    /// Pipeline: most micro-batches held at once.
    pub in_flight: usize,
    /// Pipeline: wall time of the schedule.
    pub pipeline: Duration,
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
    /// `self` with what a pipeline schedule measured on this rank: its wall time, its idle
    /// part (the bubble: receive waits and hand-offs), the most micro-batches in flight and
    /// every action.
    fn scheduled(self, report: PipelineStepReport) -> Self {
        StepOutcome {
            bubble: report.wall.saturating_sub(report.forward + report.backward),
            pipeline: report.wall,
            in_flight: report.peak_in_flight,
            events: report.events,
            ..self
        }
    }

    /// An outcome with nothing but the loss and the norm measured.
    fn new(scalars: PendingScalars) -> Self {
        StepOutcome {
            scalars,
            bubble: Duration::ZERO,
            memory: MemoryReport::default(),
            events: vec![],
            in_flight: 0,
            pipeline: Duration::ZERO,
            a2a: Duration::ZERO,
            loss_scale: None,
            skipped: false,
            recomputed: 0,
            attention: None,
        }
    }
}

/// A step's loss and gradient norm, still on the device: the job reads several steps' in one
/// go (`run.log_every`), so a step does not wait for its device queue to report them.
pub(crate) struct PendingScalars {
    /// The plan's loss, auxiliary loss and norm.
    pub scalars: StepScalars,
    /// What the plan's norm is multiplied by to make the job's (the summed groups, where the
    /// job sums gradients; 1 otherwise).
    pub norm_scale: f32,
    /// Mixture of experts: the step's routing over the global batch, its auxiliary losses
    /// read with the loss.
    pub moe: Option<routing::PendingMoeRecord>,
}

/// `entries` held by value, seen as the checkpoint segments take them.
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
