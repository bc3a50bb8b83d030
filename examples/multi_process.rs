//! One script, two ways to run its ranks: as threads of this process, or one rank per process
//! under `mpirun` (or `srun`). The training code is the same; only how the world is obtained
//! differs; with the same number of ranks, MPI gives the threads' results bit for bit.
//!
//! The MLP of `ddp_own_model` is trained with DDP and checked against one rank.
//!
//! Run with threads: `cargo run --features mpi --example multi_process`
//! Run with processes (needs OpenMPI):
//! `cargo build --features mpi --example multi_process && mpirun -np 4 target/debug/examples/multi_process`

mod common;

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Device;
use common::{GLOBAL_BATCH, Mlp, STEPS, batch, differences, mse, train_single};
use flashover::{Axis, CommunicatorExt, Launch, ProcessEnv, RankContext, ReduceOp};
use flashover_comm::MpiWorld;
use flashover_parallel::ParallelError;
use flashover_parallel::data_parallel::DataParallelConfig;
use std::time::Duration;

/// One rank's training: nothing here depends on how the ranks were started.
fn train_rank(ctx: RankContext) -> Result<(Vec<f32>, Vec<f32>), ParallelError> {
    let device = Device::flex().autodiff();
    let dp = ctx.group(Axis::Dp);
    let per_rank = GLOBAL_BATCH / dp.size();
    let (mut model, mut ddp) = DataParallelConfig::new().init(Mlp::new(7, &device), dp)?;
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
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
        model = optim.step(1e-2, model, grads);
    }
    let w = model.l1_weights();
    Ok((losses, w))
}

fn main() {
    let env = ProcessEnv::detect().expect("launcher variables");
    let (how, rank, result) = match env {
        // + Started by mpirun/srun: this process is one rank of the MPI world.
        Some(env) => {
            let mpi = MpiWorld::init().expect("MPI");
            let world = mpi.group(Duration::from_secs(60));
            let mesh = format!("dp={}", env.world);
            let result = Launch::new(mesh.as_str())
                .expect("mesh")
                .run_process(world, train_rank)
                .expect("training");
            ("processes (mpirun)", env.rank, result)
        }
        // Started directly: four ranks as threads.
        None => {
            let results = Launch::new("dp=4")
                .expect("mesh")
                .run(train_rank)
                .expect("training");
            ("threads", 0, results.into_iter().next().unwrap())
        }
    };
    if rank != 0 {
        return;
    }
    let single = train_single();
    let (loss_diff, w_diff) = differences(&single, &result);
    println!(
        "DDP as {how}: final loss {:.6} (one rank {:.6}); max relative loss difference {loss_diff:.2e}, weights {w_diff:.2e}",
        result.0[STEPS - 1],
        single.0[STEPS - 1]
    );
    assert!(loss_diff < 1e-5 && w_diff < 1e-5, "DDP must match one rank");
    println!("match");
}
