//! No hangs: timeouts, mismatched calls, dead ranks and injected faults all surface as errors
//! that name the op, the group and the ranks involved.

mod common;

use common::run;
use flashover_comm::{
    CommError, Communicator, CommunicatorExt, FaultPlan, OpKind, ReduceOp, ThreadWorld,
};
use std::time::{Duration, Instant};

#[test]
fn a_stalled_rank_times_out_the_others_naming_it() {
    let world = ThreadWorld::new(4)
        .timeout(Duration::from_millis(1000))
        .faults(FaultPlan::new().stall_at(2, OpKind::AllReduce, 1, Duration::from_millis(2500)));
    let start = Instant::now();
    let got = run(world, |c| {
        let mut x = vec![1.0f32; 8];
        c.all_reduce(&mut x, ReduceOp::Sum).unwrap(); // call #0 succeeds everywhere
        c.all_reduce(&mut x, ReduceOp::Sum)
    });
    assert!(start.elapsed() < Duration::from_secs(10));
    for (rank, r) in got.iter().enumerate() {
        let err = r.as_ref().unwrap_err();
        if rank == 2 {
            // The stalled rank arrives late and finds the group already failed.
            assert!(matches!(err, CommError::Poisoned { .. }), "{err}");
        }
        match err.root_cause() {
            CommError::Timeout {
                op,
                group,
                seq,
                missing,
                ..
            } => {
                assert_eq!((*op, group.as_str(), *seq), (OpKind::AllReduce, "world", 1));
                assert_eq!(missing, &vec![2]);
            }
            other => panic!("rank {rank}: expected a timeout, got {other}"),
        }
    }
    let msg = got[0].as_ref().unwrap_err().to_string();
    assert!(
        msg.contains("all_reduce #1 in group world") && msg.contains("ranks [2] did not arrive"),
        "{msg}"
    );
}

#[test]
fn mismatched_calls_are_reported_not_mixed() {
    let got = run(ThreadWorld::new(2).timeout(Duration::from_secs(10)), |c| {
        if c.rank() == 0 {
            c.all_gather_vec(&[0.0f32; 10]).map(|_| ())
        } else {
            let mut x = vec![0.0f32; 12];
            c.all_reduce(&mut x, ReduceOp::Sum)
        }
    });
    for r in &got {
        let err = r.as_ref().unwrap_err();
        assert!(matches!(err, CommError::Mismatch { seq: 0, .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("rank 0: all_gather f32 send=40B")
                && msg.contains("rank 1: all_reduce f32 send=48B"),
            "{msg}"
        );
    }
}

#[test]
fn mismatched_sizes_of_the_same_op_are_reported() {
    let got = run(ThreadWorld::new(3), |c| {
        let mut x = vec![0.0f32; 10 + c.rank()];
        c.all_reduce(&mut x, ReduceOp::Sum)
    });
    assert!(
        got.iter()
            .all(|r| matches!(r, Err(CommError::Mismatch { .. })))
    );
}

#[test]
fn inconsistent_all_to_all_counts_are_reported() {
    let got = run(ThreadWorld::new(2), |c| {
        // Rank 0 sends 2 elements to rank 1, which expects 3.
        let send = vec![1.0f32; 3];
        let mut recv = vec![0.0f32; if c.rank() == 0 { 2 } else { 4 }];
        let (sc, rc) = if c.rank() == 0 {
            ([1, 2], [1, 1])
        } else {
            ([1, 2], [3, 1])
        };
        c.all_to_all_v(&send, &sc, &mut recv, &rc)
    });
    for r in &got {
        let msg = r.as_ref().unwrap_err().to_string();
        assert!(msg.contains("counts disagree"), "{msg}");
    }
}

#[test]
fn invalid_arguments_on_one_rank_fail_every_rank_at_once() {
    let start = Instant::now();
    let got = run(ThreadWorld::new(2).timeout(Duration::from_secs(30)), |c| {
        let send = vec![0.0f32; 4];
        let mut recv = vec![0.0f32; if c.rank() == 0 { 2 } else { 3 }];
        c.reduce_scatter(&send, &mut recv, ReduceOp::Sum)
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "must not wait for the timeout"
    );
    let msg = got[1].as_ref().unwrap_err().to_string();
    assert!(msg.contains("INVALID"), "{msg}");
}

#[test]
fn a_rank_that_dies_makes_the_others_fail_fast_naming_it() {
    let world = ThreadWorld::new(3)
        .timeout(Duration::from_secs(30))
        .faults(FaultPlan::new().panic_at(1, OpKind::AllGather, 0));
    let start = Instant::now();
    let comms = world.build();
    let results: Vec<std::thread::Result<Result<Vec<f32>, CommError>>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| s.spawn(move || c.all_gather_vec(&[1.0f32])))
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "peers must not wait for the timeout"
    );
    assert!(results[1].is_err(), "rank 1 panicked");
    for r in [0, 2] {
        let err = results[r].as_ref().unwrap().as_ref().unwrap_err();
        match err {
            CommError::PeerLeft {
                rank: 1,
                reason,
                op: OpKind::AllGather,
                ..
            } => assert_eq!(reason, "panicked"),
            other => panic!("rank {r}: {other}"),
        }
    }
}

#[test]
fn a_rank_that_finishes_early_is_named_by_the_rest() {
    let got = run(ThreadWorld::new(2).timeout(Duration::from_secs(30)), |c| {
        if c.rank() == 0 {
            c.leave("returned from its work");
            return None;
        }
        Some(c.barrier())
    });
    let err = got[1].as_ref().unwrap().as_ref().unwrap_err();
    assert!(matches!(err, CommError::PeerLeft { rank: 0, .. }), "{err}");
    assert!(err.to_string().contains("returned from its work"));
}

#[test]
fn recv_from_a_silent_peer_times_out_naming_it() {
    let got = run(
        ThreadWorld::new(2).timeout(Duration::from_millis(500)),
        |c| {
            if c.rank() == 0 {
                let mut buf = [0.0f32; 4];
                Some(c.recv(&mut buf, 1))
            } else {
                // Alive but silent for longer than the timeout.
                std::thread::sleep(Duration::from_millis(1500));
                None
            }
        },
    );
    match got[0].as_ref().unwrap() {
        Err(CommError::Timeout {
            op: OpKind::Recv,
            missing,
            ..
        }) => assert_eq!(missing, &vec![1]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn recv_with_the_wrong_length_is_a_mismatch() {
    let got = run(ThreadWorld::new(2), |c| {
        if c.rank() == 0 {
            c.send(&[1.0f32; 3], 1).map(|_| ())
        } else {
            let mut buf = [0.0f32; 4];
            c.recv(&mut buf, 0)
        }
    });
    let msg = got[1].as_ref().unwrap_err().to_string();
    assert!(
        msg.contains("sent 12 bytes of f32") && msg.contains("expected 16 bytes"),
        "{msg}"
    );
}

#[test]
fn injected_delays_do_not_change_results() {
    let body = |c: flashover_comm::ThreadComm| {
        let mut x = common::floats(c.rank() as u64, 999);
        for _ in 0..3 {
            c.all_reduce(&mut x, ReduceOp::Avg).unwrap();
            x = c.all_gather_vec(&x[..333]).unwrap();
        }
        x
    };
    let plain = run(ThreadWorld::new(3), body);
    let delayed = run(
        ThreadWorld::new(3).faults(
            FaultPlan::new()
                .delay_every(0, OpKind::AllGather, Duration::from_millis(3))
                .delay_every(2, OpKind::AllReduce, Duration::from_millis(2)),
        ),
        body,
    );
    assert_eq!(plain, delayed);
}

#[test]
fn two_threads_of_one_rank_in_a_group_fail_every_rank_at_once_with_the_reason() {
    // Rank 0 calls from two threads at the same time (as a user collective on the DDP group
    // while DDP's own thread reduces on it would); rank 1 calls once and waits.
    let start = Instant::now();
    let got = run(ThreadWorld::new(2).timeout(Duration::from_secs(30)), |c| {
        if c.rank() == 0 {
            std::thread::scope(|s| {
                let other = s.spawn(|| {
                    let mut y = vec![1.0f32; 4];
                    c.all_reduce(&mut y, ReduceOp::Sum)
                });
                std::thread::sleep(Duration::from_millis(200));
                let mut x = vec![1.0f32; 4];
                let mine = c.all_reduce(&mut x, ReduceOp::Sum);
                let theirs = other.join().unwrap();
                mine.and(theirs)
            })
        } else {
            std::thread::sleep(Duration::from_millis(600));
            let mut x = vec![1.0f32; 4];
            c.all_reduce(&mut x, ReduceOp::Sum)
        }
    });
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "no one waits for the timeout"
    );
    let msg = got[0].as_ref().unwrap_err().root_cause().to_string();
    assert!(
        msg.contains("two threads of one rank used the group at once"),
        "{msg}"
    );
    assert!(got[1].is_err(), "the other rank fails too");
}
