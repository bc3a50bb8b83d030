//! Burn's `BatchNorm`, fully shardable, with its statistics over the whole batch.

use crate::dropout::draws::batch_ranks;
use crate::placed::value_dims;
use crate::tensor_parallel::comm::{copy_to_tp, reduce_from_tp};
use burn::config::Config;
use burn::module::{Flag, Module, Param, RunningState};
use burn::tensor::{Device, Tensor};
use flashover_comm::Group;

/// Burn's [`burn::nn::BatchNormConfig`] for [`BatchNorm`]: the same fields and defaults.
#[derive(Config, Debug)]
pub struct BatchNormConfig {
    /// Channels (dimension 1 of the input).
    pub num_features: usize,
    /// Added to the variance before its root, for stability.
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// How much of each batch's statistics the running ones take.
    #[config(default = 0.1)]
    pub momentum: f64,
}

impl BatchNormConfig {
    /// A new layer, as Burn's `BatchNormConfig::init` makes it.
    pub fn init(&self, device: &Device) -> BatchNorm {
        burn::nn::BatchNormConfig::new(self.num_features)
            .with_epsilon(self.epsilon)
            .with_momentum(self.momentum)
            .init(device)
            .into()
    }
}

/// Burn's [`burn::nn::BatchNorm`] with the same fields (so the same record) and, on one
/// device, the same forward. It reads its width through [`value_dims`] (Burn's reads
/// `gamma.shape()`, which a ZeRO-3 shard answers with its own rows), so `fully_shard` shards
/// its scale and shift. In training under a plan's data-parallel ranks, its statistics are
/// the whole batch's, as one device computes them (SyncBatchNorm): each channel's sum and
/// squared deviations are summed over the ranks, forward and backward. Under a pipeline's
/// micro-batches that would be each micro-batch's, not the batch's: refused in training.
/// Its running statistics are buffers, which a plan keeps whole (identical on every rank,
/// moved by the whole batch's statistics).
#[derive(Module, Debug)]
pub struct BatchNorm {
    /// The scale, `[num_features]`.
    pub gamma: Param<Tensor<1>>,
    /// The shift, `[num_features]`.
    pub beta: Param<Tensor<1>>,
    /// Whether the layer behaves as in training (Burn's flag, cleared by `freeze`).
    pub training: Param<Flag>,
    /// The running mean, for inference.
    pub running_mean: RunningState<Tensor<1>>,
    /// The running (biased) variance, for inference.
    pub running_var: RunningState<Tensor<1>>,
    /// How much of each batch's statistics the running ones take.
    pub momentum: f64,
    /// Added to the variance before its root.
    pub epsilon: f64,
}

impl From<burn::nn::BatchNorm> for BatchNorm {
    fn from(norm: burn::nn::BatchNorm) -> Self {
        BatchNorm {
            gamma: norm.gamma,
            beta: norm.beta,
            training: norm.training,
            running_mean: norm.running_mean,
            running_var: norm.running_var,
            momentum: norm.momentum,
            epsilon: norm.epsilon,
        }
    }
}

impl BatchNorm {
    /// `input: [batch, channels, ..]` normalised per channel: by the batch's statistics in
    /// training on an autodiff device (updating the running ones), by the running ones
    /// otherwise. Panics when dimension 1 is not `num_features`.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let [channels] = value_dims(&self.gamma);
        assert_eq!(
            input.dims()[1],
            channels,
            "BatchNorm: the input's dimension 1 is not num_features"
        );
        if !input.device().is_autodiff() || !self.training.is_enabled() {
            let device = input.device();
            let running = |state: &RunningState<Tensor<1>>| state.value().to_device(&device);
            return burn::tensor::module::batch_norm(
                input,
                self.gamma.val(),
                self.beta.val(),
                running(&self.running_mean),
                running(&self.running_var),
                self.epsilon,
            );
        }
        let (output, mean, variance) = match batch_ranks() {
            Some((data, micro_batch)) if data.size() > 1 || micro_batch => {
                assert!(
                    !micro_batch,
                    "BatchNorm in training inside a pipeline's micro-batches would normalise \
                     each micro-batch by its own statistics, not the batch's one device uses: \
                     train it with one micro-batch, or freeze it"
                );
                self.synced(input, &data)
            }
            _ => {
                let out = burn::tensor::module::batch_norm_train(
                    input,
                    self.gamma.val(),
                    self.beta.val(),
                    self.epsilon,
                );
                (out.output, out.mean, out.variance)
            }
        };
        self.update_running(mean.detach(), variance.detach());
        output
    }

    /// Training's normalisation by the statistics of every rank of `data`'s samples (equal
    /// batches on every rank): the output, the mean and the biased variance.
    fn synced<const D: usize>(
        &self,
        input: Tensor<D>,
        data: &Group,
    ) -> (Tensor<D>, Tensor<1>, Tensor<1>) {
        let [channels] = value_dims(&self.gamma);
        let per_rank = input.shape().num_elements() / channels;
        let count = (per_rank * data.size()) as f64;
        // Summed over the ranks forward, and their gradients summed back (every rank's loss
        // reads every rank's statistics).
        let all = |t: Tensor<1>| reduce_from_tp(copy_to_tp(t, data), data);
        let per_channel = |t: Tensor<D>| -> Tensor<1> {
            t.swap_dims(0, 1)
                .reshape([channels, per_rank])
                .sum_dim(1)
                .reshape([channels])
        };
        let mut shape = [1; D];
        shape[1] = channels;
        let mean = all(per_channel(input.clone())).div_scalar(count);
        let centered = input - mean.clone().reshape(shape);
        let variance = all(per_channel(centered.clone().square())).div_scalar(count);
        let inv_std = variance.clone().add_scalar(self.epsilon).sqrt().recip();
        let output = centered * inv_std.reshape(shape) * self.gamma.val().reshape(shape)
            + self.beta.val().reshape(shape);
        (output, mean, variance)
    }

    /// The running statistics moved `momentum` toward the batch's.
    fn update_running(&self, mean: Tensor<1>, variance: Tensor<1>) {
        let device = mean.device();
        let blend = |running: &RunningState<Tensor<1>>, batch: Tensor<1>| {
            let running = running.value_sync().to_device(&device);
            running
                .mul_scalar(1.0 - self.momentum)
                .add(batch.mul_scalar(self.momentum))
                .detach()
        };
        self.running_mean.update(blend(&self.running_mean, mean));
        self.running_var.update(blend(&self.running_var, variance));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Distribution, Tolerance};

    #[test]
    fn the_drop_in_computes_and_tracks_what_burns_does() {
        let device = Device::flex().autodiff();
        let burns = burn::nn::BatchNormConfig::new(3).init(&device);
        let drop_in = BatchNormConfig::new(3).init(&device);
        let x = Tensor::<3>::random([4, 3, 5], Distribution::Normal(1.0, 2.0), &device);
        let exact = Tolerance::absolute(0.0);
        let (a, b) = (burns.forward(x.clone()), drop_in.forward(x.clone()));
        b.into_data().assert_approx_eq::<f32>(&a.into_data(), exact);
        let running = |n: &RunningState<Tensor<1>>| n.value().into_data();
        running(&drop_in.running_mean)
            .assert_approx_eq::<f32>(&running(&burns.running_mean), exact);
        running(&drop_in.running_var).assert_approx_eq::<f32>(&running(&burns.running_var), exact);
        // Off autodiff: the running statistics.
        let x = x.inner();
        let (a, b) = (
            burns.forward(x.clone()).into_data(),
            BatchNorm::from(burns.clone()).forward(x).into_data(),
        );
        b.assert_approx_eq::<f32>(&a, exact);
    }
}
