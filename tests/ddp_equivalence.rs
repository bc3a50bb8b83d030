//! Data parallel equivalence: the same model, data and seed trained on one rank and with DDP
//! must give the same loss and gradient norm at every step and the same final parameters
//! (fp32, 1e-5 relative: the reduction order differs from one rank's, so not bitwise).

use flashover::train::{TrainConfig, compare, train, verify};

const TOLERANCE: f64 = 1e-5;

/// A small job: tiny transformer, 8 steps, clipping tight enough to be active.
fn job(mesh: &str, global_batch: usize, micro_batches: usize) -> TrainConfig {
    let mut c = TrainConfig::default();
    c.model.preset = "tiny".into();
    c.model.d_model = Some(32);
    c.model.n_layers = Some(2);
    c.model.n_heads = Some(4);
    c.model.d_ff = Some(64);
    c.data.vocab = 32;
    c.data.seq_len = 16;
    c.parallel.mesh = mesh.into();
    c.parallel.bucket_mb = 0.01; // several buckets even for a tiny model
    c.parallel.timeout_s = 60.0;
    c.run.steps = 8;
    c.run.global_batch = global_batch;
    c.run.micro_batches = micro_batches;
    c.optim.clip = Some(0.5);
    c.optim.warmup_steps = 2;
    c
}

#[test]
fn ddp_matches_one_rank_at_world_2_3_and_4_with_accumulation_and_clipping() {
    for (mesh, micro) in [("dp=2", 2), ("dp=3", 2), ("dp=4", 3)] {
        let (reference, candidate, cmp) = verify(&job(mesh, 24, micro), TOLERANCE).unwrap();
        assert!(cmp.pass, "{mesh} x {micro} micro-batches: {cmp}");
        assert!(
            candidate.buckets > 1,
            "the test must exercise several buckets"
        );
        assert!(
            reference.steps.iter().any(|s| s.grad_norm > 0.5),
            "clipping must be active in at least one step for this test to mean anything"
        );
        assert!(
            reference.steps.last().unwrap().loss < reference.steps[0].loss,
            "the model must learn"
        );
    }
}

#[test]
fn a_wrong_reduction_is_caught() {
    // Summing gradients where the losses are means scales them by dp x micro-batches. AdamW's
    // update is almost blind to that, so the check must look at the gradient norm too.
    let mut wrong = job("dp=2", 8, 1);
    wrong.parallel.gradient_reduction = "sum".into();
    let (_, _, cmp) = verify(&wrong, TOLERANCE).unwrap();
    assert!(!cmp.pass, "summed gradients must fail verification: {cmp}");
    assert!(
        (cmp.max_rel_grad_norm_diff - 1.0).abs() < 1e-3,
        "norm doubled: {cmp}"
    );
}

#[test]
fn overlapped_and_post_backward_reduction_are_bitwise_identical() {
    let overlapped = train(&job("dp=2", 8, 2), &|_| {}).unwrap();
    let mut after = job("dp=2", 8, 2);
    after.parallel.overlap = false;
    let after = train(&after, &|_| {}).unwrap();
    assert!(overlapped.overlap && !after.overlap);
    let cmp = compare(&after, &overlapped, 0.0);
    assert!(cmp.pass, "{cmp}");
}

#[test]
fn an_invalid_job_fails_before_any_compute_naming_the_fields() {
    let mut c = job("dp=4", 10, 1);
    c.data.seq_len = 0;
    let err = train(&c, &|_| {}).unwrap_err();
    assert!(
        err.contains("run.global_batch = 10 must be a positive multiple of dp (4)"),
        "{err}"
    );
    assert!(err.contains("data.seq_len"), "{err}");
}

#[test]
fn zero1_equals_ddp_bit_for_bit_and_one_rank_within_tolerance() {
    let ddp = train(&job("dp=3", 24, 2), &|_| {}).unwrap();
    let mut sharded = job("dp=3", 24, 2);
    sharded.parallel.zero = 1;
    let zero = train(&sharded, &|_| {}).unwrap();
    let cmp = compare(&ddp, &zero, 0.0);
    assert!(cmp.pass, "ZeRO-1 against DDP: {cmp}");
    let (_, _, cmp) = verify(&sharded, TOLERANCE).unwrap();
    assert!(cmp.pass, "ZeRO-1 against one rank: {cmp}");
}

#[test]
fn unimplemented_zero_stages_are_refused_up_front() {
    let mut c = job("dp=2", 8, 1);
    c.parallel.zero = 3;
    let err = train(&c, &|_| {}).unwrap_err();
    assert!(
        err.contains("parallel.zero = 3: only 0 (DDP) and 1"),
        "{err}"
    );
}
