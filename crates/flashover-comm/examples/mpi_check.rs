//! Every collective of the MPI engine against a sequential reference, run under `mpirun`:
//!
//! ```sh
//! cargo build -p flashover-comm --features mpi --example mpi_check
//! mpirun --oversubscribe -np 4 target/debug/examples/mpi_check
//! mpirun --oversubscribe -np 2 target/debug/examples/mpi_check --die 1   # must fail fast
//! mpirun --oversubscribe -np 2 target/debug/examples/mpi_check --stall 1 # must time out
//! ```
//!
//! [`flashover_comm::conformance`] on the world and on its even and odd ranks, bit for bit
//! against the sequential reference (the thread engine's result). Exits non-zero on the first
//! difference. With `--die R`, rank `R` exits before a collective; with `--stall R` it sleeps
//! past the 5 s deadline: either way the job must end non-zero instead of hanging.

use flashover_comm::conformance::{Match, exercise_world};
use flashover_comm::{CommunicatorExt, MpiWorld, ReduceOp};
use std::time::Duration;

fn main() {
    let flag = |name: &str| -> Option<usize> {
        std::env::args()
            .skip_while(|a| a != name)
            .nth(1)
            .and_then(|v| v.parse().ok())
    };
    let (die, stall) = (flag("--die"), flag("--stall"));
    let env = MpiWorld::init().unwrap();
    let faulty = die.is_some() || stall.is_some();
    let world = env.group(Duration::from_secs(if faulty { 5 } else { 60 }));
    let me = env.rank();
    if let Some(sleeper) = stall {
        if me == sleeper {
            eprintln!("rank {me}: stalling for 60 s before the collective");
            std::thread::sleep(Duration::from_secs(60));
        }
        let mut x = vec![1f32; 4];
        world.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        std::process::exit(0);
    }
    if let Some(victim) = die {
        let mut x = vec![1f32; 4];
        world.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        if me == victim {
            eprintln!("rank {me}: exiting on purpose before the next collective");
            std::process::exit(7);
        }
        world.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        eprintln!("rank {me}: the collective completed without rank {victim}");
        std::process::exit(0);
    }
    // The world, then its even and odd ranks as sub-groups.
    if let Err(e) = exercise_world(&world, Match::Exact) {
        eprintln!("MISMATCH: {e}");
        std::process::exit(1);
    }
    if me == 0 {
        println!(
            "mpi_check: every collective matched the sequential reference on {} ranks",
            env.size()
        );
    }
}
