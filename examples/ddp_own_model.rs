//! Data parallel training of *your own* Burn model, in a handful of added lines.
//!
//! A small MLP regression model is trained twice on the same data and seed: once on one rank
//! with a plain Burn loop, once on four rank threads with Flashover's DDP. The loss curves and
//! the final weights match (fp32, 1e-5 relative).
//!
//! Run: `cargo run --example ddp_own_model`

use burn::module::Module;
use burn::nn::Linear;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};
use flashover::{Axis, CommunicatorExt, ReduceOp, launch};
use flashover_models::init;
use flashover_parallel::data_parallel::DataParallelConfig;

const STEPS: usize = 30;
const GLOBAL_BATCH: usize = 64;
const WORLD: usize = 4;

/// Your model: nothing in it knows about Flashover.
#[derive(Module, Debug)]
struct Mlp {
    l1: Linear,
    l2: Linear,
}

impl Mlp {
    /// Weights drawn on the host from a seed, so every rank and the reference start equal
    /// (Burn's own initialisers use a process-wide RNG that threads share).
    fn new(seed: u64, device: &Device) -> Self {
        Mlp {
            l1: init::linear(seed, "l1", 8, 32, 0.3, device),
            l2: init::linear(seed, "l2", 32, 1, 0.3, device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.l2.forward(relu(self.l1.forward(x)))
    }
}

/// Samples `range` of the data set: y = sum of x * w_true + noise-free curvature.
fn batch(range: std::ops::Range<usize>, device: &Device) -> (Tensor<2>, Tensor<2>) {
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

fn mse(pred: Tensor<2>, target: Tensor<2>) -> Tensor<1> {
    (pred - target).square().mean()
}

/// The plain Burn loop on one device.
fn train_single() -> (Vec<f32>, Vec<f32>) {
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
    (
        losses,
        model
            .l1
            .weight
            .val()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap(),
    )
}

/// The same loop with DDP: the lines marked `+` are all that changed.
fn train_ddp() -> (Vec<f32>, Vec<f32>) {
    let per_rank = GLOBAL_BATCH / WORLD;
    let results = launch(WORLD, |ctx| {
        let device = Device::flex().autodiff();
        let model = Mlp::new(7, &device);
        let dp = ctx.group(Axis::Dp); // +
        let (mut model, mut ddp) = DataParallelConfig::new().init(model, dp)?; // +
        let mut optim = AdamWConfig::new().init();
        let mut losses = vec![];
        for step in 0..STEPS {
            let start = step * GLOBAL_BATCH + dp.rank() * per_rank; // + this rank's slice
            let (x, y) = batch(start..start + per_rank, &device);
            ddp.begin_step(1); // +
            let loss = mse(ddp.prepare(&model).forward(x), y); // + prepare()
            let mut l = [loss.clone().into_scalar::<f32>()];
            dp.all_reduce(&mut l, ReduceOp::Avg)?; // + (for printing the global loss only)
            losses.push(l[0]);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            ddp.backward_done(&model, grads)?; // +
            let grads = ddp.finish(&model, None)?.grads; // +
            model = optim.step(1e-2, model, grads);
        }
        let w = model
            .l1
            .weight
            .val()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        Ok::<_, flashover_parallel::ParallelError>((losses, w))
    })
    .expect("DDP training");
    results.into_iter().next().unwrap()
}

fn main() {
    let (single, w_single) = train_single();
    let (ddp, w_ddp) = train_ddp();
    println!("step  loss(1 rank)  loss(DDP x{WORLD})");
    for (i, (a, b)) in single
        .iter()
        .zip(&ddp)
        .enumerate()
        .filter(|(i, _)| i % 5 == 0 || *i == STEPS - 1)
    {
        println!("{i:>4}  {a:>12.6}  {b:>14.6}");
    }
    let rel = |a: f32, b: f32| (a - b).abs() / b.abs().max(1e-12);
    let loss_diff = single
        .iter()
        .zip(&ddp)
        .map(|(a, b)| rel(*b, *a))
        .fold(0.0, f32::max);
    let scale = w_single.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let w_diff = w_single
        .iter()
        .zip(&w_ddp)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
        / scale;
    println!(
        "max relative loss difference {loss_diff:.2e}; max relative weight difference {w_diff:.2e}"
    );
    assert!(loss_diff < 1e-5 && w_diff < 1e-5, "DDP must match one rank");
    assert!(single[STEPS - 1] < 0.5 * single[0], "the model must learn");
    println!("match: DDP over {WORLD} ranks trains the same model as one rank");
}
