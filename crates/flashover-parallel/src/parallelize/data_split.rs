//! A plan's data split on one rank ([`DataSplit`], `Parallelized::data`): which samples of
//! each step it reads, the dropout draws of those samples, and the whole batch's mean loss.

use crate::dropout::draws::Draws;
use crate::error::ParallelError;
use burn::tensor::Tensor;
use flashover_comm::{CommunicatorExt, Group, ReduceOp, control};
use flashover_runtime::TensorCollectives;
use std::ops::Range;

/// The plan's data split on this rank: the ranks that read different samples and those whose
/// mean losses make the whole batch's, and the dropout draws of the rank's samples.
#[derive(Debug)]
pub struct DataSplit {
    /// The ranks that read different samples (`dp` x `fsdp` x `ep`), in which this rank is
    /// `data.rank()`.
    data: Group,
    /// The ranks whose mean losses make the whole batch's (`dp` x `fsdp` x `ep` x `cp`): each
    /// holds as many of the batch's tokens.
    averaged: Group,
    /// The plan's dropout draws, at no step yet.
    dropout: Draws,
    /// Whether the plan cuts the model into pipeline stages on this mesh (a rank's forward is
    /// then a stage's, and the pipeline reads the batch).
    pipelined: bool,
}

impl DataSplit {
    /// Samples cut over `data`, losses averaged over `averaged`, dropout drawn by `dropout`.
    pub(super) fn new(data: Group, averaged: Group, dropout: Draws, pipelined: bool) -> Self {
        DataSplit {
            data,
            averaged,
            dropout,
            pipelined,
        }
    }

    /// This rank's samples of step `step`, numbered over the whole run: step `s`'s batch is
    /// samples `s * global_batch .. (s + 1) * global_batch` of the data set, and each data
    /// rank (`dp` x `fsdp` x `ep`) takes a contiguous share of it (rank 1 of 2 at step 1 of a batch
    /// of 8: `12..16`). Fails when the batch does not split evenly, and when the plan cuts the
    /// model into pipeline stages (a rank's forward is then a stage's:
    /// [`super::PipelineRunner::step`] reads the batch and runs the schedule). Sets this rank's
    /// dropout draws to the share's samples of step `step` ([`crate::nn::Dropout`]): the
    /// forward that follows drops what one device drops of them.
    pub fn batch_share(
        &self,
        global_batch: usize,
        step: usize,
    ) -> Result<Range<usize>, ParallelError> {
        if self.pipelined {
            return Err(ParallelError::Invalid(
                "the plan cuts the model into pipeline stages: a rank's forward is a stage's, \
                 so train with Parallelized::pipeline()?.step, which reads each micro-batch and \
                 runs the schedule"
                    .into(),
            ));
        }
        let share = self.share(global_batch, step)?;
        crate::dropout::draws::set_draws(Some(self.draws(step, share.clone())));
        Ok(share)
    }

    /// The dropout draws of `samples` of step `step` under this plan.
    pub(super) fn draws(&self, step: usize, samples: Range<usize>) -> crate::dropout::draws::Draws {
        self.dropout.at(step, samples)
    }

    /// [`Self::batch_share`], pipelined or not.
    pub(super) fn share(
        &self,
        global_batch: usize,
        step: usize,
    ) -> Result<Range<usize>, ParallelError> {
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
    /// over `dp` x `fsdp` x `ep` x `cp`). Of a host value: a loop that keeps its loss on the
    /// device until the step's one read takes [`super::Parallelized::step_scalars`] instead.
    pub fn mean_loss(&self, loss: f32) -> Result<f32, ParallelError> {
        let mut value = [loss];
        if self.averaged.size() > 1 {
            control(|| self.averaged.all_reduce(&mut value, ReduceOp::Avg))?;
        }
        Ok(value[0])
    }

    /// [`Self::mean_loss`] of several values at once, on the device (no host read; a
    /// collective over the same ranks).
    pub(super) fn mean_over_ranks(&self, values: Tensor<1>) -> Result<Tensor<1>, ParallelError> {
        match self.averaged.size() > 1 {
            true => Ok(self.averaged.all_reduce_tensor(values, ReduceOp::Avg)?),
            false => Ok(values),
        }
    }

    /// The ranks that read different samples (`dp` x `fsdp` x `ep`): a global batch is cut
    /// into `ranks().size()` equal shares, this rank's is share `ranks().rank()`.
    pub fn ranks(&self) -> &Group {
        &self.data
    }

    /// The ranks whose mean losses make the whole batch's (`dp` x `fsdp` x `ep` x `cp`).
    pub(super) fn averaged(&self) -> &Group {
        &self.averaged
    }
}
