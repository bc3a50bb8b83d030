//! Data parallel training of *your own* Burn model, in a handful of added lines.
//!
//! A small MLP regression model is trained twice on the same data and seed: once on one rank
//! with a plain Burn loop, once on four rank threads with data parallelism: `parallelize` with
//! an empty plan replicates the model over `dp`, the forward runs through
//! `Parallelized::forward` (on parameters whose gradient hooks fill the buckets), and
//! `Parallelized::gradients` averages the gradients in buckets, each all-reduced while backward
//! still runs, as DDP does. The loss curves and the final weights match (fp32, 1e-5 relative).
//!
//! Run: `cargo run --example ddp_own_model`

mod common;

use burn::optim::AdamWConfig;
use burn::tensor::Device;
use common::{GLOBAL_BATCH, Mlp, STEPS, batch, differences, mse, train_single};
use flashover::launch;
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::{ParallelizePlan, parallelize};

const WORLD: usize = 4;

/// The same loop with data parallelism: the lines marked `+` are all that changed.
fn train_ddp() -> (Vec<f32>, Vec<f32>) {
    let results = launch(WORLD, |ctx| {
        let device = Device::flex().autodiff();
        let plan = ParallelizePlan::new(); // + nothing split: replicas over dp
        let (mut model, par) = parallelize(Mlp::new(7, &device), &plan, &ctx)?; // +
        let mut optim = AdamWConfig::new().init();
        let mut losses = vec![];
        for step in 0..STEPS {
            let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, step)?, &device); // + this rank's slice
            let loss = par.forward(&model, |m| mse(m.forward(x), y))?; // + hooked parameters
            losses.push(par.data().mean_loss(loss.clone().into_scalar::<f32>())?); // + the global loss
            let (grads, _norm) = par.gradients(&model, loss.backward(), None, &ctx)?; // + averaged
            model = optim.step(1e-2, model, grads);
        }
        // From the second step, each bucket was all-reduced as soon as backward completed it.
        let reduction = par.reducer().last_reduction();
        assert!(reduction.reduced_during_backward, "{reduction:?}");
        Ok::<_, ParallelError>((losses, model.l1_weights()))
    })
    .expect("DDP training");
    results.into_iter().next().unwrap()
}

fn main() {
    let single = train_single();
    let ddp = train_ddp();
    println!("step  loss(1 rank)  loss(DDP x{WORLD})");
    for (i, (a, b)) in single
        .0
        .iter()
        .zip(&ddp.0)
        .enumerate()
        .filter(|(i, _)| i % 5 == 0 || *i == STEPS - 1)
    {
        println!("{i:>4}  {a:>12.6}  {b:>14.6}");
    }
    let (loss_diff, w_diff) = differences(&single, &ddp);
    println!(
        "max relative loss difference {loss_diff:.2e}; max relative weight difference {w_diff:.2e}"
    );
    assert!(loss_diff < 1e-5 && w_diff < 1e-5, "DDP must match one rank");
    assert!(
        single.0[STEPS - 1] < 0.5 * single.0[0],
        "the model must learn"
    );
    println!("match: DDP over {WORLD} ranks trains the same model as one rank");
}
