//! The launcher: results in rank order, groups per axis, and failures that name their rank.

use flashover_runtime::{
    Axis, CommError, CommunicatorExt, FaultPlan, Launch, LaunchError, OpKind, ReduceOp, launch,
};
use std::time::{Duration, Instant};

#[test]
fn results_come_back_in_rank_order_with_the_right_groups() {
    let got = launch("pp=2,dp=2,tp=2", |ctx| {
        let tp = ctx.group(Axis::Tp);
        let dp = ctx.group(Axis::Dp);
        let pp = ctx.group(Axis::Pp);
        Ok::<_, CommError>((
            ctx.rank(),
            tp.members().to_vec(),
            dp.members().to_vec(),
            pp.members().to_vec(),
            ctx.group(Axis::Cp).size(),
        ))
    })
    .unwrap();
    for (r, (rank, tp, dp, pp, cp)) in got.into_iter().enumerate() {
        assert_eq!(rank, r);
        assert_eq!(tp, vec![r & !1, r | 1]);
        assert_eq!(dp, vec![r & !2, r | 2]);
        assert_eq!(pp, vec![r & !4, r | 4]);
        assert_eq!(cp, 1);
    }
}

#[test]
fn a_subgroup_over_two_axes_reduces_over_both() {
    let got = launch("dp=2,fsdp=2,tp=2", |ctx| {
        let g = ctx.subgroup(&[Axis::Dp, Axis::Fsdp])?;
        let mut x = [ctx.rank() as u64];
        g.all_reduce(&mut x, ReduceOp::Sum)?;
        Ok::<_, CommError>(x[0])
    })
    .unwrap();
    // tp coordinate 0: ranks 0,2,4,6 -> 12; tp 1: ranks 1,3,5,7 -> 16.
    assert_eq!(got, vec![12, 16, 12, 16, 12, 16, 12, 16]);
}

#[test]
fn a_panicking_rank_is_reported_as_the_cause() {
    let start = Instant::now();
    let err = launch(3, |ctx| {
        if ctx.rank() == 1 {
            panic!("boom on rank one");
        }
        let mut x = [1.0f32];
        ctx.world().all_reduce(&mut x, ReduceOp::Sum)?;
        Ok::<_, CommError>(x[0])
    })
    .unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "peers must fail fast, not time out"
    );
    match &err {
        LaunchError::Rank { cause, all } => {
            assert_eq!((cause.rank, cause.panicked), (1, true));
            assert!(cause.message.contains("boom on rank one"));
            assert_eq!(all.len(), 3);
            let peer = err.failure_of(0).unwrap();
            assert!(
                peer.message
                    .contains("rank 1 left the group (panicked: boom on rank one)"),
                "{}",
                peer.message
            );
        }
        other => panic!("{other}"),
    }
}

#[test]
fn a_stalled_rank_is_named_within_the_timeout() {
    let start = Instant::now();
    let err = Launch::new("dp=4")
        .unwrap()
        .timeout(Duration::from_millis(1000))
        .faults(FaultPlan::new().stall_at(3, OpKind::AllReduce, 0, Duration::from_millis(2500)))
        .run(|ctx| {
            let mut x = [1.0f32];
            ctx.group(Axis::Dp).all_reduce(&mut x, ReduceOp::Sum)
        })
        .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(10));
    let msg = err.to_string();
    assert!(
        msg.starts_with("rank 0 failed: all_reduce #0 in group dp[0,1,2,3] timed out"),
        "{msg}"
    );
    assert!(msg.contains("ranks [3] did not arrive"), "{msg}");
}

#[test]
fn a_mesh_that_does_not_parse_fails_before_any_rank_starts() {
    let err = launch("dp=2,xx=2", |_ctx| Ok::<_, CommError>(())).unwrap_err();
    assert!(matches!(err, LaunchError::Mesh(_)));
    assert!(err.to_string().contains("unknown mesh axis `xx`"));
}

#[test]
fn a_rank_error_is_preferred_over_the_failures_it_causes() {
    let err = launch(2, |ctx| {
        if ctx.rank() == 1 {
            return Err("bad batch on rank one".to_string().into());
        }
        ctx.world()
            .barrier()
            .map_err(flashover_runtime::RankError::from)
    })
    .map(|_: Vec<()>| ())
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "rank 1 failed: bad batch on rank one (2 ranks failed in all)"
    );
}

#[test]
fn failing_ranks_write_flight_records_that_name_the_rank_everyone_waited_for() {
    let dir = std::env::temp_dir().join(format!("flashover-flight-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let err = Launch::new("dp=4")
        .unwrap()
        .timeout(Duration::from_millis(2000))
        .flight_dir(&dir)
        .run(|ctx| {
            let dp = ctx.group(Axis::Dp);
            let mut x = [1.0f32];
            dp.all_reduce(&mut x, ReduceOp::Sum)?;
            if ctx.rank() == 3 {
                panic!("rank 3 dies between two collectives");
            }
            dp.all_reduce(&mut x, ReduceOp::Sum)
        })
        .unwrap_err();
    assert!(err.to_string().contains("[flight record: "), "{err}");
    let dumps = flashover_comm::read_dumps(&dir).unwrap();
    assert_eq!(dumps.len(), 4, "every failing rank writes its record");
    let findings = flashover_comm::diagnose(&dumps);
    assert_eq!(findings.len(), 3, "{findings:#?}");
    for line in &findings {
        assert!(line.contains("at #1 all_reduce"), "{line}");
        assert!(
            line.contains("waiting for rank 3 (last at #0 all_reduce, done)"),
            "{line}"
        );
    }
    // A process that died writes nothing: the others' records still name it.
    std::fs::remove_file(dir.join("flight-rank3.json")).unwrap();
    let findings = flashover_comm::diagnose(&flashover_comm::read_dumps(&dir).unwrap());
    assert!(
        findings
            .iter()
            .all(|l| l.contains("waiting for rank 3 (wrote no record: lost)")),
        "{findings:#?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A world of `n` thread-engine communicators handed out by rank, as an engine of its own
/// would build one per rank thread.
fn own_world(n: usize) -> impl Fn(usize) -> flashover_comm::CommResult<flashover_comm::Group> {
    let comms: Vec<std::sync::Mutex<Option<flashover_comm::ThreadComm>>> =
        flashover_comm::ThreadWorld::new(n)
            .build()
            .into_iter()
            .map(|c| std::sync::Mutex::new(Some(c)))
            .collect();
    move |rank| {
        let comm = comms[rank].lock().unwrap().take().expect("joined once");
        Ok(flashover_comm::Group::new(std::sync::Arc::new(comm)))
    }
}

#[test]
fn rank_threads_can_join_worlds_of_their_own_through_the_exchange() {
    let world = own_world(2);
    let launch = Launch::new(2).unwrap().own_worlds(
        move |rank, size, exchange| {
            // Every rank sees every rank's blob, in rank order, before it joins.
            let blobs = exchange(&[rank as u8 * 10]).expect("exchange");
            assert_eq!((size, blobs), (2, vec![vec![0], vec![10]]));
            world(rank)
        },
        |_rank| Ok(burn::tensor::Device::flex()),
    );
    let sums = launch
        .run(|ctx| {
            let mut x = [ctx.rank() as f32 + 1.0];
            ctx.world().all_reduce(&mut x, ReduceOp::Sum)?;
            Ok::<_, CommError>(x[0])
        })
        .unwrap();
    assert_eq!(sums, [3.0, 3.0]);
}

#[test]
fn a_rank_without_its_device_stops_its_peers_at_once_naming_why() {
    let world = own_world(2);
    let started = Instant::now();
    let err = Launch::new(2)
        .unwrap()
        .timeout(Duration::from_secs(60))
        .own_worlds(
            move |rank, _, exchange| {
                exchange(&[0]).map_err(|e| CommError::Engine {
                    engine: "test",
                    detail: e,
                })?;
                world(rank)
            },
            |rank| match rank {
                1 => Err("no GPU 1 on this machine".to_string()),
                _ => Ok(burn::tensor::Device::flex()),
            },
        )
        .run(|_ctx| Ok::<_, CommError>(()))
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "waited for the timeout"
    );
    assert_eq!(
        err.failure_of(1).unwrap().message,
        "no GPU 1 on this machine"
    );
    match &err {
        LaunchError::Rank { cause, .. } => assert_eq!(cause.rank, 1, "{err}"),
        LaunchError::Mesh(_) => unreachable!("{err}"),
    }
    let peer = &err.failure_of(0).unwrap().message;
    assert!(
        peer.contains("rank 1 could not join the world: no GPU 1"),
        "{peer}"
    );
}
