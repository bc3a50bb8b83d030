//! How a rank computes a `Learner` step under a plan: the user's whole `TrainStep` on its share
//! of the batch ([`WholeForward`]), or its pipeline stages over micro-batches of it
//! ([`StagedForward`], for plans that cut the model into stages); either on this rank's
//! positions of every sequence ([`SplitSequences`], for plans that split sequences over `cp`).

use super::output::{GatherOutput, MicroBatchOutput};
use burn::optim::GradientsParams;
use burn_train::{InferenceStep, LearnerModel, TrainStep};
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::{Parallelized, PipelineModel};
use flashover_runtime::RankContext;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Mutex;

/// What a `TrainStep` returns as its output item.
pub type TrainItem<M> = <M as TrainStep>::Output;
/// What an `InferenceStep` returns.
pub type InferenceItem<M> = <M as InferenceStep>::Output;

/// How a rank computes steps of a `Learner` model `M` under a plan: [`WholeForward`] or
/// [`StagedForward`], either wrapped in [`SplitSequences`] (what [`super::ParallelLearning`]
/// runs).
pub trait RankSteps<M: LearnerModel>: Send + Sync + 'static {
    /// A training step on this rank's share of a batch (`share` samples): the output of the
    /// share where this rank computes one (`None` on pipeline stages before the last), and
    /// this rank's gradients, not yet reduced over the layout.
    fn train(
        &self,
        par: &Parallelized,
        ctx: &RankContext,
        model: &M,
        batch: <M as TrainStep>::Input,
        share: usize,
    ) -> Result<(Option<TrainItem<M>>, GradientsParams), ParallelError>;

    /// A validation step on this rank's share of a batch: its output where this rank
    /// computes one.
    fn valid(
        &self,
        par: &Parallelized,
        model: &M,
        batch: <M as InferenceStep>::Input,
        share: usize,
    ) -> Result<Option<InferenceItem<M>>, ParallelError>;

    /// Whether the steps compute on this rank's positions of each sequence (what a plan that
    /// splits sequences over `cp` needs).
    fn splits_sequences(&self) -> bool {
        false
    }
}

/// Every rank runs the user's whole `TrainStep` and `InferenceStep` on its share of the batch
/// (plans without pipeline stages), inside [`Parallelized::forward`]: fully sharded blocks
/// are gathered a unit at a time, the next prefetched.
#[derive(Clone, Copy, Debug, Default)]
pub struct WholeForward;

impl<M: LearnerModel> RankSteps<M> for WholeForward {
    fn train(
        &self,
        par: &Parallelized,
        _: &RankContext,
        model: &M,
        batch: <M as TrainStep>::Input,
        _share: usize,
    ) -> Result<(Option<TrainItem<M>>, GradientsParams), ParallelError> {
        // The step's backward runs inside too; recomputed layers gather apart from the scope.
        let output = par.forward(model, |m| TrainStep::step(m, batch))?;
        Ok((Some(output.item), output.grads))
    }

    fn valid(
        &self,
        par: &Parallelized,
        model: &M,
        batch: <M as InferenceStep>::Input,
        _share: usize,
    ) -> Result<Option<InferenceItem<M>>, ParallelError> {
        par.forward(model, |m| Some(InferenceStep::step(m, batch)))
    }
}

/// A `Learner` model a pipelined plan trains in stages: its forward in the parts of a
/// [`PipelineModel`] (what its `TrainStep` computes is `train_head(layers(embed(batch)),
/// batch)`), with the loader's batches cut into micro-batches and the last stage's outputs for
/// the metrics. The pipeline's `Batch` is the loader's batch type, for training and
/// validation.
///
/// ```text
/// impl PipelineLearnerModel for MyModel {
///     fn samples(batch: &MyBatch) -> usize { batch.labels.dims()[0] }
///     fn micro_batch(batch: &MyBatch, samples: Range<usize>) -> MyBatch {
///         MyBatch {
///             features: batch.features.clone().narrow(0, samples.start, samples.len()),
///             labels: batch.labels.clone().narrow(0, samples.start, samples.len()),
///         }
///     }
///     fn train_head(&self, x: Tensor<2>, batch: &MyBatch) -> ClassificationOutput {
///         self.classify(x, batch)           // what TrainStep::step computes after the layers
///     }
///     fn inference_head(&self, x: Tensor<2>, batch: &MyBatch) -> ClassificationOutput {
///         self.classify(x, batch)
///     }
/// }
/// ```
pub trait PipelineLearnerModel:
    LearnerModel
    + PipelineModel<Batch = <Self as TrainStep>::Input>
    + InferenceStep<Input = <Self as TrainStep>::Input>
    + Sync
{
    /// How many samples `batch` holds.
    fn samples(batch: &Self::Batch) -> usize;

    /// Samples `samples` of `batch` (each per-sample tensor narrowed along its first
    /// dimension): one micro-batch.
    fn micro_batch(batch: &Self::Batch, samples: Range<usize>) -> Self::Batch;

    /// What the model's `TrainStep` computes after the layers, from their output `x`: the
    /// micro-batch's output item, whose loss ([`MicroBatchOutput::loss`]) the pipeline
    /// backpropagates.
    fn train_head(&self, x: Self::Activation, batch: &Self::Batch) -> <Self as TrainStep>::Output;

    /// What the model's `InferenceStep` computes after the layers, from their output `x`.
    fn inference_head(
        &self,
        x: Self::Activation,
        batch: &Self::Batch,
    ) -> <Self as InferenceStep>::Output;
}

/// Each rank runs its pipeline stages ([`PipelineLearnerModel`]): training through the plan's schedule over micro-batches of the rank's
/// share, validation forward only over the whole share; the last stage's ranks hold the
/// outputs.
#[derive(Debug, Default)]
pub struct StagedForward(PhantomData<()>);

impl<M> RankSteps<M> for StagedForward
where
    M: PipelineLearnerModel,
    <M as TrainStep>::Input: Sync,
    TrainItem<M>: MicroBatchOutput + Send,
{
    fn train(
        &self,
        par: &Parallelized,
        ctx: &RankContext,
        model: &M,
        batch: <M as TrainStep>::Input,
        share: usize,
    ) -> Result<(Option<TrainItem<M>>, GradientsParams), ParallelError> {
        // Micro-batches are cut by sample ranges: a whole batch would train on its first
        // samples only, silently.
        check_share(M::samples(&batch), share, par).map_err(ParallelError::Invalid)?;
        // The last stage's outputs, by micro-batch.
        let outputs: Mutex<Vec<(usize, TrainItem<M>)>> = Mutex::default();
        let micro_batch = |samples: Range<usize>| M::micro_batch(&batch, samples);
        let head = |m: &M, x: M::Activation, micro: &M::Batch, k: usize| {
            let output = m.train_head(x, micro);
            let loss = output.loss();
            outputs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((k, output));
            loss
        };
        let step = par
            .pipeline()?
            .gradients(model, share, &micro_batch, &head, ctx)?;
        let mut outputs = outputs.into_inner().unwrap_or_else(|e| e.into_inner());
        outputs.sort_by_key(|(k, _)| *k);
        let output = (!outputs.is_empty())
            .then(|| MicroBatchOutput::concat(outputs.into_iter().map(|(_, o)| o).collect()));
        Ok((output, step.grads))
    }

    fn valid(
        &self,
        par: &Parallelized,
        model: &M,
        batch: <M as InferenceStep>::Input,
        share: usize,
    ) -> Result<Option<InferenceItem<M>>, ParallelError> {
        check_share(M::samples(&batch), share, par).map_err(ParallelError::Invalid)?;
        let x = par.pipeline()?.forward(model, &batch)?;
        Ok(x.map(|x| model.inference_head(x, &batch)))
    }
}

/// A batch whose sequences a plan's `context_parallel` rule splits over `cp`: what
/// [`SplitSequences`] needs. Keep this rank's positions of every per-position tensor,
/// `par.sequences().share(tensor, dim)` with `dim` its sequence dimension, positions included
/// (the model's position embeddings read them):
///
/// ```text
/// impl SequenceBatch for TextBatch {
///     fn sequence_share(self, par: &Parallelized) -> Result<Self, ParallelError> {
///         Ok(TextBatch {
///             tokens: par.sequences().share(self.tokens, 1)?,
///             positions: par.sequences().share(self.positions, 0)?,
///             targets: par.sequences().share(self.targets, 1)?,
///         })
///     }
/// }
/// ```
pub trait SequenceBatch: Sized {
    /// This rank's positions of every sequence in the batch.
    fn sequence_share(self, par: &Parallelized) -> Result<Self, ParallelError>;
}

/// `S`'s steps on this rank's positions of every sequence ([`SequenceBatch`]), their outputs
/// put back together over `cp` ([`GatherOutput::gather_sequences`]) for the metrics. Under a
/// plan that does not split sequences, `S`'s steps as they are.
#[derive(Debug, Default)]
pub struct SplitSequences<S>(pub(super) S);

impl<M, S> RankSteps<M> for SplitSequences<S>
where
    M: LearnerModel,
    S: RankSteps<M>,
    <M as TrainStep>::Input: SequenceBatch,
    <M as InferenceStep>::Input: SequenceBatch,
    TrainItem<M>: GatherOutput,
    InferenceItem<M>: GatherOutput,
{
    fn train(
        &self,
        par: &Parallelized,
        ctx: &RankContext,
        model: &M,
        batch: <M as TrainStep>::Input,
        share: usize,
    ) -> Result<(Option<TrainItem<M>>, GradientsParams), ParallelError> {
        let batch = batch.sequence_share(par)?;
        let (output, grads) = self.0.train(par, ctx, model, batch, share)?;
        let output = output.map(|o| o.gather_sequences(par)).transpose()?;
        Ok((output, grads))
    }

    fn valid(
        &self,
        par: &Parallelized,
        model: &M,
        batch: <M as InferenceStep>::Input,
        share: usize,
    ) -> Result<Option<InferenceItem<M>>, ParallelError> {
        let batch = batch.sequence_share(par)?;
        let output = self.0.valid(par, model, batch, share)?;
        output.map(|o| o.gather_sequences(par)).transpose()
    }

    fn splits_sequences(&self) -> bool {
        true
    }
}

/// Refuses a step of `samples` samples on this rank (its batch's, or its output's) where its
/// share of the batch is `share` samples.
pub(super) fn check_share(samples: usize, share: usize, par: &Parallelized) -> Result<(), String> {
    if samples != share {
        let ranks = par.data().ranks().size();
        return Err(format!(
            "a step of a {}-sample batch had {samples} samples on this rank, not its share of \
             {share} over {ranks} data-parallel ranks (dp x fsdp x ep): build the data loaders \
             with flashover::learner::ShareBatcher::new(your_batcher, &par)",
            share * ranks
        ));
    }
    Ok(())
}
