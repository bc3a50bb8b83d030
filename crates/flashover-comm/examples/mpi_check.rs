//! Every collective of the MPI engine against a sequential reference, run under `mpirun`:
//!
//! ```sh
//! cargo build -p flashover-comm --features mpi --example mpi_check
//! mpirun --oversubscribe -np 4 target/debug/examples/mpi_check
//! mpirun --oversubscribe -np 2 target/debug/examples/mpi_check --die 1   # must fail fast
//! mpirun --oversubscribe -np 2 target/debug/examples/mpi_check --stall 1 # must time out
//! ```
//!
//! Each rank derives every rank's input from a seed, so it can compute what a sequential fold
//! in rank order gives (the thread engine's result, bit for bit) and compare its own output
//! exactly. Sub-groups (even/odd ranks), variable all-to-all, send/recv around a ring and
//! barriers are covered. Exits non-zero on the first difference. With `--die R`, rank `R`
//! exits before a collective; with `--stall R` it sleeps past the 5 s deadline: either way the
//! job must end non-zero instead of hanging.

use flashover_comm::{CommunicatorExt, Group, MpiWorld, ReduceOp};
use std::time::Duration;

fn input(rank: usize, len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 31 + rank * 7 + salt) % 97) as f32 - 48.0) * 0.173 + (rank as f32) * 1e-3)
        .collect()
}

fn fold(group: &[usize], len: usize, salt: usize, op: ReduceOp) -> Vec<f32> {
    let mut acc = input(group[0], len, salt);
    for &r in &group[1..] {
        for (a, x) in acc.iter_mut().zip(input(r, len, salt)) {
            *a = match op {
                ReduceOp::Sum | ReduceOp::Avg => *a + x,
                ReduceOp::Max => a.max(x),
                ReduceOp::Min => a.min(x),
            };
        }
    }
    if op == ReduceOp::Avg {
        acc.iter_mut().for_each(|a| *a /= group.len() as f32);
    }
    acc
}

fn check(what: &str, got: &[f32], want: &[f32]) {
    let same = got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
    if !same {
        eprintln!("MISMATCH: {what}");
        std::process::exit(1);
    }
}

/// Every collective on `g`, whose members are the world ranks `members`.
fn exercise(g: &Group, members: &[usize], me: usize) {
    let (n, r) = (g.size(), g.rank());
    for len in [0usize, 1, 7, 1001, (1 << 16) + 3] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let mut x = input(me, len, 1);
            g.all_reduce(&mut x, op).unwrap();
            check(
                &format!("{} all_reduce {op:?} x{len}", g.name()),
                &x,
                &fold(members, len, 1, op),
            );
        }
        let send = input(me, len * n, 2);
        let mut recv = vec![0f32; len];
        g.reduce_scatter(&send, &mut recv, ReduceOp::Sum).unwrap();
        let whole = fold(members, len * n, 2, ReduceOp::Sum);
        check(
            &format!("{} reduce_scatter x{len}", g.name()),
            &recv,
            &whole[r * len..(r + 1) * len],
        );
        let gathered = g.all_gather_vec(&input(me, len, 3)).unwrap();
        let want: Vec<f32> = members.iter().flat_map(|&m| input(m, len, 3)).collect();
        check(&format!("{} all_gather x{len}", g.name()), &gathered, &want);
        let mut b = input(me, len, 4);
        g.broadcast(&mut b, n - 1).unwrap();
        check(
            &format!("{} broadcast x{len}", g.name()),
            &b,
            &input(members[n - 1], len, 4),
        );
    }
    // Variable all-to-all: rank i sends i + j + 1 elements to rank j.
    let send_counts: Vec<usize> = (0..n).map(|j| r + j + 1).collect();
    let recv_counts: Vec<usize> = (0..n).map(|i| i + r + 1).collect();
    let send: Vec<f32> = (0..send_counts.iter().sum::<usize>())
        .map(|k| (me * 1000 + k) as f32)
        .collect();
    let mut recv = vec![0f32; recv_counts.iter().sum()];
    g.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)
        .unwrap();
    let mut want = vec![];
    for (i, &m) in members.iter().enumerate() {
        let offset: usize = (0..r).map(|j| i + j + 1).sum();
        want.extend((offset..offset + i + r + 1).map(|k| (m * 1000 + k) as f32));
    }
    check(&format!("{} all_to_all_v", g.name()), &recv, &want);
    // Send/recv around the ring, several messages in flight before any receive.
    for k in 0..3 {
        g.send(&input(me, 100 + k, 5), (r + 1) % n).unwrap();
    }
    for k in 0..3 {
        let mut m = vec![0f32; 100 + k];
        g.recv(&mut m, (r + n - 1) % n).unwrap();
        check(
            &format!("{} recv #{k}", g.name()),
            &m,
            &input(members[(r + n - 1) % n], 100 + k, 5),
        );
    }
    g.barrier().unwrap();
}

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
    let all: Vec<usize> = (0..env.size()).collect();
    exercise(&world, &all, me);
    // Sub-groups: even and odd world ranks.
    let parity = world.split(me % 2, me, "parity").unwrap();
    let members: Vec<usize> = all.iter().copied().filter(|m| m % 2 == me % 2).collect();
    assert_eq!(parity.members(), &members[..]);
    exercise(&parity, &members, me);
    if me == 0 {
        println!(
            "mpi_check: every collective matched the sequential reference on {} ranks",
            env.size()
        );
    }
}
