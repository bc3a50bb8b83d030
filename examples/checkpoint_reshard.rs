//! Checkpointing *your own* Burn model, and resuming it on a different number of ranks.
//!
//! The MLP of `ddp_own_model` trains data parallel for half its steps on four rank threads,
//! which save a checkpoint (`Checkpoints`: the model's parameters and Burn's AdamW state, as
//! regions of the whole model's tensors); the job then stops. Two rank threads resume from it
//! and finish. The losses and final weights match one rank training without interruption
//! (fp32, 1e-5 relative).
//!
//! Run: `cargo run --example checkpoint_reshard`

mod common;

use burn::optim::{AdamWConfig, ModuleOptimizer};
use burn::tensor::Device;
use common::{GLOBAL_BATCH, Mlp, STEPS, batch, differences, mse, train_single};
use flashover::launch;
use flashover::plan_checkpoint::{Checkpoints, RunState};
use flashover_checkpoint::Checkpoint;
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::{ParallelizePlan, parallelize};
use std::path::Path;

/// Data parallel training on `world` ranks up to step `to`, resuming from the newest
/// checkpoint under `dir` when there is one, and saving there at `to`. Returns the losses of
/// the steps it ran and rank 0's final first-layer weight.
fn train(world: usize, to: usize, dir: &Path) -> (Vec<f32>, Vec<f32>) {
    let results = launch(world, |ctx| {
        let device = Device::flex().autodiff();
        let (model, par) = parallelize(Mlp::new(7, &device), &ParallelizePlan::new(), &ctx)?;
        let optim: ModuleOptimizer = AdamWConfig::new().init();
        let mut checkpoints = Checkpoints::new(dir, 1);
        // + Every rank reads what it holds, whatever layout wrote the checkpoint.
        let (mut model, mut optim, state) = match checkpoints.latest()? {
            Some(saved) => Checkpoints::resume(&par, &ctx, &saved, model, optim)?,
            None => (model, optim, RunState::default()),
        };
        let mut losses = vec![];
        for step in state.step as usize..to {
            let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, step)?, &device);
            let loss = par.forward(&model, |m| mse(m.forward(x), y))?;
            losses.push(par.data().mean_loss(loss.clone().into_scalar::<f32>())?);
            let (grads, _norm) = par.gradients(&model, loss.backward(), None, &ctx)?;
            model = optim.step(1e-2, model, grads);
        }
        checkpoints.save(&par, &ctx, to as u64, &model, &optim)?; // +
        Ok::<_, ParallelError>((losses, model.l1_weights()))
    })
    .expect("data parallel training");
    results.into_iter().next().unwrap()
}

fn main() {
    let dir = std::env::temp_dir().join(format!("flashover-example-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let single = train_single();
    let (mut losses, _) = train(4, STEPS / 2, &dir);
    let saved = Checkpoints::new(&dir, 1)
        .latest()
        .expect("listing")
        .expect("saved");
    let ckpt = Checkpoint::open(&saved).expect("the checkpoint");
    println!(
        "saved step {} by 4 ranks into {} files; resuming on 2 ranks",
        ckpt.step(),
        ckpt.index().files.len()
    );
    let (rest, w) = train(2, STEPS, &dir);
    losses.extend(rest);
    std::fs::remove_dir_all(&dir).expect("cleaning up");
    let (loss_diff, w_diff) = differences(&single, &(losses, w));
    println!(
        "against one rank without interruption: max relative loss difference {loss_diff:.2e}; max relative weight difference {w_diff:.2e}"
    );
    assert!(
        loss_diff < 1e-5 && w_diff < 1e-5,
        "resumed training must match"
    );
    println!("match: saved on 4 ranks, resumed on 2, same model as one rank");
}
