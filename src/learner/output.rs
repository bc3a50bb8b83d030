//! A step's output (loss, predictions, targets) for the whole batch, from every data-parallel
//! rank's output for its share, so that burn-train's metrics see what one device would.

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_train::{
    ClassificationOutput, MultiLabelClassificationOutput, RegressionOutput, SequenceOutput,
};
use flashover_comm::{CommunicatorExt, Group, ReduceOp, control};
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::Parallelized;
use flashover_runtime::TensorCollectives;
use flashover_runtime::transfers::{Cause, read};

/// A `TrainStep` or `InferenceStep` output that can be put together from the data-parallel
/// ranks' outputs for their equal shares of a batch. Implemented for burn-train's
/// [`ClassificationOutput`], [`MultiLabelClassificationOutput`], [`RegressionOutput`] and
/// [`SequenceOutput`]; for an output of your own, gather each per-sample tensor with
/// [`gather_samples`] / [`gather_sample_ints`] and each mean with [`mean_over`].
pub trait GatherOutput: Sized {
    /// How many samples the output is of.
    fn samples(&self) -> usize;
    /// The output of the whole batch (collective over `data`: every rank calls it with the
    /// output of its share, shares in rank order).
    fn gather(self, data: &Group) -> Result<Self, ParallelError>;

    /// The output of whole sequences from this rank's positions of them, when `par`'s plan
    /// splits sequences over `cp` (collective over [`SequenceSplit::ranks`](flashover_parallel::parallelize::SequenceSplit::ranks); the output
    /// itself otherwise): per-position tensors gathered in position order
    /// ([`gather_positions`], [`gather_position_ints`]), means averaged ([`mean_over`]).
    /// Implemented for burn-train's [`SequenceOutput`]. By default refused: an output of
    /// per-sample tensors (a class per sequence) has no positions to put together, and whether
    /// each `cp` rank's is partial or whole depends on the model.
    fn gather_sequences(self, par: &Parallelized) -> Result<Self, ParallelError> {
        match par.sequences().ranks() {
            None => Ok(self),
            Some(_) => Err(ParallelError::Invalid(format!(
                "the plan splits sequences over cp, and {} has no per-position tensors to put \
                 back together: implement GatherOutput::gather_sequences for it",
                std::any::type_name::<Self>()
            ))),
        }
    }
}

/// Every `cp` rank's `tensor`, this rank's positions of each sequence along `dim`, put
/// together in position order: the whole sequences (collective over `par`'s sequence ranks;
/// the tensor itself, detached, when the plan does not split sequences).
pub fn gather_positions<const D: usize>(
    tensor: Tensor<D>,
    dim: usize,
    par: &Parallelized,
) -> Result<Tensor<D>, ParallelError> {
    let tensor = tensor.detach();
    let Some(cp) = par.sequences().ranks() else {
        return Ok(tensor);
    };
    let order = position_order(par, cp, tensor.dims()[dim], &tensor.device())?;
    Ok(cp.all_gather_tensor(tensor, dim)?.select(dim, order))
}

/// [`gather_positions`] for integer tensors (token ids), moved exactly as `i64`.
pub fn gather_position_ints<const D: usize>(
    tensor: Tensor<D, Int>,
    dim: usize,
    par: &Parallelized,
) -> Result<Tensor<D, Int>, ParallelError> {
    let Some(cp) = par.sequences().ranks() else {
        return Ok(tensor);
    };
    let order = position_order(par, cp, tensor.dims()[dim], &tensor.device())?;
    Ok(all_gather_ints(tensor, dim, cp)?.select(dim, order))
}

/// Every rank's integer `tensor` concatenated along `dim`, in rank order, moved exactly as
/// `i64` (collective).
fn all_gather_ints<const D: usize>(
    tensor: Tensor<D, Int>,
    dim: usize,
    group: &Group,
) -> Result<Tensor<D, Int>, ParallelError> {
    let (device, shape) = (tensor.device(), tensor.dims());
    let values = read(tensor, Cause::Metrics)
        .convert::<i64>()
        .try_into_vec::<i64>()
        .map_err(|e| ParallelError::Invalid(format!("integer tensor: {e:?}")))?;
    // Metric inputs (targets, predicted classes), read on the host by the metrics anyway.
    let all = control(|| group.all_gather_vec(&values))?;
    let pieces = all
        .chunks(values.len().max(1))
        .take(group.size())
        .map(|piece| Tensor::from_data(TensorData::new(piece.to_vec(), shape), &device))
        .collect();
    Ok(Tensor::cat(pieces, dim))
}

/// For each position of a sequence `cp` x `local` long, where it is among the `cp` ranks'
/// local positions laid end to end in rank order (collective).
fn position_order(
    par: &Parallelized,
    cp: &Group,
    local: usize,
    device: &Device,
) -> Result<Tensor<1, Int>, ParallelError> {
    let seq = local * cp.size();
    let mine: Vec<u64> = par
        .sequences()
        .positions(seq)?
        .into_iter()
        .map(|p| p as u64)
        .collect();
    let all = control(|| cp.all_gather_vec(&mine))?;
    let mut order = vec![0i64; seq];
    for (at, &position) in all.iter().enumerate() {
        order[position as usize] = at as i64;
    }
    Ok(Tensor::from_data(TensorData::new(order, [seq]), device))
}

/// Every rank's `tensor` (rows of its samples) concatenated along the first dimension, in
/// rank order; a value, outside any autodiff graph (collective).
pub fn gather_samples<const D: usize>(
    tensor: Tensor<D>,
    data: &Group,
) -> Result<Tensor<D>, ParallelError> {
    let tensor = tensor.detach();
    if data.size() == 1 {
        return Ok(tensor);
    }
    Ok(data.all_gather_tensor(tensor, 0)?)
}

/// [`gather_samples`] for integer tensors (class indices, token ids), moved exactly as `i64`.
pub fn gather_sample_ints<const D: usize>(
    tensor: Tensor<D, Int>,
    data: &Group,
) -> Result<Tensor<D, Int>, ParallelError> {
    if data.size() == 1 {
        return Ok(tensor);
    }
    all_gather_ints(tensor, 0, data)
}

/// The mean over the ranks of each rank's mean `loss` (one element): the whole batch's mean
/// when the shares are equal (collective).
pub fn mean_over(loss: Tensor<1>, data: &Group) -> Result<Tensor<1>, ParallelError> {
    let loss = loss.detach();
    if data.size() == 1 {
        return Ok(loss);
    }
    Ok(data.all_reduce_tensor(loss, ReduceOp::Avg)?)
}

/// [`GatherOutput`] and [`MicroBatchOutput`] for burn-train's outputs of a mean loss,
/// per-sample predictions and integer targets (class indices or label masks).
macro_rules! per_sample_output {
    ($output:ident) => {
        impl GatherOutput for $output {
            fn samples(&self) -> usize {
                self.targets.dims()[0]
            }

            fn gather(self, data: &Group) -> Result<Self, ParallelError> {
                Ok($output {
                    loss: mean_over(self.loss, data)?,
                    output: gather_samples(self.output, data)?,
                    targets: gather_sample_ints(self.targets, data)?,
                })
            }
        }

        impl MicroBatchOutput for $output {
            fn loss(&self) -> Tensor<1> {
                self.loss.clone()
            }

            fn concat(parts: Vec<Self>) -> Self {
                let (mut loss, mut output, mut targets) = (vec![], vec![], vec![]);
                for part in parts {
                    loss.push(part.loss);
                    output.push(part.output.detach());
                    targets.push(part.targets);
                }
                $output {
                    loss: mean_loss(loss),
                    output: concat_samples(output),
                    targets: concat_samples(targets),
                }
            }
        }
    };
}

per_sample_output!(ClassificationOutput);
per_sample_output!(MultiLabelClassificationOutput);

impl GatherOutput for RegressionOutput {
    fn samples(&self) -> usize {
        self.targets.dims()[0]
    }

    fn gather(self, data: &Group) -> Result<Self, ParallelError> {
        Ok(RegressionOutput {
            loss: mean_over(self.loss, data)?,
            output: gather_samples(self.output, data)?,
            targets: gather_samples(self.targets, data)?,
        })
    }
}

impl GatherOutput for SequenceOutput {
    fn samples(&self) -> usize {
        self.targets.dims()[0]
    }

    fn gather(self, data: &Group) -> Result<Self, ParallelError> {
        // Every rank has predictions or none does (the same step on every rank).
        let predictions = self.predictions.map(|p| gather_sample_ints(p, data));
        Ok(SequenceOutput {
            loss: mean_over(self.loss, data)?,
            logits: gather_samples(self.logits, data)?,
            predictions: predictions.transpose()?,
            targets: gather_sample_ints(self.targets, data)?,
        })
    }

    fn gather_sequences(self, par: &Parallelized) -> Result<Self, ParallelError> {
        let Some(cp) = par.sequences().ranks() else {
            return Ok(self);
        };
        let predictions = self.predictions.map(|p| gather_position_ints(p, 1, par));
        Ok(SequenceOutput {
            loss: mean_over(self.loss, cp)?,
            logits: gather_positions(self.logits, 1, par)?,
            predictions: predictions.transpose()?,
            targets: gather_position_ints(self.targets, 1, par)?,
        })
    }
}

/// A training output that a pipeline computes a micro-batch at a time on its last stage, and
/// puts together for the metrics: needed by [`super::PipelineLearnerModel`]. Implemented for
/// burn-train's outputs; for your own, concatenate per-sample tensors with
/// [`concat_samples`].
pub trait MicroBatchOutput: GatherOutput {
    /// The micro-batch's mean loss: what the pipeline backpropagates.
    fn loss(&self) -> Tensor<1>;

    /// The output of a batch from its equal, consecutive micro-batches' (in order): each
    /// per-sample tensor concatenated, the loss their mean; values outside any autodiff graph.
    fn concat(parts: Vec<Self>) -> Self;
}

/// The micro-batches' per-sample `tensors` (rows of their samples, in order) as one (detach
/// float tensors first, as [`MicroBatchOutput::concat`] promises values).
pub fn concat_samples<const D: usize, K>(tensors: Vec<Tensor<D, K>>) -> Tensor<D, K>
where
    K: burn::tensor::kind::Basic,
{
    Tensor::cat(tensors, 0)
}

/// The mean of equal micro-batches' mean losses, outside any autodiff graph.
fn mean_loss(losses: Vec<Tensor<1>>) -> Tensor<1> {
    Tensor::cat(losses.into_iter().map(Tensor::detach).collect(), 0)
        .mean()
        .reshape([1])
}

impl MicroBatchOutput for RegressionOutput {
    fn loss(&self) -> Tensor<1> {
        self.loss.clone()
    }

    fn concat(parts: Vec<Self>) -> Self {
        let (mut loss, mut output, mut targets) = (vec![], vec![], vec![]);
        for part in parts {
            loss.push(part.loss);
            output.push(part.output.detach());
            targets.push(part.targets.detach());
        }
        RegressionOutput {
            loss: mean_loss(loss),
            output: concat_samples(output),
            targets: concat_samples(targets),
        }
    }
}

impl MicroBatchOutput for SequenceOutput {
    fn loss(&self) -> Tensor<1> {
        self.loss.clone()
    }

    fn concat(parts: Vec<Self>) -> Self {
        let (mut loss, mut logits, mut predictions, mut targets) = (vec![], vec![], vec![], vec![]);
        for part in parts {
            loss.push(part.loss);
            logits.push(part.logits.detach());
            predictions.extend(part.predictions);
            targets.push(part.targets);
        }
        // Every micro-batch has predictions or none has (the same step on each).
        let predictions = (!predictions.is_empty()).then(|| concat_samples(predictions));
        SequenceOutput {
            loss: mean_loss(loss),
            logits: concat_samples(logits),
            predictions,
            targets: concat_samples(targets),
        }
    }
}
