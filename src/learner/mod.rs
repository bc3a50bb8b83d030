//! Flashover inside burn-train's `Learner`: a model parallelized by a plan, trained by burn-train
//! with its metrics, learning-rate scheduler, gradient accumulation and early stopping.
//!
//! Each rank builds the same training set-up inside [`crate::launch`] (threads here, one process
//! per rank under `mpirun` with the same code): its model through
//! [`parallelize`](crate::prelude::parallelize), its data loaders around [`ShareBatcher`], its
//! `Learner` around the model, and [`ParallelLearning`] as the training strategy. Every rank
//! iterates the same global batches and batches its own share of them. After each step the
//! ranks' outputs are put together ([`GatherOutput`]) and one rank alone reports them, so the
//! metrics are the whole batch's: the loss is the global mean and accuracy counts every sample
//! once. The set-up, with the lines a layout adds marked (`examples/learner_parallel.rs` runs
//! it):
//!
//! ```text
//! launch("fsdp=2,tp=2", |ctx| {                                                    // +
//!     let device = ctx.device().clone().autodiff();
//!     let (model, par) = parallelize(MyModel::new(&device), &plan, &ctx)?;         // +
//!     let batcher = ShareBatcher::new(MyBatcher, &par);                    // (was MyBatcher)
//!     let train = DataLoaderBuilder::new(batcher.clone()).batch_size(32).shuffle(7).build(train_set);
//!     let valid = DataLoaderBuilder::new(batcher).batch_size(32).build(valid_set);
//!     let strategy = ParallelLearning::new(&ctx, par)?.checkpoints(&dir, 2);      // +
//!     let result = SupervisedTraining::new(&dir, train, valid)
//!         .metrics((AccuracyMetric::new(), LossMetric::new()))
//!         .with_training_strategy(strategy.into())                                // +
//!         .launch(Learner::new(model, AdamWConfig::new().init(), 1e-3));
//!     if let Some(error) = result.error {     // burn-train's way to end a failed run
//!         return Err(ParallelError::Invalid(error.to_string()));
//!     }
//!     Ok::<_, ParallelError>(result.model)        // the whole trained model, on every rank  // +
//! })?;                                                                             // +
//! ```
//!
//! What differs from one device, and why:
//! - Gradients are averaged over the data-parallel ranks and, with
//!   [`ParallelLearning::clip_grad_norm`], clipped by the norm of the whole model's gradient.
//!   A Burn optimizer's own `with_grad_clipping(Norm)` clips each parameter by the norm of the
//!   part this rank holds, which is not one device's clipping when a plan splits parameters;
//!   the strategy cannot see the `Learner`'s optimizer to refuse it, so do not combine them.
//! - burn-train's checkpointer records the `Learner`'s model as this rank holds it, parts of
//!   split parameters under the whole parameters' names: it is refused. Flashover's
//!   ([`ParallelLearning::checkpoints`]) replace it, and resume on any mesh.
//! - Only one rank renders and logs metrics, and decides early stopping for every rank
//!   ([`ParallelLearning::reporting_rank`]: rank 0, or the first rank of the last pipeline
//!   stage). With burn-train's `tui` feature, every rank's `SupervisedTraining` builds a
//!   terminal dashboard that takes over the terminal: give the other ranks burn-train's
//!   `CliMetricsRenderer` (`.renderer(..)`), silent when it receives no events.
//! - A plan that cuts the model into pipeline stages trains through
//!   [`ParallelLearning::pipelined`]: each rank runs its stages over micro-batches of its share
//!   (the model implements [`PipelineLearnerModel`], its forward in parts, instead of being run
//!   by its `TrainStep`), and the metrics are reported by the first rank of the last stage,
//!   where the outputs are (TorchTitan logs from there too).
//! - A plan that splits sequences over `cp` needs [`ParallelLearning::split_sequences`]: the
//!   strategy gives each step this rank's positions of every sequence ([`SequenceBatch`]) and
//!   puts the outputs back together in position order for the metrics
//!   ([`GatherOutput::gather_sequences`]).

mod batch;
mod checkpoint;
mod output;
mod steps;

pub use batch::ShareBatcher;
pub use output::{
    GatherOutput, MicroBatchOutput, concat_samples, gather_position_ints, gather_positions,
    gather_sample_ints, gather_samples, mean_over,
};
pub use steps::{
    PipelineLearnerModel, RankSteps, SequenceBatch, SplitSequences, StagedForward, WholeForward,
};

use burn::data::dataloader::{DataLoader, Progress};
use burn::optim::GradientsAccumulator;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn_train::train::WorkerFailure;
use burn_train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent, LearnerModel,
    LearningResult, SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader,
    TrainStep, TrainingComponents, TrainingError, TrainingItem, TrainingStrategy, ValidLoader,
};
use checkpoint::LearnerCheckpoints;
use flashover_comm::{CommunicatorExt, control};
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::Parallelized;
use flashover_parallel::precision::Precision;
use flashover_runtime::RankContext;
use std::path::Path;
use std::sync::{Arc, Mutex};
use steps::check_share;

/// burn-train's training strategy for one rank of a model parallelized by a plan; see the
/// module docs. `.into()` makes it the `TrainingStrategy` that
/// `SupervisedTraining::with_training_strategy` takes. `S` is how the rank computes a step:
/// the model's whole `TrainStep` ([`ParallelLearning::new`]) or its pipeline stages
/// ([`ParallelLearning::pipelined`]), either on this rank's positions of every sequence
/// ([`ParallelLearning::split_sequences`]).
pub struct ParallelLearning<S = WholeForward> {
    ctx: RankContext,
    par: Arc<Parallelized>,
    max_norm: Option<f32>,
    checkpoints: Mutex<LearnerCheckpoints>,
    /// The world rank that reports to burn-train and decides when to stop: the first one that
    /// computes the model's outputs (rank 0, or the first rank of the last pipeline stage).
    reporter: usize,
    steps: S,
}

impl ParallelLearning {
    /// The strategy of this rank (`ctx`) for a model `parallelize` returned with `par`, each
    /// step the model's `TrainStep` on this rank's share. Fails when the plan cuts the model
    /// into pipeline stages (use [`Self::pipelined`]). Collective over the world.
    pub fn new(ctx: &RankContext, par: Parallelized) -> Result<Self, ParallelError> {
        if par.pipeline().is_ok_and(|p| p.is_split()) {
            return Err(ParallelError::Invalid(
                "the plan cuts the model into pipeline stages, but a Learner's TrainStep runs \
                 the whole model's forward and backward on every rank: implement \
                 flashover::learner::PipelineLearnerModel for the model and build the strategy \
                 with ParallelLearning::pipelined"
                    .into(),
            ));
        }
        if par.precision().policy().param_dtype != Precision::F32 {
            return Err(ParallelError::Invalid(format!(
                "the plan's mixed_precision computes in {}, on a cast view of the model, but a \
                 Learner's TrainStep takes its gradients of the model it is handed \
                 (GradientsParams::from_grads(.., self)), which finds none on a view: train \
                 the plan in a loop of your own (Parallelized::forward, backward, gradients), \
                 or leave mixed_precision out",
                par.precision().policy().param_dtype
            )));
        }
        Self::with_steps(ctx, par, WholeForward)
    }

    /// The strategy of this rank for a model a pipelined plan cuts into stages: each training
    /// step runs the plan's
    /// schedule over micro-batches of this rank's share, each validation step runs the stages
    /// forward; the model implements [`PipelineLearnerModel`]. Fails when the plan has no
    /// pipeline rule. Collective over the world.
    pub fn pipelined(
        ctx: &RankContext,
        par: Parallelized,
    ) -> Result<ParallelLearning<StagedForward>, ParallelError> {
        if par.pipeline().is_err() {
            return Err(ParallelError::Invalid(
                "ParallelLearning::pipelined needs a plan with a pipeline rule \
                 (ParallelizePlan::pipeline); for other plans use ParallelLearning::new"
                    .into(),
            ));
        }
        ParallelLearning::with_steps(ctx, par, StagedForward::default())
    }
}

impl<S> ParallelLearning<S> {
    /// The strategy computing steps as `steps` (collective over the world: the ranks agree on
    /// the reporting one).
    fn with_steps(ctx: &RankContext, par: Parallelized, steps: S) -> Result<Self, ParallelError> {
        if par.precision().loss_scale().is_some() {
            return Err(ParallelError::Invalid(
                "the plan's mixed_precision scales the loss (f16), which a Learner's TrainStep \
                 does not: compute in bf16, which needs no loss scaling"
                    .into(),
            ));
        }
        // Every rank computes the outputs without a pipeline.
        let computes_outputs = [u8::from(
            par.pipeline().ok().is_none_or(|p| p.runs_last_stage()),
        )];
        let reporter = match ctx.world_size() {
            1 => 0,
            _ => control(|| ctx.world().all_gather_vec(&computes_outputs))?
                .iter()
                .position(|&c| c == 1)
                .expect("some rank runs the last stage"),
        };
        Ok(ParallelLearning {
            ctx: ctx.clone(),
            par: Arc::new(par),
            max_norm: None,
            checkpoints: Mutex::default(),
            reporter,
            steps,
        })
    }

    /// Each step on this rank's positions of every sequence of its share, for plans that split
    /// sequences over `cp` (harmless under others): the batch type implements
    /// [`SequenceBatch`], and the outputs are put back together in position order for the
    /// metrics ([`GatherOutput::gather_sequences`]: burn-train's `SequenceOutput` has it).
    pub fn split_sequences(self) -> ParallelLearning<SplitSequences<S>> {
        ParallelLearning {
            ctx: self.ctx,
            par: self.par,
            max_norm: self.max_norm,
            checkpoints: self.checkpoints,
            reporter: self.reporter,
            steps: SplitSequences(self.steps),
        }
    }

    /// Clips gradients by the global norm of the whole model's gradient (every element
    /// counted once, whatever the layout), scaled by `max_norm / (norm + 1e-6)` when the norm
    /// exceeds `max_norm`.
    pub fn clip_grad_norm(mut self, max_norm: f32) -> Self {
        self.max_norm = Some(max_norm);
        self
    }

    /// Saves a checkpoint under `dir` at the end of every epoch (`dir/step-0000000E`, the
    /// newest `keep` kept): the model as each rank holds it, the optimizer's state placed as
    /// its parameters are, and the learning-rate scheduler. `SupervisedTraining::checkpoint(e)`
    /// resumes from epoch `e`'s, on any mesh and plan. burn-train's own checkpointer cannot be
    /// used under a plan (it records this rank's parts as if they were the model).
    pub fn checkpoints(self, dir: impl AsRef<Path>, keep: usize) -> Self {
        self.checkpoints_mut().save_to(dir.as_ref(), keep);
        self
    }

    /// Resumes (`SupervisedTraining::checkpoint(e)`) from the checkpoints another run saved
    /// under `dir`, on any mesh and plan.
    pub fn resume_from(self, dir: impl AsRef<Path>) -> Self {
        self.checkpoints_mut().resume_from(dir.as_ref());
        self
    }

    fn checkpoints_mut(&self) -> std::sync::MutexGuard<'_, LearnerCheckpoints> {
        self.checkpoints.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The world rank whose burn-train event processor is fed (the others' receive nothing):
    /// rank 0, or under a pipeline the first rank of the last stage, where the outputs are.
    /// Give the other ranks a silent renderer (see the module docs).
    pub fn reporting_rank(&self) -> usize {
        self.reporter
    }

    /// Whether this rank reports to burn-train's event processor.
    fn reports(&self) -> bool {
        self.ctx.rank() == self.reporter
    }

    /// The reporting rank's decision, the same on every rank (collective over the world).
    fn agreed(&self, decision: bool) -> Result<bool, ParallelError> {
        let mut flag = [decision as u8];
        if self.ctx.world_size() > 1 {
            control(|| self.ctx.world().broadcast(&mut flag, self.reporter))?;
        }
        Ok(flag[0] != 0)
    }

    /// This rank's share of a `batch`-sample batch.
    fn share_of(&self, batch: usize) -> Result<usize, String> {
        let ranks = self.par.data().ranks().size();
        if !batch.is_multiple_of(ranks) {
            return Err(format!(
                "a batch of {batch} samples does not split over {ranks} data-parallel ranks (dp \
                 x fsdp x ep): use a batch size that is a multiple of {ranks}"
            ));
        }
        Ok(batch / ranks)
    }

    /// burn-train's error for a failure on this rank, also printed: burn-train only logs it to
    /// the experiment log and returns it in `LearningResult::error`.
    fn failure(&self, error: impl std::fmt::Display) -> TrainingError {
        eprintln!("flashover::learner: rank {}: {error}", self.ctx.rank());
        TrainingError::Workers(vec![WorkerFailure {
            device_id: self.ctx.rank(),
            message: error.to_string(),
        }])
    }
}

impl<M, S> From<ParallelLearning<S>> for TrainingStrategy<M>
where
    M: LearnerModel,
    S: RankSteps<M>,
    <M as TrainStep>::Output: GatherOutput,
    <M as InferenceStep>::Output: GatherOutput,
{
    fn from(strategy: ParallelLearning<S>) -> Self {
        TrainingStrategy::Custom(Arc::new(strategy))
    }
}

/// What one rank's epochs need besides the learner.
struct Epochs<'a, M: LearnerModel, S> {
    strategy: &'a ParallelLearning<S>,
    events: &'a mut SupervisedTrainingEventProcessor<M>,
    interrupter: &'a Interrupter,
    accumulation: Option<usize>,
}

impl<M, S> Epochs<'_, M, S>
where
    M: LearnerModel,
    S: RankSteps<M>,
    <M as TrainStep>::Output: GatherOutput,
    <M as InferenceStep>::Output: GatherOutput,
{
    /// Epoch `epoch`: training, then validation, with burn-train's split events (sent by the
    /// reporting rank).
    /// Returns whether to stop.
    fn epoch(
        &mut self,
        epoch: usize,
        learner: &mut Learner<M>,
        (train, train_items): (&TrainLoader<M>, usize),
        (valid, valid_items): (&ValidLoader<M>, usize),
    ) -> Result<bool, String> {
        self.report(|e| {
            e.process_train(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: train_items,
            })
        });
        let stop = self.train(learner, train)?;
        self.report(|e| e.process_train(LearnerEvent::EndSplit(epoch)));
        if stop {
            return Ok(true);
        }
        self.report(|e| {
            e.process_valid(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: valid_items,
            })
        });
        let stop = self.valid(learner, valid)?;
        self.report(|e| e.process_valid(LearnerEvent::EndSplit(epoch)));
        self.report(|e| e.process_train(LearnerEvent::EndEpoch(epoch)));
        // Early stopping reads the event store: every event of the epoch in it first.
        self.report(|e| e.flush());
        Ok(stop)
    }

    /// `send` to the event processor on the reporting rank (the others send nothing);
    /// its failure stops training.
    fn report(
        &mut self,
        send: impl FnOnce(
            &mut SupervisedTrainingEventProcessor<M>,
        ) -> Result<(), burn_train::EventProcessorError>,
    ) {
        if self.strategy.reports() {
            self.interrupter.fail_on_error(send(self.events));
        }
    }

    /// One training epoch over `loader`: each step on this rank's share, gradients reduced over
    /// the layout, the whole batch's output reported by the reporting rank. Returns whether to
    /// stop.
    fn train(&mut self, learner: &mut Learner<M>, loader: &TrainLoader<M>) -> Result<bool, String> {
        let (s, accumulation) = (self.strategy, self.accumulation);
        let mut pending = 0;
        let mut accumulator = GradientsAccumulator::new();
        let step = |batch, progress: &Progress, share| {
            let (output, grads) = s
                .steps
                .train(&s.par, &s.ctx, &learner.model(), batch, share)
                .map_err(|e| e.to_string())?;
            // Before the optimizer sees gradients of the wrong samples.
            if let Some(output) = &output {
                check_share(output.samples(), share, &s.par)?;
            }
            accumulator.accumulate(&learner.model(), grads);
            pending += 1;
            // burn-train's rule: step every `accumulation` batches and at the epoch's end.
            if accumulation.is_none_or(|n| pending >= n) || progress.is_completed() {
                pending = 0;
                let (grads, _norm) = s
                    .par
                    .reduce_gradients(&learner.model(), accumulator.grads(), s.max_norm, &s.ctx)
                    .map_err(|e| e.to_string())?;
                learner.lr_step();
                learner.optimizer_step(grads);
            }
            Ok((output, Some(learner.lr_current())))
        };
        self.batches(loader, step, |events, item| {
            events.process_train(LearnerEvent::ProcessedItem(item))
        })
    }

    /// One validation epoch: each rank evaluates its share, the reporting rank reports the
    /// whole batch's.
    fn valid(&mut self, learner: &Learner<M>, loader: &ValidLoader<M>) -> Result<bool, String> {
        let model = learner.model().valid();
        let s = self.strategy;
        let step = |batch, _: &Progress, share| {
            let output = s
                .steps
                .valid(&s.par, &model, batch, share)
                .map_err(|e| e.to_string())?;
            if let Some(output) = &output {
                check_share(output.samples(), share, &s.par)?;
            }
            Ok((output, None))
        };
        self.batches(loader, step, |events, item| {
            events.process_valid(LearnerEvent::ProcessedItem(item))
        })
    }

    /// `step` on every batch of `loader` (this rank's share of it, and the share's sample
    /// count), its output (on the ranks that compute one) gathered for the whole batch
    /// and `report`ed by the reporting rank; stops early on that rank's word. Returns whether
    /// to stop.
    fn batches<I, O: GatherOutput>(
        &mut self,
        loader: &Arc<dyn DataLoader<I>>,
        mut step: impl FnMut(
            I,
            &Progress,
            usize,
        ) -> Result<(Option<O>, Option<ModuleLearningRate>), String>,
        report: impl Fn(
            &mut SupervisedTrainingEventProcessor<M>,
            TrainingItem<O>,
        ) -> Result<(), burn_train::EventProcessorError>,
    ) -> Result<bool, String> {
        let s = self.strategy;
        let mut batches = loader.iter();
        let (mut iteration, mut seen) = (0, 0);
        let mut batched = batch::batched_here();
        while let Some(batch) = batches.next() {
            let batch = batch.map_err(|e| e.to_string())?;
            // Before the step: a batch from a worker thread may be another global batch than
            // the other ranks' (workers deliver in the order they finish).
            let now = batch::batched_here();
            if now == std::mem::replace(&mut batched, now) {
                return Err(
                    "this rank's batch was not made by a ShareBatcher on the rank's own \
                     thread: build the data loaders with \
                     flashover::learner::ShareBatcher::new(your_batcher, &par), without \
                     num_workers (worker threads \
                     deliver batches in an order that differs between ranks, so each rank \
                     would take its share of a different batch)"
                        .into(),
                );
            }
            iteration += 1;
            let progress = batches.progress();
            // The loader's progress counts the global batch's samples.
            let samples =
                progress.items_processed - std::mem::replace(&mut seen, progress.items_processed);
            let (output, lr) = step(batch, &progress, s.share_of(samples)?)?;
            // The ranks of one data group all compute outputs (they run the same stages) or
            // none does.
            let item = output.map(|o| o.gather(s.par.data().ranks()));
            match item.transpose().map_err(|e| e.to_string())? {
                Some(item) => {
                    let item = TrainingItem::new(item, progress, Some(iteration), lr);
                    self.report(|events| report(events, item));
                }
                None if s.reports() => {
                    return Err("the reporting rank computed no output".into());
                }
                None => {}
            }
            if s.agreed(self.interrupter.should_stop())
                .map_err(|e| e.to_string())?
            {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

impl<M, S> SupervisedLearningStrategy<M> for ParallelLearning<S>
where
    M: LearnerModel,
    S: RankSteps<M>,
    <M as TrainStep>::Output: GatherOutput,
    <M as InferenceStep>::Output: GatherOutput,
{
    /// burn-train's own `train`, with the start and end events sent by the reporting rank
    /// only (the others' renderers stay silent).
    fn train(
        &self,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        mut components: TrainingComponents<M>,
    ) -> LearningResult<M> {
        let starting_epoch = components.checkpoint.unwrap_or(0) + 1;
        let summary = components.summary.clone();
        let interrupter = components.interrupter.clone();
        if self.reports() {
            let start = LearnerEvent::Start {
                total_epochs: components.num_epochs,
                starting_epoch,
                label: components.label.clone(),
            };
            interrupter.fail_on_error(components.event_processor.process_train(start));
        }
        let (model, mut events) = self.fit(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
        );
        if self.reports() {
            let summary = summary.and_then(|s| s.init().ok());
            interrupter.fail_on_error(events.process_train(LearnerEvent::End(summary)));
        }
        let model = model.valid();
        interrupter.fail_on_error(events.flush());
        LearningResult {
            model,
            renderer: events.renderer(),
            interrupted: interrupter.interruption(),
            error: interrupter.error(),
        }
    }

    /// The epochs, on this rank; returns the whole trained model (gathered on every rank).
    fn fit(
        &self,
        components: TrainingComponents<M>,
        mut learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let mut events = components.event_processor;
        let interrupter = components.interrupter;
        if self.par.sequences().is_split() && !self.steps.splits_sequences() {
            interrupter.fail(self.failure(
                "the plan splits sequences over cp, but the strategy gives each step whole \
                 sequences: implement flashover::learner::SequenceBatch for the batch type and \
                 call .split_sequences() on the ParallelLearning",
            ));
            return (learner.model(), events);
        }
        if components.checkpointer.is_some() {
            interrupter.fail(self.failure(
                "burn-train's checkpointer saves the Learner's model record, which holds only \
                 this rank's part of each parameter the plan splits: build the SupervisedTraining \
                 without checkpointers under a parallelize plan",
            ));
            return (learner.model(), events);
        }
        let device = learner.model().devices().into_iter().next();
        let (train, valid) = match &device {
            Some(device) => (
                dataloader_train.to_device(device),
                dataloader_valid.to_device(&device.clone().inner()),
            ),
            None => (dataloader_train, dataloader_valid),
        };
        if let Some(epoch) = components.checkpoint {
            if let Err(e) = self
                .checkpoints_mut()
                .resume(&self.par, &self.ctx, epoch, &mut learner)
            {
                interrupter.fail(self.failure(e));
                return (learner.model(), events);
            }
            // The epochs before it drew their shuffles from the loaders: draw them again, so the
            // resumed epochs see the batches an uninterrupted run would.
            for _ in 0..epoch {
                drop(train.iter());
                drop(valid.iter());
            }
        }
        let (train_items, valid_items) = (train.num_items(), valid.num_items());
        let mut early_stopping = components.early_stopping;
        let mut epochs = Epochs {
            strategy: self,
            events: &mut events,
            interrupter: &interrupter,
            accumulation: components.grad_accumulation,
        };
        for epoch in starting_epoch..=components.num_epochs {
            let stop = epochs.epoch(
                epoch,
                &mut learner,
                (&train, train_items),
                (&valid, valid_items),
            );
            // A completed epoch is saved (before early stopping decides, as burn-train does).
            let stop = stop.and_then(|stop| match stop {
                true => Ok(true),
                false => self
                    .checkpoints_mut()
                    .save(
                        &self.par,
                        &self.ctx,
                        epoch,
                        &learner,
                        &components.event_store,
                    )
                    .map(|()| false)
                    .map_err(|e| e.to_string()),
            });
            // The reporting rank's event store holds the metrics: it decides for every rank.
            let stop = stop.and_then(|stop| {
                let early = self.reports()
                    && early_stopping
                        .as_mut()
                        .is_some_and(|s| s.should_stop(epoch, &components.event_store));
                self.agreed(stop || early).map_err(|e| e.to_string())
            });
            match stop {
                Ok(false) => {}
                Ok(true) => break,
                Err(e) => {
                    interrupter.fail(self.failure(e));
                    break;
                }
            }
        }
        // After a failure the ranks are out of step: a collective would wait for peers that
        // will not come. Returning ends this rank's work, which tells its peers to stop
        // waiting for it.
        if interrupter.error().is_some() {
            return (learner.model(), events);
        }
        let model = match self.par.sharded().whole(learner.model()) {
            Ok(model) => model,
            Err(e) => {
                interrupter.fail(self.failure(e));
                learner.model()
            }
        };
        (model, events)
    }
}
