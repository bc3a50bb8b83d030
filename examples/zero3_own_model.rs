//! Sharded data parallel on *your own* Burn model, one plan line each: ZeRO-2 (each rank keeps
//! AdamW state and gradients for its rows only) and ZeRO-3 / HSDP (each rank stores its rows
//! of every parameter too).
//!
//! The MLP of `ddp_own_model` is trained on one rank with a plain Burn loop, then with ZeRO-2
//! over four ranks (`dp=4`: the plan's `gradient_buckets.rows` reduce-scatters the gradients
//! to each rank's rows, `RowAdamW` steps them and gathers the parameters back), then with
//! ZeRO-3 sharded over two ranks and replicated over two (`dp=2,fsdp=2`: `fully_shard("")`,
//! Burn's own AdamW on the shards). Loss curves and final weights match the single rank
//! (fp32, 1e-5 relative), and each rank's memory for parameters, gradients and optimizer
//! state is printed against DDP's (which holds all of it on every rank).
//!
//! Run: `cargo run --example zero3_own_model`

mod common;

use burn::optim::AdamWConfig;
use burn::tensor::Device;
use common::{GLOBAL_BATCH, Mlp, STEPS, batch, differences, mse, train_single};
use flashover::Launch;
use flashover_parallel::data_parallel::{GradientBuckets, GradientRows};
use flashover_parallel::parallelize::{ParallelizePlan, parallelize};
use flashover_parallel::params::ParamLayout;
use flashover_parallel::zero::RowAdamW;
use flashover_parallel::{FlatAdamWConfig, ParallelError};

/// Losses, the first layer's final weights, and rank 0's bytes of parameters, gradients and
/// optimizer state between steps.
type Run = (Vec<f32>, Vec<f32>, usize);

/// ZeRO-2 (`stage = 2`, mesh `dp=4`) or ZeRO-3/HSDP (`stage = 3`, mesh `dp=2,fsdp=2`).
fn train_sharded(stage: usize) -> Run {
    let (mesh, plan) = match stage {
        3 => ("dp=2,fsdp=2", ParallelizePlan::new().fully_shard("")),
        _ => {
            let rows = GradientBuckets::default().rows(GradientRows::ReduceScatter);
            ("dp=4", ParallelizePlan::new().gradient_buckets(rows))
        }
    };
    let results = Launch::new(mesh)
        .expect("mesh")
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (mut model, par) = parallelize(Mlp::new(7, &device), &plan, &ctx)?;
            let mut losses = vec![];
            let bytes = if stage == 3 {
                let mut optim = AdamWConfig::new().init();
                for step in 0..STEPS {
                    let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, step)?, &device);
                    let loss = par.forward(&model, |m| mse(m.forward(x), y))?;
                    losses.push(par.data().mean_loss(loss.clone().into_scalar::<f32>())?);
                    let (grads, _norm) = par.gradients(&model, loss.backward(), None, &ctx)?;
                    model = optim.step(1e-2, model, grads);
                }
                // The rank's shards, their gradients and two AdamW moments.
                ParamLayout::of(&model).numel * (4 + 4 + 8)
            } else {
                // = Burn's AdamWConfig::new(), bit for bit, on this rank's rows.
                let mut optim = RowAdamW::new(&par, &model, &FlatAdamWConfig::new(), true, &ctx)?;
                for step in 0..STEPS {
                    let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, step)?, &device);
                    let loss = par.forward(&model, |m| mse(m.forward(x), y))?;
                    losses.push(par.data().mean_loss(loss.clone().into_scalar::<f32>())?);
                    let (rows, _norm) = par.row_gradients(&model, loss.backward(), None, &ctx)?;
                    let update = rows.dims()[0] > 0;
                    model = optim.step(1e-2, model, rows, update)?;
                }
                // Whole parameters; gradients and two AdamW moments of the rank's rows.
                let (params, rows) = optim.held_elements();
                params * 4 + rows * (4 + 8)
            };
            let weights = par.sharded().whole(model)?.l1_weights();
            Ok::<_, ParallelError>((losses, weights, bytes))
        })
        .expect("sharded training");
    results.into_iter().next().unwrap()
}

fn main() {
    let single = train_single();
    let zero2 = train_sharded(2);
    let zero3 = train_sharded(3);
    println!("step  loss(1 rank)  loss(ZeRO-2 dp=4)  loss(ZeRO-3 dp=2,fsdp=2)");
    for i in (0..STEPS).filter(|i| i % 5 == 0 || *i == STEPS - 1) {
        println!(
            "{i:>4}  {:>12.6}  {:>17.6}  {:>24.6}",
            single.0[i], zero2.0[i], zero3.0[i]
        );
    }
    // DDP holds every parameter, its gradient and two AdamW moments on every rank.
    let ddp = ParamLayout::of(&Mlp::new(7, &Device::flex())).numel * (4 + 4 + 8);
    println!(
        "bytes per rank for parameters + gradients + optimizer state: DDP {ddp}, ZeRO-2 over 4 ranks {}, ZeRO-3 over 2 shards {}",
        zero2.2, zero3.2
    );
    assert!(
        zero2.2 < ddp && zero3.2 < ddp,
        "sharding must hold less than DDP"
    );
    for (name, run) in [("ZeRO-2", &zero2), ("ZeRO-3/HSDP", &zero3)] {
        let run = (run.0.clone(), run.1.clone());
        let (loss_diff, w_diff) = differences(&single, &run);
        println!("{name}: max relative loss difference {loss_diff:.2e}; weights {w_diff:.2e}");
        assert!(
            loss_diff < 1e-5 && w_diff < 1e-5,
            "{name} must match one rank"
        );
    }
    println!("match: sharded training trains the same model as one rank");
}
