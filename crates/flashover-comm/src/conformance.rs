//! Every operation of a [`Communicator`](crate::Communicator) checked against a sequential reference, for any
//! engine at any world size: what `mpi_check` runs under `mpirun`, `nccl_check` on every GPU
//! of a machine, and this crate's tests on the thread engine.
//!
//! Each rank derives every rank's input from the rank and a salt, so it can compute what a
//! sequential fold in rank order gives (the thread engine's result, bit for bit) and compare its
//! own output. Lengths from 0 to 65,539 elements, every reduction, variable all-to-all, sends and
//! receives (several in flight where the engine buffers sends; a batch around the ring on every
//! engine), and a barrier.

use crate::communicator::{CommunicatorExt, Group, Transfer};
use crate::dtype::DType;
use crate::op::ReduceOp;

/// How close a result must be to the sequential reference.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Match {
    /// Bit for bit: engines that reduce in rank order (thread, MPI).
    Exact,
    /// Within this relative error of the reference's largest magnitude: engines that reduce in
    /// an order of their own (NCCL).
    Within(f32),
}

/// Rank `rank`'s input of `len` elements for the check salted `salt`.
fn input(rank: usize, len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 31 + rank * 7 + salt) % 97) as f32 - 48.0) * 0.173 + (rank as f32) * 1e-3)
        .collect()
}

/// The reduction of `members`' inputs in rank order.
fn fold(members: &[usize], len: usize, salt: usize, op: ReduceOp) -> Vec<f32> {
    let mut acc = input(members[0], len, salt);
    for &r in &members[1..] {
        for (a, x) in acc.iter_mut().zip(input(r, len, salt)) {
            *a = match op {
                ReduceOp::Sum | ReduceOp::Avg => *a + x,
                ReduceOp::Max => a.max(x),
                ReduceOp::Min => a.min(x),
            };
        }
    }
    if op == ReduceOp::Avg {
        acc.iter_mut().for_each(|a| *a /= members.len() as f32);
    }
    acc
}

fn compare(what: String, got: &[f32], want: &[f32], how: Match) -> Result<(), String> {
    let scale = want.iter().fold(1f32, |m, x| m.max(x.abs()));
    let close = |a: &f32, b: &f32| match how {
        Match::Exact => a.to_bits() == b.to_bits(),
        Match::Within(tol) => (a - b).abs() <= tol * scale,
    };
    if got.len() == want.len() && got.iter().zip(want).all(|(a, b)| close(a, b)) {
        return Ok(());
    }
    let first = (got.iter().zip(want)).position(|(a, b)| !close(a, b));
    Err(format!(
        "{what}: {} elements where {} were expected; first difference at {first:?}",
        got.len(),
        want.len()
    ))
}

/// Every operation on `g`, whose members are the world ranks `members` (this rank is world
/// rank `me`). Collective: every rank of `g` calls it. The first difference is returned, naming
/// the group and the operation.
pub fn exercise(g: &Group, members: &[usize], me: usize, how: Match) -> Result<(), String> {
    let (n, r) = (g.size(), g.rank());
    let name = g.name().to_string();
    let fail = |op: &str, e: crate::CommError| format!("{name} {op}: {e}");
    for len in [0usize, 1, 7, 1001, (1 << 16) + 3] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let mut x = input(me, len, 1);
            g.all_reduce(&mut x, op)
                .map_err(|e| fail("all_reduce", e))?;
            let want = fold(members, len, 1, op);
            compare(format!("{name} all_reduce {op:?} x{len}"), &x, &want, how)?;
        }
        let send = input(me, len * n, 2);
        let mut recv = vec![0f32; len];
        (g.reduce_scatter(&send, &mut recv, ReduceOp::Sum))
            .map_err(|e| fail("reduce_scatter", e))?;
        let whole = fold(members, len * n, 2, ReduceOp::Sum);
        let want = &whole[r * len..(r + 1) * len];
        compare(format!("{name} reduce_scatter x{len}"), &recv, want, how)?;
        let gathered = (g.all_gather_vec(&input(me, len, 3))).map_err(|e| fail("all_gather", e))?;
        let want: Vec<f32> = members.iter().flat_map(|&m| input(m, len, 3)).collect();
        compare(format!("{name} all_gather x{len}"), &gathered, &want, how)?;
        let mut b = input(me, len, 4);
        g.broadcast(&mut b, n - 1)
            .map_err(|e| fail("broadcast", e))?;
        let want = input(members[n - 1], len, 4);
        compare(format!("{name} broadcast x{len}"), &b, &want, Match::Exact)?;
    }
    // Variable all-to-all: rank i sends i + j + 1 elements to rank j.
    let send_counts: Vec<usize> = (0..n).map(|j| r + j + 1).collect();
    let recv_counts: Vec<usize> = (0..n).map(|i| i + r + 1).collect();
    let send: Vec<f32> = (0..send_counts.iter().sum::<usize>())
        .map(|k| (me * 1000 + k) as f32)
        .collect();
    let mut recv = vec![0f32; recv_counts.iter().sum()];
    (g.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts))
        .map_err(|e| fail("all_to_all_v", e))?;
    let mut want = vec![];
    for (i, &m) in members.iter().enumerate() {
        let offset: usize = (0..r).map(|j| i + j + 1).sum();
        want.extend((offset..offset + i + r + 1).map(|k| (m * 1000 + k) as f32));
    }
    compare(format!("{name} all_to_all_v"), &recv, &want, Match::Exact)?;
    if n == 1 {
        // Point to point needs a peer (the thread engine refuses a send to oneself).
        return g.barrier().map_err(|e| fail("barrier", e));
    }
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    if g.sends_are_buffered() {
        // Several messages in flight before any receive.
        for k in 0..3 {
            g.send(&input(me, 100 + k, 5), next)
                .map_err(|e| fail("send", e))?;
        }
        for k in 0..3 {
            let mut m = vec![0f32; 100 + k];
            g.recv(&mut m, prev).map_err(|e| fail("recv", e))?;
            let want = input(members[prev], 100 + k, 5);
            compare(format!("{name} recv #{k}"), &m, &want, Match::Exact)?;
        }
    }
    // A batch around the ring, in both directions at once: a send to each neighbour and a
    // receive from each, which an engine whose sends wait for their receives needs together.
    let (to_next, to_prev) = (input(me, 33, 6), input(me, 17, 7));
    let (mut from_prev, mut from_next) = (vec![0f32; 33], vec![0f32; 17]);
    let f32s = DType::F32;
    g.exchange_bytes(&mut [
        Transfer::Send {
            buf: bytemuck::cast_slice(&to_next),
            dtype: f32s,
            dst: next,
        },
        Transfer::Send {
            buf: bytemuck::cast_slice(&to_prev),
            dtype: f32s,
            dst: prev,
        },
        Transfer::Recv {
            buf: bytemuck::cast_slice_mut(&mut from_prev),
            dtype: f32s,
            src: prev,
        },
        Transfer::Recv {
            buf: bytemuck::cast_slice_mut(&mut from_next),
            dtype: f32s,
            src: next,
        },
    ])
    .map_err(|e| fail("exchange", e))?;
    let want = input(members[prev], 33, 6);
    compare(
        format!("{name} exchange from the previous rank"),
        &from_prev,
        &want,
        Match::Exact,
    )?;
    let want = input(members[next], 17, 7);
    compare(
        format!("{name} exchange from the next rank"),
        &from_next,
        &want,
        Match::Exact,
    )?;
    g.barrier().map_err(|e| fail("barrier", e))
}

/// [`exercise`] on `world` (rank `me` of it), then on its even and odd ranks as two sub-groups.
pub fn exercise_world(world: &Group, how: Match) -> Result<(), String> {
    let me = world.rank();
    let all: Vec<usize> = (0..world.size()).collect();
    exercise(world, &all, me, how)?;
    let parity = (world.split(me % 2, me, "parity")).map_err(|e| e.to_string())?;
    let members: Vec<usize> = all.iter().copied().filter(|m| m % 2 == me % 2).collect();
    if parity.members() != members {
        return Err(format!(
            "split by parity gave members {:?}, expected {members:?}",
            parity.members()
        ));
    }
    exercise(&parity, &members, me, how)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ThreadWorld;
    use std::sync::Arc;

    #[test]
    fn the_thread_engine_matches_the_sequential_reference_bit_for_bit() {
        for n in [1, 2, 3, 4] {
            let comms = ThreadWorld::new(n).build();
            let results: Vec<Result<(), String>> = std::thread::scope(|s| {
                let handles: Vec<_> = (comms.into_iter())
                    .map(|c| {
                        s.spawn(move || exercise_world(&Group::new(Arc::new(c)), Match::Exact))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for r in results {
                r.unwrap_or_else(|e| panic!("world of {n}: {e}"));
            }
        }
    }

    #[test]
    fn a_wrong_result_is_reported_naming_the_operation() {
        let err = compare(
            "g all_reduce Sum x3".into(),
            &[1.0, 2.0, 3.5],
            &[1.0, 2.0, 3.0],
            Match::Exact,
        )
        .unwrap_err();
        assert!(
            err.contains("g all_reduce Sum x3") && err.contains("Some(2)"),
            "{err}"
        );
        assert!(
            compare(
                "x".into(),
                &[1.0, 2.0],
                &[1.0, 2.0 + 1e-7],
                Match::Within(1e-6)
            )
            .is_ok()
        );
    }
}
