//! The data-parallel part of a step: a plan's gradients reduced over the ranks that hold the
//! same values, in the buckets, then divided, clipped and handed to the optimizer (whole, or
//! as this rank's rows under ZeRO-1/2).

use super::Parallelized;
use super::loop_overlap::LoopOverlap;
use super::replica_check::ReplicaCheck;
use crate::data_parallel::{
    BucketedReduction, GradientRowLayout, ReductionReport, ReductionTiming,
};
use crate::error::ParallelError;
use crate::grad_clip::{GradNorm, clipped};
use crate::params::{accumulate_grads, grads_from_flat, part, zero_grads};
use crate::placement::global_grad_norm;
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Tensor};
use flashover_runtime::RankContext;

/// The plan's gradient reduction on this rank ([`Parallelized::reducer`]): every gradient
/// summed over the ranks that hold the same values and read different samples, in buckets,
/// during backward where it can. [`Parallelized::gradients`], `row_gradients`,
/// `reduce_gradients` and a pipeline's step run it; this object says how.
pub struct GradientReducer {
    pub(super) buckets: BucketedReduction,
    /// With `tp`, the first step's check that the parameters whole on every `tp` rank got the
    /// same gradient on each (under sequence parallelism, that every whole parameter that runs
    /// on sequence shards is named).
    pub(super) replica_check: Option<ReplicaCheck>,
    /// Why a step of this plan reduces after backward whatever the device can do (fully
    /// sharded units, hot-expert copies, a schedule that splits backward), if it does.
    pub(super) after_backward: Option<&'static str>,
    /// Where a loop of one's own is in its step, for gradient buckets reduced during its
    /// backward ([`Parallelized::forward`] on hooked parameters).
    pub(super) loop_overlap: LoopOverlap,
    /// What the last gradient reduction did and cost.
    pub(super) last_reduction: std::sync::Mutex<ReductionReport>,
}

impl GradientReducer {
    /// What the last gradient reduction did and cost (a pipeline step's is also its
    /// [`super::PipelineStep::reduction`]): whether hooks reported the gradients during
    /// backward, and how much of the communication ran before backward ended.
    pub fn last_reduction(&self) -> ReductionReport {
        self.last_reduction
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Under the plan's `gradient_buckets.rows` (ZeRO-1/2): which rows of which parameters
    /// [`Parallelized::row_gradients`] and [`super::PipelineStep::rows`] hold.
    pub fn rows(&self) -> Option<&GradientRowLayout> {
        self.buckets.row_layout()
    }

    /// Gradient buckets per step (over every set of reduction axes), and when a step of this
    /// plan reduces them on `device`: during backward where the plan's
    /// `gradient_buckets.overlap` asks, the device has the gradient hook op, and the step's
    /// backwards cover every parameter (a pipeline's schedule) or its forwards run through
    /// [`Parallelized::forward`] (a loop of one's own, from its second step: see
    /// [`Parallelized::gradients`]); after backward otherwise, and why.
    pub fn buckets(&self, device: &burn::tensor::Device) -> (usize, ReductionTiming) {
        let timing = match self.after_backward {
            Some(why) => ReductionTiming::AfterBackward(why),
            None => self.buckets.timing(device),
        };
        (self.buckets.buckets(), timing)
    }
}

/// A step's gradients after the reduction.
pub(super) struct Reduced {
    pub(super) grads: GradientsParams,
    /// Under gradient rows: this rank's rows (and `grads` empty); empty otherwise, and on a
    /// step that does not apply.
    pub(super) rows: Tensor<1>,
    /// The global norm before clipping, on the device.
    pub(super) norm: GradNorm,
    /// Whether the step applies (false: a scaled gradient overflowed).
    pub(super) applied: bool,
    pub(super) report: ReductionReport,
}

impl Parallelized {
    /// Why the forward of a loop of one's own does not run on hooked parameters that hand
    /// their gradients to the buckets during backward, or `None` when it does.
    pub(super) fn loop_hooks_ruled_out<M: Module>(&self, model: &M) -> Option<&'static str> {
        let Some(device) = model.devices().into_iter().next() else {
            return Some("the model has no parameters");
        };
        match self.reducer.buckets(&device).1 {
            ReductionTiming::AfterBackward(why) => Some(why),
            ReductionTiming::DuringBackward => None,
        }
    }

    /// The gradients of the whole batch's mean loss for this rank's parameters, from
    /// `backward` of this rank's mean loss: summed over the ranks that hold the same values
    /// and read different samples (the placements say which) and divided by the number of
    /// data ranks. Then, with `max_norm`, clipped by their global norm (every element of the
    /// whole model counted once): scaled by `max_norm / (norm + 1e-6)` when `norm > max_norm`,
    /// as [`crate::clip_global_norm`] does on one device, all on the device. Returns them with
    /// the norm before clipping, on the device too ([`GradNorm::value`] reads it: on a GPU, a
    /// wait for the device queue, best after the optimizer step is queued). Under a
    /// `mixed_precision` that scales the loss, the gradients of [`Self::backward`] are
    /// unscaled first, and a step whose norm overflowed (not finite)
    /// returns no gradients (an optimizer step with them changes nothing) and moves the
    /// scale. Fails under a `mixed_precision` whose forward ran outside [`Self::forward`] or
    /// whose backward did not scale the loss. Collective: every rank calls it once per step.
    ///
    /// When the step's forwards ran through [`Self::forward`], the buckets are filled by
    /// gradient hooks while backward runs, and from the second step on the backward of the
    /// step's last micro-batch (as many as the step before ran: a forward, then its backward)
    /// reduces each bucket as it completes, as DDP does ([`GradientReducer::buckets`] says
    /// whether, [`GradientReducer::last_reduction`] how much ran before backward ended). Forwards that
    /// run outside it are reduced after backward, in the same order with the same sums.
    pub fn gradients<M: Module>(
        &self,
        model: &M,
        backward: Gradients,
        max_norm: Option<f32>,
        ctx: &RankContext,
    ) -> Result<(GradientsParams, GradNorm), ParallelError> {
        let grads = self.taken_gradients(model, backward)?;
        self.reduce_gradients(model, grads, max_norm, ctx)
    }

    /// [`Self::gradients`] under the plan's `gradient_buckets.rows` (ZeRO-1/2 in a loop of
    /// one's own): this rank's rows of the reduced, clipped gradients, laid out as
    /// [`GradientReducer::rows`] says (what [`crate::zero::RowAdamW::step`] steps), with the
    /// norm before clipping. The rows are empty on a step whose scaled gradients overflowed.
    /// Fails without `gradient_buckets.rows`, and under a pipelined plan (whose rows come in
    /// [`super::PipelineStep::rows`]). Collective: every rank calls it once per step.
    pub fn row_gradients<M: Module>(
        &self,
        model: &M,
        backward: Gradients,
        max_norm: Option<f32>,
        ctx: &RankContext,
    ) -> Result<(Tensor<1>, GradNorm), ParallelError> {
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
                 so train with Parallelized::pipeline()?.step, which runs the schedule"
                    .into(),
            ));
        }
        Ok(GradientsParams::from_grads(backward, model))
    }

    /// [`Self::gradients`] of gradients already taken from the backward pass (what a
    /// burn-train `TrainStep` returns, or several passes' accumulated); under a pipelined
    /// plan, of [`PipelineRunner::gradients`](super::PipelineRunner::gradients) (tied copies summed too). Collective.
    pub fn reduce_gradients<M: Module>(
        &self,
        model: &M,
        grads: GradientsParams,
        max_norm: Option<f32>,
        ctx: &RankContext,
    ) -> Result<(GradientsParams, GradNorm), ParallelError> {
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
        let device = super::grad_device(model, ctx);
        let (mut flat, _) = accumulate_grads(model, &grads, zero_grads(model, &device), &[]);
        if !self.is_pipelined() {
            // The copies' gradients are summed like the model's (scaled alike under f16).
            flat = self.fold_hot_experts(model, flat, 1.0)?;
        }
        match (self.reducer.buckets.row_layout().is_some(), rows) {
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
        if !self.reducer.loop_overlap.end_step() {
            self.reducer.buckets.begin_step(false);
        }
        self.reduce_and_clip(model, flat, unscale.unwrap_or(1.0), max_norm, ctx)
    }

    /// `flat` (this rank's gradients in `model`'s layout on the device, not yet reduced: what hooks did not
    /// hand to the buckets of the step begun) summed over the ranks that hold the same values
    /// and read different samples, divided by `divisor` (micro-batches and loss scale) and by
    /// the data ranks, clipped by the global norm; with the norm before clipping. Under loss
    /// scaling, a step whose norm overflowed gets no gradients (every rank sees the same norm,
    /// so every rank's scaler decides alike).
    pub(super) fn reduce_and_clip<M: Module>(
        &self,
        model: &M,
        flat: Tensor<1>,
        divisor: f32,
        max_norm: Option<f32>,
        ctx: &RankContext,
    ) -> Result<Reduced, ParallelError> {
        self.sequences.check_attended(self.pipeline_ranks())?;
        self.reducer.buckets.add_remaining(&flat);
        // Whole gradients in the model's layout, or this rank's rows of them.
        let row_entries;
        let (mut values, entries, report) = match self.reducer.buckets.row_layout() {
            None => {
                let (flat, report) = self.reducer.buckets.finish(flat)?;
                (flat, self.sharded.placements.entries_of(model)?, report)
            }
            Some(rows) => {
                let (values, report) = self.reducer.buckets.finish_rows(flat)?;
                row_entries =
                    rows.shards
                        .placed(&rows.layout, &self.sharded.placements, rows.axis, 0)?;
                let entries = row_entries.iter().map(|(s, e)| (s.clone(), e)).collect();
                (values, entries, report)
            }
        };
        // The tp ranks of one data coordinate reduce equal values over the same data ranks.
        if let Some(check) = &self.reducer.replica_check {
            check.first_step(&entries, &values)?;
        }
        // One division by the whole denominator (micro-batches, loss scale, data ranks), as
        // DDP divides: the same bits as DDP's whatever the number of ranks.
        let denominator = divisor * self.data_split.averaged().size() as f32;
        if denominator != 1.0 {
            values = values.div_scalar(denominator);
        }
        let parts =
            (entries.iter()).map(|(slot, entry)| (*entry, part(&values, slot.offset, slot.numel)));
        let norm = global_grad_norm(parts, &values.device(), ctx)?;
        let applied = self.precision.apply(&norm);
        if applied {
            values = clipped(values, &norm, max_norm)?;
        }
        *self
            .reducer
            .last_reduction
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = report.clone();
        let empty = || Tensor::zeros([0], &values.device());
        let (grads, rows) = match (applied, self.reducer.buckets.row_layout()) {
            (false, _) => (GradientsParams::new(), empty()),
            (true, Some(_)) => (GradientsParams::new(), values),
            (true, None) => (grads_from_flat(model, &values), empty()),
        };
        Ok(Reduced {
            grads,
            rows,
            norm,
            applied,
            report,
        })
    }
}
