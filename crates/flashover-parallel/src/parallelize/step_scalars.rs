//! A step's reported scalars (loss, auxiliary loss, gradient norm) kept on the device until
//! the step reads them once: a pipelined step's ([`super::PipelineStep::scalars`]) and a loop
//! of one's own's ([`Parallelized::step_scalars`]). On a GPU every read to the host waits for
//! the device's queue, so a step that reads its loss before its optimizer step is queued
//! leaves the GPU idle while the host launches it.

use super::Parallelized;
use crate::error::ParallelError;
use crate::grad_clip::GradNorm;
use burn::tensor::{DType, Tensor};
use flashover_runtime::transfers::{Cause, read};

/// A step's scalars on the device, as one three-element f32 tensor: the loss, the
/// auxiliary loss and the gradient norm ([`StepValues`] says what each is). A step computes
/// them without waiting for the device; a report reads them in one go ([`Self::read`]),
/// after the optimizer step is queued, since on a GPU every read waits for the device queue.
#[derive(Debug, Clone)]
pub struct StepScalars(Tensor<1>);

/// [`StepScalars`] read to the host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepValues {
    /// The mean loss (of `head_loss`: layers' auxiliary losses are left out): the whole
    /// batch's from [`super::PipelineRunner::step`], the same on every rank; this rank's share's
    /// from [`super::PipelineRunner::gradients`].
    pub loss: f32,
    /// The mean of the layers' auxiliary losses ([`super::PipelineModel::layer_with_aux`]; 0 without
    /// any): `loss + aux_loss` is the objective trained.
    pub aux_loss: f32,
    /// The global gradient norm before clipping (NaN from [`super::PipelineRunner::gradients`],
    /// which does not reduce the gradients).
    pub norm: f32,
}

impl StepScalars {
    /// `losses` (the loss and the auxiliary loss, two f32 elements) and `norm`, on one device.
    pub(super) fn new(losses: Tensor<1>, norm: GradNorm) -> Self {
        StepScalars(Tensor::cat(vec![losses, norm.into_tensor()], 0))
    }

    /// The gradient norm, on the device (for clipping that the caller does itself).
    pub fn norm(&self) -> GradNorm {
        GradNorm::from_tensor(self.0.clone().narrow(0, 2, 1))
    }

    /// The three values on the host: one read (counted as a metric read).
    pub fn read(&self) -> StepValues {
        Self::read_all(std::slice::from_ref(self))[0]
    }

    /// Several steps' scalars (on one device) in one read of the host: a job that reports
    /// every few steps reads them together.
    pub fn read_all(steps: &[StepScalars]) -> Vec<StepValues> {
        Self::read_all_with(steps, &[]).0
    }

    /// [`Self::read_all`], with the values of `extra` (one-dimensional tensors on the same
    /// device: a job's own metrics) in the same read, tensor by tensor.
    pub fn read_all_with(
        steps: &[StepScalars],
        extra: &[Tensor<1>],
    ) -> (Vec<StepValues>, Vec<Vec<f32>>) {
        if steps.is_empty() && extra.is_empty() {
            return (vec![], vec![]);
        }
        let f32s = |t: &Tensor<1>| t.clone().cast(DType::F32);
        let parts: Vec<Tensor<1>> = (steps.iter().map(|s| &s.0))
            .chain(extra)
            .map(f32s)
            .collect();
        let values = read(Tensor::cat(parts, 0), Cause::Metrics).convert::<f32>();
        let values = (values.try_into_vec::<f32>()).expect("a step's scalars are f32 values");
        let (scalars, mut rest) = values.split_at(3 * steps.len());
        let steps = (scalars.chunks_exact(3))
            .map(|v| StepValues {
                loss: v[0],
                aux_loss: v[1],
                norm: v[2],
            })
            .collect();
        let extra = (extra.iter())
            .map(|t| {
                let (mine, after) = rest.split_at(t.dims()[0]);
                rest = after;
                mine.to_vec()
            })
            .collect();
        (steps, extra)
    }
}

impl Parallelized {
    /// A loop of one's own's [`StepScalars`]: this rank's mean `loss` (a one-element tensor;
    /// its graph is left alone) averaged over the data ranks on the device, as
    /// [`super::DataSplit::mean_loss`] averages a host value, with the step's gradient `norm`
    /// (the auxiliary loss is 0). Read them once with [`StepScalars::read`] after the
    /// optimizer step is queued: the step then reads the host once. Collective over the ranks
    /// `mean_loss` averages over.
    pub fn step_scalars(
        &self,
        loss: &Tensor<1>,
        norm: &GradNorm,
    ) -> Result<StepScalars, ParallelError> {
        let loss = loss.clone().inner().cast(DType::F32).reshape([1]);
        let device = loss.device();
        let losses = Tensor::cat(vec![loss, Tensor::zeros([1], &device)], 0);
        let losses = self.data_split.mean_over_ranks(losses)?;
        Ok(StepScalars::new(losses, norm.clone()))
    }
}
