//! Fault drills: a rank killed under dp, fsdp, tp, pp and a 3-D layout, two killed in a row,
//! one killed while a checkpoint is being written. Each time the job finishes its steps on the
//! survivors, the restart says what happened, no committed checkpoint is lost, and from the
//! resumed step on the losses and final parameters equal those of an uninterrupted run on the
//! new mesh resumed from the same checkpoint, bit for bit.

use super::{Scratch, job, losses};
use flashover::train::{ElasticOptions, KillDrill, Restart, TrainConfig, train, train_elastic};
use std::sync::Mutex;

/// `config` run elastically, killing each `(rank, step)` of `kills`: the final report and the
/// restarts.
fn elastic(
    config: &TrainConfig,
    kills: &[(usize, usize)],
) -> (flashover::train::TrainReport, Vec<Restart>) {
    let mut c = config.clone();
    c.run.kills = kills.iter().map(|&(r, s)| KillDrill::new(r, s)).collect();
    let told = Mutex::new(vec![]);
    let on_restart = |r: &Restart| told.lock().unwrap().push(r.clone());
    let out = train_elastic(&c, ElasticOptions::default(), &|_| {}, &on_restart)
        .unwrap_or_else(|e| panic!("{}: {e}", c.parallel.mesh));
    assert_eq!(
        out.restarts,
        told.into_inner().unwrap(),
        "every restart is told"
    );
    (out.report, out.restarts)
}

/// The job on `mesh` (ZeRO-3 where it has `fsdp`).
fn on(mesh: &str) -> TrainConfig {
    job(mesh, if mesh.contains("fsdp") { 3 } else { 0 }, 1)
}

/// A job saving every 2 steps into `dir`, keeping every checkpoint.
fn saving(mesh: &str, dir: &std::path::Path) -> TrainConfig {
    let mut c = on(mesh);
    c.checkpoint.dir = Some(dir.to_path_buf());
    c.checkpoint.save_every = 2;
    c.checkpoint.keep = 100;
    c
}

/// The uninterrupted run on `mesh` resumed from `dir`'s checkpoint of `step`.
fn resumed(mesh: &str, dir: &std::path::Path, step: usize) -> flashover::train::TrainReport {
    let mut c = on(mesh);
    c.checkpoint.resume = Some(dir.join(flashover_checkpoint::step_dir_name(step as u64)));
    train(&c, &|_| {}).unwrap_or_else(|e| panic!("{mesh} resumed at {step}: {e}"))
}

#[test]
fn a_killed_rank_of_any_layout_continues_on_the_survivors_as_an_uninterrupted_run() {
    // Global batch 12: three survivors of four can share it.
    let cases = [
        ("dp=4", 2, "dp=3"),
        ("fsdp=4", 1, "fsdp=3"),
        ("dp=2,tp=2", 3, "dp=3"),
        ("pp=2,dp=2", 0, "dp=3"),
        ("pp=2,dp=2,tp=2", 5, "dp=3,tp=2"),
    ];
    for (mesh, killed, survivors) in cases {
        let dir = Scratch::new(&format!("elastic-{}", mesh.replace([',', '='], "")));
        let (report, restarts) = elastic(&saving(mesh, &dir.0), &[(killed, 5)]);
        let [restart] = &restarts[..] else {
            panic!("{mesh}: one restart expected: {restarts:?}");
        };
        assert_eq!(restart.failed_rank, killed, "{mesh}: {restart}");
        assert!(
            restart.cause.contains("killed at the start of step 5"),
            "{restart}"
        );
        assert_eq!(
            (restart.old_mesh.as_str(), restart.new_mesh.as_str()),
            (mesh, survivors)
        );
        assert_eq!(
            (restart.completed, restart.resumed_from),
            (5, 4),
            "{mesh}: {restart}"
        );
        // Every committed checkpoint survived: 2 and 4 from the first run, then 6 and 8.
        let steps: Vec<u64> = flashover_checkpoint::committed(&dir.0)
            .unwrap()
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        assert_eq!(steps, [2, 4, 6, 8], "{mesh}");
        let straight = resumed(survivors, &dir.0, 4);
        assert_eq!(
            losses(&report),
            losses(&straight),
            "{mesh} -> {survivors}: losses"
        );
        assert_eq!(
            report.params, straight.params,
            "{mesh} -> {survivors}: parameters"
        );
    }
}

#[test]
fn two_ranks_killed_in_a_row_and_one_killed_while_saving_lose_no_committed_step() {
    let dir = Scratch::new("elastic-twice");
    let (report, restarts) = elastic(&saving("dp=4", &dir.0), &[(1, 3), (0, 6)]);
    let meshes: Vec<(&str, &str)> = restarts
        .iter()
        .map(|r| (r.old_mesh.as_str(), r.new_mesh.as_str()))
        .collect();
    assert_eq!(meshes, [("dp=4", "dp=3"), ("dp=3", "dp=2")]);
    assert_eq!(restarts[1].resumed_from, 6);
    assert_eq!(losses(&report), losses(&resumed("dp=2", &dir.0, 6)));

    // Rank 2 dies after writing its shard of step 4, before the checkpoint is committed:
    // step 4 never appears, the run resumes from step 2 and writes step 4 again.
    let dir = Scratch::new("elastic-saving");
    let mut c = saving("dp=4", &dir.0);
    c.checkpoint.fail_after_write = Some((2, 4));
    let (report, restarts) = elastic(&c, &[]);
    assert_eq!(restarts.len(), 1, "{restarts:?}");
    assert_eq!(restarts[0].resumed_from, 2, "{}", restarts[0]);
    assert_eq!(losses(&report), losses(&resumed("dp=3", &dir.0, 2)));
    let ckpt = flashover_checkpoint::Checkpoint::open(&dir.0.join("step-00000004")).unwrap();
    assert_eq!(ckpt.step(), 4);
}

#[test]
fn a_stalled_rank_is_timed_out_and_the_job_continues_on_the_survivors() {
    let dir = Scratch::new("elastic-stall");
    let mut c = saving("dp=4", &dir.0);
    c.parallel.timeout_s = 1.0;
    c.run.kills = vec![KillDrill::stall(2, 5, std::time::Duration::from_secs(2))];
    let told = Mutex::new(vec![]);
    let on_restart = |r: &Restart| told.lock().unwrap().push(r.clone());
    let out = train_elastic(&c, ElasticOptions::default(), &|_| {}, &on_restart).unwrap();
    let [restart] = &out.restarts[..] else {
        panic!("one restart expected: {:?}", out.restarts);
    };
    // The peers' collective gave up on the stalled rank and says so.
    assert!(restart.cause.contains("timed out"), "{restart}");
    assert!(
        restart.cause.contains('2'),
        "names the stalled rank: {restart}"
    );
    assert_eq!(
        (restart.new_mesh.as_str(), restart.resumed_from),
        ("dp=3", 4)
    );
    assert_eq!(losses(&out.report), losses(&resumed("dp=3", &dir.0, 4)));
}

#[test]
fn an_elastic_run_refuses_what_it_cannot_survive_with_the_reason() {
    let dir = Scratch::new("elastic-refused");
    let mut c = saving("dp=2", &dir.0);
    c.run.kills = vec![KillDrill::new(0, 3)];
    let options = ElasticOptions {
        min_ranks: 2,
        max_restarts: 3,
    };
    let err = train_elastic(&c, options, &|_| {}, &|_| {}).unwrap_err();
    assert!(
        err.contains("1 rank(s) survive, fewer than min_ranks = 2"),
        "{err}"
    );
    let mut c = job("dp=2", 0, 1);
    c.run.kills = vec![KillDrill::new(0, 3)];
    let err = train_elastic(&c, ElasticOptions::default(), &|_| {}, &|_| {}).unwrap_err();
    assert!(err.contains("checkpoint.dir"), "{err}");
}
