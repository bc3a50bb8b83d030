//! Mixed precision through the training job: bf16 and f16 compute on f32 master weights against
//! the same layout in f32 over 20 steps, bf16 gradient reduction, f16 loss scaling (overflowing
//! steps skipped, the scale backing off and the run recovering), and the layouts and settings
//! that are refused.
//!
//! Tolerances (fp32 reference, 20 steps, tiny model): losses within 2e-3 relative and final
//! parameters within 5e-2 relative (per tensor, max difference over max value) for bf16; the
//! figures measured here are about 5e-4 and 1.5e-2. A reduced-precision run must also differ
//! from f32 (more than 1e-6 in some loss), or the policy did not take effect.

use super::job;
use flashover::train::{TrainConfig, TrainReport, compare, train};
use flashover_parallel::precision::Precision;

const LOSS_TOLERANCE: f64 = 2e-3;
const PARAM_TOLERANCE: f64 = 5e-2;

fn precision_job(mesh: &str, zero: u8) -> TrainConfig {
    let mut c = job(mesh, 8, 2);
    c.run.steps = 20;
    c.parallel.zero = zero;
    c
}

fn run(c: &TrainConfig, what: &str) -> TrainReport {
    train(c, &|_| {}).unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// Trains `c` in f32 and under `setup`'s policy; checks the policy's run tracks f32, differs
/// from it, and still learns. Returns the reduced-precision run.
fn tracks_f32(c: &TrainConfig, what: &str, setup: impl Fn(&mut TrainConfig)) -> TrainReport {
    let full = run(c, &format!("{what} in f32"));
    let mut reduced_cfg = c.clone();
    setup(&mut reduced_cfg);
    let reduced = run(&reduced_cfg, what);
    let cmp = compare(&full, &reduced, PARAM_TOLERANCE);
    assert!(cmp.max_rel_loss_diff <= LOSS_TOLERANCE, "{what}: {cmp}");
    assert!(cmp.max_rel_param_diff <= PARAM_TOLERANCE, "{what}: {cmp}");
    assert!(
        cmp.max_rel_loss_diff > 1e-6,
        "{what}: identical to f32 ({cmp}): the policy did not take effect"
    );
    let (first, last) = (reduced.steps[0].loss, reduced.steps.last().unwrap().loss);
    assert!(last < 0.9 * first, "{what}: loss {first} -> {last}");
    reduced
}

#[test]
fn bf16_compute_tracks_f32_in_every_supported_layout() {
    for (mesh, zero, sp) in [
        ("dp=1", 0, false),
        ("dp=2", 0, false),
        ("dp=4", 1, false),
        ("dp=2", 2, false),
        ("dp=2,tp=2", 0, false),
        ("tp=2", 0, true),
    ] {
        let mut c = precision_job(mesh, zero);
        c.parallel.sequence_parallel = sp;
        let what = format!("bf16 {mesh} zero={zero} sp={sp}");
        tracks_f32(&c, &what, |c| c.precision.param_dtype = Precision::BF16);
    }
}

#[test]
fn bf16_layouts_agree_with_one_bf16_rank() {
    let one = {
        let mut c = precision_job("dp=1", 0);
        c.precision.param_dtype = Precision::BF16;
        run(&c, "bf16 dp=1")
    };
    for (mesh, zero) in [("dp=2", 0), ("dp=2", 2), ("dp=2,tp=2", 0)] {
        let mut c = precision_job(mesh, zero);
        c.precision.param_dtype = Precision::BF16;
        let r = run(&c, mesh);
        let cmp = compare(&one, &r, PARAM_TOLERANCE);
        assert!(cmp.max_rel_loss_diff <= LOSS_TOLERANCE, "{mesh}: {cmp}");
        assert!(cmp.max_rel_param_diff <= PARAM_TOLERANCE, "{mesh}: {cmp}");
    }
}

#[test]
fn bf16_gradient_reduction_rounds_the_buckets_and_stays_close() {
    let c = precision_job("dp=2", 0);
    let f32_wire = run(&c, "dp=2 f32");
    let bf16_wire = tracks_f32(&c, "dp=2 reduce_dtype bf16", |c| {
        c.precision.reduce_dtype = Precision::BF16
    });
    // Same compute, rounded buckets: different from the f32 reduction, not by much.
    let cmp = compare(&f32_wire, &bf16_wire, PARAM_TOLERANCE);
    assert!(cmp.max_rel_loss_diff > 0.0, "{cmp}");
}

#[test]
fn f16_with_a_fixed_loss_scale_tracks_f32() {
    let c = precision_job("dp=2", 0);
    let r = tracks_f32(&c, "f16 scale 1024", |c| {
        c.precision.param_dtype = Precision::F16;
        c.precision.loss_scale = "1024".into();
    });
    assert!(
        r.steps
            .iter()
            .all(|s| s.loss_scale == Some(1024.0) && !s.skipped)
    );
}

#[test]
fn f16_dynamic_loss_scaling_skips_overflowing_steps_backs_off_and_recovers() {
    let mut c = precision_job("dp=2", 2);
    c.precision.param_dtype = Precision::F16;
    c.precision.loss_scale = "dynamic".into();
    // 2^20 overflows f16 (max 65504) in the first backward: steps are skipped, halving the
    // scale each time, until the gradients fit.
    c.precision.initial_loss_scale = (1u64 << 20) as f64;
    c.precision.loss_scale_growth_interval = 5;
    let r = run(&c, "f16 dynamic");
    let scales: Vec<f32> = r.steps.iter().map(|s| s.loss_scale.unwrap()).collect();
    let skipped: Vec<bool> = r.steps.iter().map(|s| s.skipped).collect();
    assert!(skipped[0], "2^20 must overflow: {scales:?}");
    let first_applied = skipped.iter().position(|s| !s).expect("a step applied");
    for (step, scale) in scales.iter().enumerate().take(first_applied + 1) {
        assert_eq!(*scale, (1u64 << (20 - step)) as f32, "{scales:?}");
    }
    assert!(skipped.iter().filter(|&&s| s).count() < 10, "{skipped:?}");
    // Five clean steps in a row double the scale.
    let after = first_applied + 5;
    if after < scales.len() && !skipped[first_applied..after].iter().any(|&s| s) {
        assert_eq!(scales[after], 2.0 * scales[first_applied], "{scales:?}");
    }
    let (first, last) = (r.steps[0].loss, r.steps.last().unwrap().loss);
    assert!(last < 0.9 * first, "loss {first} -> {last}");
    // A step is skipped exactly when its (global) gradient norm overflowed.
    for s in &r.steps {
        assert_eq!(s.skipped, !s.grad_norm.is_finite(), "step {}", s.step);
    }
}

#[test]
fn reduced_precision_is_refused_where_it_does_not_compose_yet() {
    for (mesh, zero, message) in [
        ("dp=2,pp=2", 0, "not with pp=2"),
        ("fsdp=2", 3, "not with ZeRO-3"),
        ("cp=2", 0, "not with cp=2"),
    ] {
        let mut c = precision_job(mesh, zero);
        c.model.tie_embeddings = false;
        c.precision.param_dtype = Precision::BF16;
        let err = train(&c, &|_| {}).unwrap_err();
        assert!(err.contains(message), "{mesh}: {err}");
    }
    let mut c = precision_job("dp=2", 0);
    c.precision.loss_scale = "lots".into();
    let err = train(&c, &|_| {}).unwrap_err();
    assert!(
        err.contains("precision.loss_scale = `lots`: expected auto, none, dynamic or a number"),
        "{err}"
    );
    c.precision.loss_scale = "-2".into();
    let err = train(&c, &|_| {}).unwrap_err();
    assert!(err.contains("loss scale -2 must be a positive"), "{err}");
}

#[test]
fn an_interrupted_f16_run_resumes_with_its_loss_scale_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("flashover-f16-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = precision_job("dp=2", 0);
    c.run.steps = 10;
    c.precision.param_dtype = Precision::F16;
    c.precision.initial_loss_scale = (1u64 << 18) as f64;
    c.precision.loss_scale_growth_interval = 3;
    let whole = run(&c, "f16 uninterrupted");
    let mut first = c.clone();
    first.checkpoint.dir = Some(dir.clone());
    first.checkpoint.save_every = 5;
    first.run.exit_after = Some(5);
    run(&first, "f16 first half");
    let mut second = c.clone();
    second.checkpoint.resume = Some(dir.join("step-00000005"));
    let rest = run(&second, "f16 resumed");
    let _ = std::fs::remove_dir_all(&dir);
    let tail = |r: &[flashover::train::StepRecord]| -> Vec<(u64, Option<f32>, bool)> {
        r.iter()
            .map(|s| (s.loss.to_bits(), s.loss_scale, s.skipped))
            .collect()
    };
    assert_eq!(tail(&whole.steps[5..]), tail(&rest.steps));
    // The scale moved during the first half, so restoring it mattered.
    assert_ne!(rest.steps[0].loss_scale, Some((1u64 << 18) as f32));
}
