//! Checkpointing *your own* Burn model under DDP, and resuming it on a different number of
//! ranks.
//!
//! The MLP of `ddp_own_model` trains for half its steps on four rank threads, which save a
//! sharded checkpoint (each rank writes a quarter of the parameters and AdamW moments); the
//! job then stops. Two rank threads resume from it and finish. The losses and final weights
//! match one rank training without interruption (fp32, 1e-5 relative).
//!
//! Run: `cargo run --example checkpoint_reshard`

mod common;

use burn::optim::GradientsParams;
use burn::tensor::Device;
use common::{GLOBAL_BATCH, Mlp, STEPS, batch, differences, mse, train_single};
use flashover::train::checkpoint::{LocalState, Saver, whole_segments};
use flashover::{Axis, CommunicatorExt, ReduceOp, launch};
use flashover_checkpoint::Checkpoint;
use flashover_parallel::data_parallel::DataParallelConfig;
use flashover_parallel::params::{ParamLayout, flatten_params, load_flat};
use flashover_parallel::{FlatAdamWConfig, ModuleAdamW, ParallelError};
use std::path::Path;

/// The model's state as checkpoint pieces: whole tensors named as the model's parameters, and
/// the optimizer's moments in the same layout.
fn state(model: &Mlp, optim: &ModuleAdamW) -> LocalState {
    let segments = whole_segments(&ParamLayout::of(model), str::to_string);
    let (m1, m2) = optim.flat().moments();
    LocalState {
        params: flatten_params(model),
        param_segments: segments.clone(),
        moments: [m1.to_vec(), m2.to_vec()],
        moment_segments: segments,
        steps_taken: optim.flat().steps_taken(),
    }
}

/// DDP training of steps `from..to` on `world` ranks, resuming from `dir` when `from > 0` and
/// saving there at `to`. Returns the losses and rank 0's final first-layer weight.
fn train_ddp(world: usize, from: usize, to: usize, dir: &Path) -> (Vec<f32>, Vec<f32>) {
    let per_rank = GLOBAL_BATCH / world;
    let results = launch(world, |ctx| {
        let device = Device::flex().autodiff();
        let dp = ctx.group(Axis::Dp);
        let mut model = Mlp::new(7, &device);
        // The optimizer whose state a checkpoint can hold (equal to Burn's AdamW).
        let mut optim = ModuleAdamW::new(&FlatAdamWConfig::new(), &model);
        if from > 0 {
            // Every rank reads what it holds (here: everything, replicated) from the pieces
            // the four ranks wrote.
            let ckpt = Checkpoint::open(dir).map_err(|e| ParallelError::Invalid(e.to_string()))?;
            let mut s = state(&model, &optim);
            s.load(&ckpt)
                .map_err(|e| ParallelError::Invalid(e.to_string()))?;
            model = load_flat(model, &s.params);
            let [m1, m2] = s.moments;
            optim
                .flat_mut()
                .restore(s.steps_taken, m1, m2)
                .map_err(ParallelError::Invalid)?;
        }
        let (mut model, mut ddp) = DataParallelConfig::new().init(model, dp)?;
        let mut losses = vec![];
        for step in from..to {
            let start = step * GLOBAL_BATCH + dp.rank() * per_rank;
            let (x, y) = batch(start..start + per_rank, &device);
            ddp.begin_step(1);
            let loss = mse(ddp.prepare(&model).forward(x), y);
            let mut l = [loss.clone().into_scalar::<f32>()];
            dp.all_reduce(&mut l, ReduceOp::Avg)?;
            losses.push(l[0]);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            ddp.backward_done(&model, grads)?;
            let grads = ddp.finish(&model, None)?.grads;
            model = optim.step(1e-2, model, &grads)?;
        }
        if from == 0 {
            // Replicas share the writing: each rank writes 1/world of every state.
            let s = state(&model, &optim);
            let replicas = (dp.rank(), dp.size());
            let run = serde_json::json!({ "step": to, "adamw_steps": s.steps_taken });
            Saver::new(dir, 1, false, None)
                .save(dp, to as u64, run, s.pieces_for(replicas, replicas))
                .map_err(ParallelError::Invalid)?;
        }
        let w = model.l1_weights();
        Ok::<_, ParallelError>((losses, w))
    })
    .expect("DDP training");
    results.into_iter().next().unwrap()
}

fn main() {
    let dir = std::env::temp_dir().join(format!("flashover-example-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let single = train_single();
    let (mut losses, _) = train_ddp(4, 0, STEPS / 2, &dir);
    let ckpt = Checkpoint::open(&dir).expect("the checkpoint");
    println!(
        "saved step {} by 4 ranks into {} files; resuming on 2 ranks",
        ckpt.step(),
        ckpt.index().files.len()
    );
    let (rest, w) = train_ddp(2, STEPS / 2, STEPS, &dir);
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
