//! A pipelined plan's schedule runner ([`PipelineRunner`]): this rank's stages run through the
//! schedule, their gradients reduced as a loop's are.

use super::Parallelized;
use super::pipeline::{self, PipelineModel, Stages};
use super::step_scalars::StepScalars;
use crate::data_parallel::{BucketedReduction, ReductionReport};
use crate::dropout::draws::Draws;
use crate::error::ParallelError;
use crate::grad_clip::GradNorm;
use crate::params::{accumulate_grads, grads_from_flat};
use crate::pipeline::PipelineStepReport;
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use flashover_comm::Group;
use flashover_runtime::RankContext;
use std::ops::Range;

/// What one [`PipelineRunner::step`] (or [`PipelineRunner::gradients`]) computed.
pub struct PipelineStep {
    /// This rank's gradients, reduced and clipped as [`Parallelized::gradients`] returns them.
    pub grads: GradientsParams,
    /// The step's loss, auxiliary loss and gradient norm, on the device: read them with
    /// [`StepScalars::read`] (one host read), once the optimizer step is queued.
    pub scalars: StepScalars,
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
    /// [`PipelineRunner::gradients`], which does not reduce).
    pub reduction: ReductionReport,
    /// Under the plan's `gradient_buckets.rows` (ZeRO-1/2): this rank's rows of the reduced,
    /// clipped gradients on the device, laid out as [`super::GradientReducer::rows`] says
    /// (`grads` is then empty); empty otherwise, and on a skipped step.
    pub rows: Tensor<1>,
}

/// What one run of a rank's pipeline stages computed.
struct StagesRun {
    /// This rank's gradients in the model's layout on the device, not yet reduced: sums over
    /// the micro-batches of the scaled losses' gradients (zero where hooks took them).
    flat: Tensor<1>,
    /// What `flat` is divided by to make it the unscaled mean over micro-batches.
    divisor: f32,
    /// The share's mean loss and auxiliary loss, on the device (the same on every rank of
    /// `pp`).
    losses: Tensor<1>,
    report: PipelineStepReport,
    recomputed: usize,
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

/// A pipelined plan's schedule runner on this rank ([`Parallelized::pipeline`]): a training
/// step through the plan's schedule ([`Self::step`]), a step's unreduced gradients for a
/// loop that accumulates or reduces them itself ([`Self::gradients`]), and the forward alone
/// ([`Self::forward`]). It borrows the parallelized model's reduction, data split and
/// precision, which its steps use as a loop's do.
pub struct PipelineRunner<'a> {
    par: &'a Parallelized,
    stages: &'a Stages,
}

impl Parallelized {
    /// The plan's pipeline schedule runner, or why there is none (the plan has no pipeline
    /// rule). A plan whose stages all sit on one rank (no `pp` axis) has one too.
    pub fn pipeline(&self) -> Result<PipelineRunner<'_>, ParallelError> {
        let stages = self.stages.as_ref().ok_or_else(|| {
            ParallelError::Invalid(
                "a pipeline step needs a plan with a pipeline rule (ParallelizePlan::pipeline)"
                    .into(),
            )
        })?;
        Ok(PipelineRunner { par: self, stages })
    }

    /// `flat` (`model`'s layout) with the step's hot-expert copies' gradients, summed over
    /// `ep` and times `scale`, added to the experts this rank owns, under
    /// `replicate_hot_experts` (collective over `ep`).
    pub(super) fn fold_hot_experts<M: Module>(
        &self,
        model: &M,
        flat: Tensor<1>,
        scale: f32,
    ) -> Result<Tensor<1>, ParallelError> {
        match &self.hot_experts {
            Some((replicas, ep)) => {
                let folded = replicas.fold(ep, scale)?;
                Ok(accumulate_grads(model, &folded, flat, &[]).0)
            }
            None => Ok(flat),
        }
    }
}

impl PipelineRunner<'_> {
    /// One training step of a pipelined plan: this rank's samples of step `step` of batches of
    /// `global_batch` (as [`DataSplit::batch_share`](super::DataSplit::batch_share)) cut into the plan's micro-batches, each
    /// built by `micro_batch(samples)` on every stage (layers may read it:
    /// [`PipelineModel::layer_for`]), run through the plan's schedule over this rank's stages
    /// of `model` ([`PipelineModel`]). What travels between
    /// stages has the shapes of the first stage's `embed` output, learned on the first step
    /// (every micro-batch of a run has one shape). The gradients are reduced and clipped as
    /// [`Parallelized::gradients`] does; tied copies (an embedding the first and the last stage both
    /// hold) summed. Collective.
    pub fn step<M>(
        &self,
        model: &M,
        global_batch: usize,
        step: usize,
        micro_batch: &(dyn Fn(Range<usize>) -> M::Batch + Sync),
        max_norm: Option<f32>,
        ctx: &RankContext,
    ) -> Result<PipelineStep, ParallelError>
    where
        M: PipelineModel + Sync + 'static,
    {
        let share = self.par.data_split.share(global_batch, step)?;
        let head = |m: &M, x, batch: &M::Batch, _| m.head_loss(x, batch);
        let loss_scale = self.par.precision.loss_scale();
        let device = step_device(model, ctx);
        let hooked = self.stages.hooks_allowed() && self.par.reducer.buckets.hooks_on(&device);
        self.par.reducer.buckets.begin_step(hooked);
        let hooks = hooked.then_some(&self.par.reducer.buckets);
        let draws = self.par.data_split.draws(step, share.clone());
        let run = self.run_stages(
            model,
            share,
            Some(&draws),
            micro_batch,
            &head,
            loss_scale,
            hooks,
            ctx,
        )?;
        let losses = self.par.data_split.mean_over_ranks(run.losses)?;
        let reduced = self
            .par
            .reduce_and_clip(model, run.flat, run.divisor, max_norm, ctx)?;
        Ok(PipelineStep {
            grads: reduced.grads,
            scalars: StepScalars::new(losses, reduced.norm),
            report: run.report,
            recomputed: run.recomputed,
            loss_scale,
            skipped: !reduced.applied,
            reduction: reduced.report,
            rows: reduced.rows,
        })
    }

    /// One step's gradients of a pipelined plan over the `samples` samples this rank reads
    /// (its share of the global batch, as a data loader that batches each data rank's share
    /// gives it: `flashover::learner` does), cut into the plan's micro-batches: micro-batch
    /// `k` is `micro_batch(k * n..(k + 1) * n)` of them (`n = samples / micro-batches`), and
    /// its loss on the last stage is `head(model, x, &micro_batch, k)` of the layers' output
    /// `x` (`PipelineModel::head_loss`, or a head that also keeps what metrics read). Unlike
    /// [`Self::step`], the gradients are this rank's, not yet reduced: sum several
    /// steps' to accumulate, then reduce them with [`Parallelized::reduce_gradients`]. The losses are
    /// this rank's share's means. Under a `mixed_precision` that scales the loss, each
    /// micro-batch's loss is scaled by the running scale ([`PipelineStep::loss_scale`]) and the
    /// gradients come back unscaled; whether the step overflowed is decided from the reduced
    /// norm, by [`Parallelized::reduce_gradients`] (which then returns no gradients and moves the
    /// scale). Collective over `pp`.
    pub fn gradients<M>(
        &self,
        model: &M,
        samples: usize,
        micro_batch: &(dyn Fn(Range<usize>) -> M::Batch + Sync),
        head: &pipeline::HeadLoss<'_, M>,
        ctx: &RankContext,
    ) -> Result<PipelineStep, ParallelError>
    where
        M: PipelineModel + Sync + 'static,
    {
        let loss_scale = self.par.precision.loss_scale();
        // No step and no global sample indices: the device's generator draws the masks.
        let run = self.run_stages(
            model,
            0..samples,
            None,
            micro_batch,
            head,
            loss_scale,
            None,
            ctx,
        )?;
        let flat = run.flat.div_scalar(run.divisor);
        let no_norm = Tensor::full([1], f32::NAN, &run.losses.device());
        Ok(PipelineStep {
            grads: grads_from_flat(model, &flat),
            rows: Tensor::zeros([0], &flat.device()),
            scalars: StepScalars::new(run.losses, GradNorm::from_tensor(no_norm)),
            report: run.report,
            recomputed: run.recomputed,
            loss_scale,
            skipped: false,
            reduction: ReductionReport::default(),
        })
    }

    /// The forwards and backwards of this rank's stages over `share`, each micro-batch's loss
    /// scaled by `loss_scale`; with `hooks`, the forwards run on hooked parameters that hand
    /// their gradients to the buckets.
    #[allow(clippy::too_many_arguments)]
    fn run_stages<M>(
        &self,
        model: &M,
        share: Range<usize>,
        draws: Option<&Draws>,
        micro_batch: &(dyn Fn(Range<usize>) -> M::Batch + Sync),
        head: &pipeline::HeadLoss<'_, M>,
        loss_scale: Option<f32>,
        hooks: Option<&BucketedReduction>,
        ctx: &RankContext,
    ) -> Result<StagesRun, ParallelError>
    where
        M: PipelineModel + Sync + 'static,
    {
        let stages = self.stages;
        let device = step_device(model, ctx);
        let before = stages.recomputed();
        let (flat, losses, report) = stages.step(
            model,
            share,
            draws,
            &device,
            micro_batch,
            head,
            loss_scale,
            hooks,
        )?;
        // The stages' gradients and the copies' are both sums of the scaled losses'.
        let flat = self.par.fold_hot_experts(model, flat, 1.0)?;
        let micro_batches = stages.schedule.micro_batches as f32;
        Ok(StagesRun {
            flat,
            divisor: micro_batches * loss_scale.unwrap_or(1.0),
            losses,
            report,
            recomputed: stages.recomputed() - before,
        })
    }

    /// The layers' output of `batch` through the plan's pipeline, forward only (validation,
    /// inference; `model` on a plain device): `Some` on the ranks that run the last stage,
    /// where the model's head reads it, `None` on the others. The first stage embeds `batch`
    /// (its whole samples, no micro-batches); each stage's output travels to the next one's
    /// rank in f32. Collective over `pp`.
    pub fn forward<M>(
        &self,
        model: &M,
        batch: &M::Batch,
    ) -> Result<Option<M::Activation>, ParallelError>
    where
        M: PipelineModel,
    {
        self.stages.forward(model, batch)
    }

    /// Whether this rank runs the last pipeline stage, where the loss and the model's
    /// outputs are computed.
    pub fn runs_last_stage(&self) -> bool {
        self.stages.runs_last_stage()
    }

    /// Whether the stages span more than one rank (the plan's `pp` axis): a rank's forward
    /// is then a stage's.
    pub fn is_split(&self) -> bool {
        self.stages.split_ranks().is_some()
    }

    /// The ranks of the first and the last pipeline stage when this rank holds a module both
    /// run (an embedding tied to the head): they sum its copies' gradients. For a caller that
    /// reduces [`Self::gradients`] itself; [`Parallelized::reduce_gradients`] sums them.
    pub fn tied_copies(&self) -> Option<&Group> {
        self.stages.tie_group()
    }
}
