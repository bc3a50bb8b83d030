//! A pipelined plan's steps: this rank's stages run through the schedule, their gradients
//! reduced as a loop's are.

use super::Parallelized;
use super::pipeline::{self, PipelineModel, Stages};
use crate::data_parallel::{BucketedReduction, ReductionReport};
use crate::dropout::draws::Draws;
use crate::error::ParallelError;
use crate::params::{accumulate_grads, grads_from_flat};
use crate::pipeline::PipelineStepReport;
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use flashover_runtime::RankContext;
use std::ops::Range;

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
    /// clipped gradients on the device, laid out as [`Parallelized::gradient_rows`] says
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
    /// The share's mean loss and auxiliary loss (the same on every rank of `pp`).
    losses: [f32; 2],
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

impl Parallelized {
    /// One training step of a pipelined plan: this rank's samples of step `step` of batches of
    /// `global_batch` (as [`DataSplit::batch_share`](super::DataSplit::batch_share)) cut into the plan's micro-batches, each
    /// built by `micro_batch(samples)` on every stage (layers may read it:
    /// [`PipelineModel::layer_for`]), run through the plan's schedule over this rank's stages
    /// of `model` ([`PipelineModel`]). What travels between
    /// stages has the shapes of the first stage's `embed` output, learned on the first step
    /// (every micro-batch of a run has one shape). The gradients are reduced and clipped as
    /// [`Self::gradients`] does; tied copies (an embedding the first and the last stage both
    /// hold) summed. Collective.
    pub fn pipeline_step<M>(
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
        let share = self.data_split.share(global_batch, step)?;
        let head = |m: &M, x, batch: &M::Batch, _| m.head_loss(x, batch);
        let loss_scale = self.precision.loss_scale();
        let device = step_device(model, ctx);
        let hooked = self.pipeline_stages()?.hooks_allowed() && self.buckets.hooks_on(&device);
        self.buckets.begin_step(hooked);
        let hooks = hooked.then_some(&self.buckets);
        let draws = self.data_split.draws(step, share.clone());
        let mut run = self.run_stages(
            model,
            share,
            Some(&draws),
            micro_batch,
            &head,
            loss_scale,
            hooks,
            ctx,
        )?;
        self.data_split.mean_over_ranks(&mut run.losses)?;
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
    pub fn pipeline_gradients<M>(
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
        let loss_scale = self.precision.loss_scale();
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
        let [loss, aux_loss] = run.losses;
        Ok(PipelineStep {
            grads: grads_from_flat(model, &flat),
            rows: Tensor::zeros([0], &flat.device()),
            loss,
            aux_loss,
            norm: f32::NAN,
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
        let stages = self.pipeline_stages()?;
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
        let flat = self.fold_hot_experts(model, flat, 1.0)?;
        let micro_batches = stages.schedule.micro_batches as f32;
        Ok(StagesRun {
            flat,
            divisor: micro_batches * loss_scale.unwrap_or(1.0),
            losses,
            report,
            recomputed: stages.recomputed() - before,
        })
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
    pub fn pipeline_forward<M>(
        &self,
        model: &M,
        batch: &M::Batch,
    ) -> Result<Option<M::Activation>, ParallelError>
    where
        M: PipelineModel,
    {
        self.pipeline_stages()?.forward(model, batch)
    }

    /// Whether this rank runs the last pipeline stage, where the loss and the model's
    /// outputs are computed (every rank does without a pipeline).
    pub fn runs_last_stage(&self) -> bool {
        self.stages.as_ref().is_none_or(Stages::runs_last_stage)
    }
}
