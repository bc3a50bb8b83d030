//! Every collective at world sizes 1, 2, 3, 4 and 8 and at sizes 0, 1, odd and large, compared
//! bit for bit with a sequential reference written independently of the engine.

mod common;

use common::{floats, run};
use flashover_comm::{Communicator, CommunicatorExt, ReduceOp, ThreadWorld};

const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];
const SIZES: [usize; 5] = [0, 1, 7, 1001, (1 << 20) + 3];

/// Sequential reference: fold in rank order, divide once for `Avg`.
fn reference(inputs: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
    let n = inputs.len();
    (0..inputs[0].len())
        .map(|i| {
            let mut acc = inputs[0][i];
            for input in &inputs[1..] {
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + input[i],
                    ReduceOp::Max => acc.max(input[i]),
                    ReduceOp::Min => acc.min(input[i]),
                };
            }
            if op == ReduceOp::Avg {
                acc / n as f32
            } else {
                acc
            }
        })
        .collect()
}

fn rank_data(rank: usize, len: usize) -> Vec<f32> {
    floats(1000 + rank as u64, len)
}

#[test]
fn all_reduce_matches_sequential_reference_bitwise() {
    for n in WORLDS {
        for len in SIZES {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let inputs: Vec<Vec<f32>> = (0..n).map(|r| rank_data(r, len)).collect();
                let expected = reference(&inputs, op);
                let got = run(ThreadWorld::new(n), |c| {
                    let mut x = rank_data(c.rank(), len);
                    c.all_reduce(&mut x, op).unwrap();
                    x
                });
                for (r, g) in got.iter().enumerate() {
                    assert!(
                        g.iter()
                            .map(|v| v.to_bits())
                            .eq(expected.iter().map(|v| v.to_bits())),
                        "all_reduce {op:?} n={n} len={len}: rank {r} differs from the reference"
                    );
                }
            }
        }
    }
}

#[test]
fn all_reduce_of_integers_is_exact() {
    for n in WORLDS {
        let got = run(ThreadWorld::new(n), |c| {
            let mut x: Vec<i64> = (0..37).map(|i| i * (c.rank() as i64 + 1)).collect();
            c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            let mut m: Vec<u32> = vec![c.rank() as u32; 5];
            c.all_reduce(&mut m, ReduceOp::Max).unwrap();
            (x, m)
        });
        let factor: i64 = (1..=n as i64).sum();
        for (x, m) in got {
            assert_eq!(x, (0..37).map(|i| i * factor).collect::<Vec<_>>());
            assert_eq!(m, vec![n as u32 - 1; 5]);
        }
    }
}

#[test]
fn reduce_scatter_gives_each_rank_its_reduced_block() {
    for n in WORLDS {
        for block in SIZES {
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| rank_data(r, block * n)).collect();
            let full = reference(&inputs, ReduceOp::Sum);
            let got = run(ThreadWorld::new(n), |c| {
                let send = rank_data(c.rank(), block * n);
                let mut recv = vec![0.0; block];
                c.reduce_scatter(&send, &mut recv, ReduceOp::Sum).unwrap();
                recv
            });
            for (r, g) in got.iter().enumerate() {
                let want = &full[r * block..(r + 1) * block];
                assert!(
                    g.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "n={n} block={block} rank {r}"
                );
            }
        }
    }
}

#[test]
fn all_gather_concatenates_in_rank_order() {
    for n in WORLDS {
        for len in SIZES {
            let expected: Vec<f32> = (0..n).flat_map(|r| rank_data(r, len)).collect();
            let got = run(ThreadWorld::new(n), |c| {
                c.all_gather_vec(&rank_data(c.rank(), len)).unwrap()
            });
            assert!(got.iter().all(|g| g == &expected), "n={n} len={len}");
        }
    }
}

#[test]
fn broadcast_copies_the_root_buffer_everywhere() {
    for n in WORLDS {
        for len in SIZES {
            let root = n - 1;
            let expected = rank_data(root, len);
            let got = run(ThreadWorld::new(n), |c| {
                let mut x = rank_data(c.rank(), len);
                c.broadcast(&mut x, root).unwrap();
                x
            });
            assert!(got.iter().all(|g| g == &expected), "n={n} len={len}");
        }
    }
}

/// Rank `i` sends `(i + j) % 3 + len_base` elements to rank `j`, each tagged with (i, j).
fn a2a_counts(i: usize, j: usize, base: usize) -> usize {
    (i + 2 * j) % 3 + base
}

#[test]
fn all_to_all_v_routes_variable_segments() {
    for n in WORLDS {
        for base in [0, 1, 513] {
            let got = run(ThreadWorld::new(n), |c| {
                let me = c.rank();
                let send_counts: Vec<usize> = (0..n).map(|j| a2a_counts(me, j, base)).collect();
                let send: Vec<f32> = (0..n)
                    .flat_map(|j| {
                        (0..send_counts[j]).map(move |k| (me * 1_000_000 + j * 1000 + k) as f32)
                    })
                    .collect();
                let (recv, counts) = c.all_to_all_v_exchange(&send, &send_counts).unwrap();
                (recv, counts)
            });
            for (me, (recv, counts)) in got.iter().enumerate() {
                let want_counts: Vec<usize> = (0..n).map(|i| a2a_counts(i, me, base)).collect();
                assert_eq!(counts, &want_counts);
                let want: Vec<f32> = (0..n)
                    .flat_map(|i| {
                        (0..want_counts[i]).map(move |k| (i * 1_000_000 + me * 1000 + k) as f32)
                    })
                    .collect();
                assert_eq!(recv, &want, "n={n} base={base} rank {me}");
            }
        }
    }
}

#[test]
fn send_and_recv_deliver_in_order_around_a_ring() {
    for n in [2, 3, 4, 8] {
        let got = run(ThreadWorld::new(n), |c| {
            let (me, next, prev) = (c.rank(), (c.rank() + 1) % n, (c.rank() + n - 1) % n);
            for k in 0..3 {
                c.send(&[me as f32, k as f32], next).unwrap();
            }
            (0..3)
                .map(|_| {
                    let mut buf = [0.0f32; 2];
                    c.recv(&mut buf, prev).unwrap();
                    buf
                })
                .collect::<Vec<_>>()
        });
        for (me, msgs) in got.iter().enumerate() {
            let prev = (me + n - 1) % n;
            assert_eq!(
                msgs,
                &(0..3).map(|k| [prev as f32, k as f32]).collect::<Vec<_>>()
            );
        }
    }
}

#[test]
fn split_builds_sub_groups_that_reduce_independently() {
    // 8 ranks split into even and odd groups, ordered by descending key.
    let got = run(ThreadWorld::new(8), |c| {
        let g = c.split(c.rank() % 2, 100 - c.rank(), "parity").unwrap();
        let mut x = vec![c.rank() as f32];
        g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        // A sub-group of a sub-group.
        let h = g.split(g.rank() / 2, g.rank(), "pair").unwrap();
        let mut y = vec![c.rank() as u64];
        h.all_reduce(&mut y, ReduceOp::Sum).unwrap();
        (
            g.rank(),
            g.size(),
            g.members().to_vec(),
            x[0],
            h.size(),
            y[0],
            g.name().to_string(),
        )
    });
    for (rank, (grank, gsize, members, sum, hsize, pair_sum, name)) in got.into_iter().enumerate() {
        assert_eq!(gsize, 4);
        let expect_members: Vec<usize> = (0..8).rev().filter(|r| r % 2 == rank % 2).collect();
        assert_eq!(members, expect_members);
        assert_eq!(members[grank], rank);
        assert_eq!(sum, if rank.is_multiple_of(2) { 12.0 } else { 16.0 });
        assert_eq!(hsize, 2);
        let partner = members[grank ^ 1];
        assert_eq!(pair_sum, (rank + partner) as u64);
        assert!(name.starts_with("parity["), "{name}");
    }
}

#[test]
fn results_are_identical_run_to_run() {
    let once = || {
        run(ThreadWorld::new(3), |c| {
            let mut x = rank_data(c.rank(), 10_007);
            c.all_reduce(&mut x, ReduceOp::Avg).unwrap();
            x
        })
    };
    let first = once();
    for _ in 0..5 {
        assert_eq!(once(), first);
    }
}

#[test]
fn stats_count_calls_and_bytes() {
    let got = run(ThreadWorld::new(2), |c| {
        let mut x = vec![1.0f32; 256];
        c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        c.barrier().unwrap();
        c.stats()
    });
    for s in got {
        let ar = s.ops[&flashover_comm::OpKind::AllReduce];
        assert_eq!((ar.calls, ar.bytes), (2, 2048));
        assert_eq!(s.total().calls, 3);
    }
}
