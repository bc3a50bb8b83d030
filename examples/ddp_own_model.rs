//! Data parallel training of *your own* Burn model, in a handful of added lines.
//!
//! A small MLP regression model is trained twice on the same data and seed: once on one rank
//! with a plain Burn loop, once on four rank threads with Flashover's DDP. The loss curves and
//! the final weights match (fp32, 1e-5 relative).
//!
//! Run: `cargo run --example ddp_own_model`

mod common;

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Device;
use common::{GLOBAL_BATCH, Mlp, STEPS, batch, differences, mse, train_single};
use flashover::{Axis, CommunicatorExt, ReduceOp, launch};
use flashover_parallel::data_parallel::DataParallelConfig;

const WORLD: usize = 4;

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
        let w = model.l1_weights();
        Ok::<_, flashover_parallel::ParallelError>((losses, w))
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
