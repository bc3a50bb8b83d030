//! A small image classifier written in plain Burn (two convolutions, pooling, an MLP head),
//! parallelized by a plan: fully sharded at `fsdp=2`, its head split over `tp=2`, and both at
//! `fsdp=2,tp=2`. Each layout trains the same model on the same data as its own single-rank
//! Burn loop; losses and every final weight match within 1e-5 (fp32).
//!
//! Not a transformer: a plan shards any parameter over `fsdp` (convolution kernels included),
//! and splits linear layers over `tp`. The convolutions stay whole on every `tp` rank, which
//! computes them identically; only the head's two layers are declared as
//! `flashover::nn::Linear` (the one change `tp` needs in the model).
//!
//! Run: `cargo run --example parallelize_classifier`

use burn::module::Module;
use burn::nn::PaddingConfig2d;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{AvgPool2d, AvgPool2dConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::activation::{gelu, relu};
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover::nn::{Linear, LinearConfig}; // tp: Burn's Linear, whose forward follows a split
use flashover::parallel::clip_global_norm;
use flashover::parallel::params::{
    ParamLayout, accumulate_grads, flatten_params, grads_from_flat, load_flat, zero_grads,
};
use flashover::prelude::*;

const SIDE: usize = 8;
const CLASSES: usize = 10;
const GLOBAL_BATCH: usize = 16;
const STEPS: usize = 10;
const LR: f64 = 5e-3;
const MAX_NORM: f32 = 1.0;

// ---- The user's model: plain Burn, its head's layers flashover::nn::Linear. ----

#[derive(Module, Debug)]
struct Classifier {
    conv1: Conv2d,
    conv2: Conv2d,
    pool: AvgPool2d,
    hidden: Linear,
    head: Linear,
}

impl Classifier {
    /// Burn's random initialisation: every layout starts from the reference's weights below.
    fn new(device: &Device) -> Self {
        let conv = |c_in, c_out| {
            Conv2dConfig::new([c_in, c_out], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device)
        };
        Classifier {
            conv1: conv(1, 4),
            conv2: conv(4, 8),
            pool: AvgPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            hidden: LinearConfig::new(8 * (SIDE / 2) * (SIDE / 2), 32).init(device),
            head: LinearConfig::new(32, CLASSES).init(device),
        }
    }

    /// Class logits of `[batch, 1, SIDE, SIDE]` images.
    fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = relu(self.conv1.forward(images));
        let x = self.pool.forward(relu(self.conv2.forward(x)));
        let x: Tensor<2> = x.flatten(1, 3);
        self.head.forward(gelu(self.hidden.forward(x)))
    }

    fn loss(&self, images: Tensor<4>, labels: Tensor<1, Int>) -> Tensor<1> {
        CrossEntropyLossConfig::new()
            .init(&images.device())
            .forward(self.forward(images), labels)
    }
}

/// Samples `range` of an endless deterministic image set: images and labels.
fn batch(range: std::ops::Range<usize>, device: &Device) -> (Tensor<4>, Tensor<1, Int>) {
    let n = range.len();
    let pixels: Vec<f32> = range
        .clone()
        .flat_map(|s| {
            (0..SIDE * SIDE).map(move |p| ((s * 13 + p * (s % 5 + 1)) as f32 * 0.21).sin())
        })
        .collect();
    let labels: Vec<i64> = range.map(|s| ((s * 7 + 3) % CLASSES) as i64).collect();
    (
        Tensor::from_data(TensorData::new(pixels, [n, 1, SIDE, SIDE]), device),
        Tensor::from_data(TensorData::new(labels, [n]), device),
    )
}

// ---- Training: the plain single-rank loop, and the same loop under a plan. ----

/// Losses and final weights.
type Run = (Vec<f32>, Vec<f32>);

/// The plain Burn loop on one device (global-norm clipping written out), from `initial`.
fn single_rank(initial: &[f32]) -> Run {
    let device = Device::flex().autodiff();
    let mut model = load_flat(Classifier::new(&device), initial);
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
        let (x, y) = batch(step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH, &device);
        let loss = model.loss(x, y);
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let zeros = zero_grads(&model, &device.clone().inner());
        let (flat, _) = accumulate_grads(&model, &grads, zeros, &[]);
        let (flat, _norm) = clip_global_norm(flat, Some(MAX_NORM)).expect("one device");
        let grads = grads_from_flat(&model, &flat);
        model = optim.step(LR, model, grads);
    }
    (losses, flatten_params(&model))
}

/// The same loop under `plan` on `mesh`, from `initial`: rank 0's run and every rank's
/// stored parameter elements.
fn parallel(mesh: &str, plan: &ParallelizePlan, initial: &[f32]) -> (Run, Vec<usize>) {
    let out = launch(mesh, |ctx| {
        let device = ctx.device().clone().autodiff();
        let model = load_flat(Classifier::new(&device), initial);
        // The lines a plan adds to the loop are marked `+`.
        let (mut model, par) = parallelize(model, plan, &ctx)?; // +
        let stored = ParamLayout::of(&model).numel;
        let mut optim = AdamWConfig::new().init();
        let mut losses = vec![];
        for step in 0..STEPS {
            let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, step)?, &device); // +
            let loss = model.loss(x, y);
            losses.push(par.data().mean_loss(loss.clone().into_scalar::<f32>())?); // +
            let (grads, _) = par.gradients(&model, loss.backward(), Some(MAX_NORM), &ctx)?; // +
            model = optim.step(LR, model, grads);
        }
        let weights = flatten_params(&par.sharded().whole(model)?); // +
        Ok::<_, ParallelError>(((losses, weights), stored))
    })
    .expect("parallel training");
    let stored = out.iter().map(|(_, s)| *s).collect();
    (out.into_iter().next().unwrap().0, stored)
}

fn main() {
    let initial = flatten_params(&Classifier::new(&Device::flex()));
    let reference = single_rank(&initial);
    let whole = initial.len();
    println!(
        "image classifier, {whole} parameters; one rank's loss {:.4} -> {:.4}",
        reference.0[0],
        reference.0[STEPS - 1]
    );
    // Megatron's MLP split for the head: hidden features by columns, then back by rows.
    let tp_plan = ParallelizePlan::new()
        .tensor_parallel(TensorParallelRule::colwise(&["hidden"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["head"]));
    let layouts = [
        ("fsdp=2", ParallelizePlan::new().fully_shard("")),
        ("tp=2", tp_plan.clone()),
        ("fsdp=2,tp=2", tp_plan.fully_shard("")),
    ];
    for (mesh, plan) in &layouts {
        let (run, stored) = parallel(mesh, plan, &initial);
        let losses = flashover::check::relative_difference(&reference.0, &run.0);
        let weights = flashover::check::relative_difference(&reference.1, &run.1);
        println!(
            "{mesh:<12} stores {stored:?} of {whole} parameters per rank; max relative difference: losses {losses:.2e}, weights {weights:.2e}"
        );
        assert!(
            losses < 1e-5 && weights < 1e-5,
            "{mesh} must match one rank"
        );
        assert!(
            stored.iter().all(|s| *s < whole),
            "{mesh}: every rank stores a share"
        );
    }
    println!("match: every plan trains the same model as one rank");
}
