//! One script, two ways to run its ranks: as threads of this process, or one rank per process
//! under `mpirun` (or `srun`). The training code is the same; only how the world is obtained
//! differs; with the same number of ranks, MPI gives the threads' results bit for bit.
//!
//! The MLP of `ddp_own_model` is trained data parallel (a plan that splits nothing) and checked
//! against one rank.
//!
//! Run with threads: `cargo run --features mpi --example multi_process`
//! Run with processes (needs OpenMPI):
//! `cargo build --features mpi --example multi_process && mpirun -np 4 target/debug/examples/multi_process`

mod common;

use burn::optim::AdamWConfig;
use burn::tensor::Device;
use common::{GLOBAL_BATCH, Mlp, STEPS, batch, differences, mse, train_single};
use flashover::{Launch, ProcessEnv, RankContext};
use flashover_comm::MpiWorld;
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::{ParallelizePlan, parallelize};
use std::time::Duration;

/// One rank's training: nothing here depends on how the ranks were started.
fn train_rank(ctx: RankContext) -> Result<(Vec<f32>, Vec<f32>), ParallelError> {
    let device = Device::flex().autodiff();
    let (mut model, par) = parallelize(Mlp::new(7, &device), &ParallelizePlan::new(), &ctx)?;
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
        let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, step)?, &device);
        let loss = par.forward(&model, |m| mse(m.forward(x), y))?;
        losses.push(par.data().mean_loss(loss.clone().into_scalar::<f32>())?);
        let (grads, _norm) = par.gradients(&model, loss.backward(), None, &ctx)?;
        model = optim.step(1e-2, model, grads);
    }
    Ok((losses, model.l1_weights()))
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
