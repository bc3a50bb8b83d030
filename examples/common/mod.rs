//! The model, data and single-rank reference loop shared by the "own model" examples.

use burn::module::Module;
use burn::nn::Linear;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};
use flashover_models::init;

pub const STEPS: usize = 30;
pub const GLOBAL_BATCH: usize = 64;

/// Your model: nothing in it knows about Flashover.
#[derive(Module, Debug)]
pub struct Mlp {
    pub l1: Linear,
    pub l2: Linear,
}

impl Mlp {
    /// Weights drawn on the host from a seed, so every rank and the reference start equal
    /// (Burn's own initialisers use a process-wide RNG that threads share).
    pub fn new(seed: u64, device: &Device) -> Self {
        Mlp {
            l1: init::linear(seed, "l1", 8, 32, 0.3, device),
            l2: init::linear(seed, "l2", 32, 1, 0.3, device),
        }
    }

    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.l2.forward(relu(self.l1.forward(x)))
    }

    /// The first layer's weights: what the examples compare between layouts.
    pub fn l1_weights(&self) -> Vec<f32> {
        self.l1
            .weight
            .val()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
    }
}

/// Samples `range` of the data set: y = sum of x * w_true + noise-free curvature.
pub fn batch(range: std::ops::Range<usize>, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let n = range.len();
    let xs: Vec<f32> = range
        .clone()
        .flat_map(|i| (0..8).map(move |j| ((i * 7 + j * 3) % 11) as f32 / 11.0 - 0.5))
        .collect();
    let ys: Vec<f32> = xs
        .chunks(8)
        .map(|x| {
            x.iter()
                .enumerate()
                .map(|(j, v)| v * (j as f32 - 3.5))
                .sum::<f32>()
                + x[0] * x[1]
        })
        .collect();
    (
        Tensor::from_data(TensorData::new(xs, [n, 8]), device),
        Tensor::from_data(TensorData::new(ys, [n, 1]), device),
    )
}

pub fn mse(pred: Tensor<2>, target: Tensor<2>) -> Tensor<1> {
    (pred - target).square().mean()
}

/// The plain Burn loop on one device.
pub fn train_single() -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let mut model = Mlp::new(7, &device);
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
        let (x, y) = batch(step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH, &device);
        let loss = mse(model.forward(x), y);
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    (losses, model.l1_weights())
}

/// Largest relative differences of the loss curves (step by step) and of the weights (against
/// their largest value) with the reference.
pub fn differences(single: &(Vec<f32>, Vec<f32>), other: &(Vec<f32>, Vec<f32>)) -> (f32, f32) {
    // Each loss relative to itself; weights relative to their own scale (both NaN-safe).
    let loss = flashover::check::stepwise_relative_difference(&single.0, &other.0);
    let weights = flashover::check::relative_difference(&single.1, &other.1);
    (loss, weights)
}
