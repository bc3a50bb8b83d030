//! Mixed precision for *your own* Burn model: bf16 compute on f32 weights, under DDP.
//!
//! The MLP of the other "own model" examples is trained three times on the same data and seed:
//! a plain Burn loop in f32 on one rank (the reference), the same loop with bf16 compute, and
//! four DDP ranks with bf16 compute. The policy's view casts the weights inside the autodiff
//! graph, so gradients reach the f32 weights in f32 and Burn's AdamW steps them unchanged. bf16
//! rounding differs with the batch split, so the runs agree to bf16's precision, not f32's 1e-5
//! (measured: bf16 against f32 1e-2 in the loss and 4e-2 in the weights after 30 steps; DDP
//! against one rank, both bf16, 3e-3 and 4e-3); all three learn.
//!
//! Run: `cargo run --example mixed_precision`

mod common;

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, FloatDType, Tensor};
use common::{GLOBAL_BATCH, Mlp, STEPS, batch, differences, mse, train_single};
use flashover::launch;
use flashover_parallel::parallelize::{ParallelizePlan, parallelize};
use flashover_parallel::precision::{MixedPrecision, Precision};

const WORLD: usize = 4;

/// The model's forward in the policy's dtype: inputs cast in, the loss taken in f32.
fn loss_in(policy: &MixedPrecision, model: &Mlp, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
    let compute = policy.compute_view(model.clone()); // + bf16 view of the f32 weights
    let pred = compute.forward(x.cast(policy.param_dtype.float_dtype())); // + bf16 input
    mse(pred.cast(FloatDType::F32), y) // + loss in f32
}

/// One rank, plain Burn, bf16 compute.
fn train_single_bf16(policy: &MixedPrecision) -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    policy.check(&device).expect("Flex computes in bf16");
    let mut model = Mlp::new(7, &device);
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
        let start = step * GLOBAL_BATCH;
        let (x, y) = batch(start..start + GLOBAL_BATCH, &device);
        let loss = loss_in(policy, &model, x, y);
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    (losses, weights(&model))
}

/// Four DDP ranks, bf16 compute: the DDP lines of `ddp_own_model.rs` plus the view.
fn train_ddp_bf16(policy: &MixedPrecision) -> (Vec<f32>, Vec<f32>) {
    let results = launch(WORLD, |ctx| {
        let device = Device::flex().autodiff();
        // + the plan's policy: `Parallelized::forward` computes on its bf16 view
        let plan = ParallelizePlan::new().mixed_precision(*policy);
        let (mut model, par) = parallelize(Mlp::new(7, &device), &plan, &ctx)?;
        let mut optim = AdamWConfig::new().init();
        let mut losses = vec![];
        for step in 0..STEPS {
            let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, step)?, &device);
            let x = x.cast(policy.param_dtype.float_dtype()); // + bf16 input
            let loss = par.forward(&model, |m| mse(m.forward(x).cast(FloatDType::F32), y))?;
            losses.push(par.data().mean_loss(loss.clone().into_scalar::<f32>())?);
            let (grads, _norm) = par.gradients(&model, par.backward(loss), None, &ctx)?;
            model = optim.step(1e-2, model, grads);
        }
        Ok::<_, flashover_parallel::ParallelError>((losses, weights(&model)))
    })
    .expect("DDP training in bf16");
    results.into_iter().next().unwrap()
}

fn weights(model: &Mlp) -> Vec<f32> {
    let dtype = model.l1.weight.val().dtype();
    assert_eq!(dtype, burn::tensor::DType::F32, "the weights stay f32");
    model.l1_weights()
}

fn main() {
    let policy = MixedPrecision::new(Precision::BF16);
    let f32_run = train_single();
    let bf16_run = train_single_bf16(&policy);
    let ddp_run = train_ddp_bf16(&policy);
    println!("step  loss(f32)  loss(bf16)  loss(bf16, DDP x{WORLD})");
    for i in (0..STEPS).filter(|i| i % 5 == 0 || *i == STEPS - 1) {
        println!(
            "{i:>4}  {:>9.6}  {:>10.6}  {:>12.6}",
            f32_run.0[i], bf16_run.0[i], ddp_run.0[i]
        );
    }
    let (loss_vs_f32, w_vs_f32) = differences(&f32_run, &bf16_run);
    let (loss_vs_one, w_vs_one) = differences(&bf16_run, &ddp_run);
    println!("bf16 vs f32: losses {loss_vs_f32:.2e}, weights {w_vs_f32:.2e} (relative)");
    println!("bf16 DDP vs bf16 one rank: losses {loss_vs_one:.2e}, weights {w_vs_one:.2e}");
    assert!(loss_vs_f32 > 1e-6, "bf16 must actually compute in bf16");
    assert!(loss_vs_f32 < 3e-2 && w_vs_f32 < 1e-1, "bf16 tracks f32");
    assert!(
        loss_vs_one < 1e-2 && w_vs_one < 1e-2,
        "DDP in bf16 tracks one rank in bf16"
    );
    for (what, run) in [("bf16", &bf16_run), ("bf16 DDP", &ddp_run)] {
        assert!(run.0[STEPS - 1] < 0.5 * run.0[0], "{what} must learn");
    }
    println!("match: bf16 compute on f32 weights trains like f32, on one rank and under DDP");
}
