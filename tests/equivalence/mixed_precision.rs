//! Mixed precision through the training job: bf16 and f16 compute on f32 master weights against
//! the same layout in f32 over 20 steps, in every layout (DDP, ZeRO-1/2/3, HSDP, tp, sp, pp,
//! cp, ep, recomputation) and against one bf16 rank; bf16 gradient reduction; f16 loss scaling (overflowing steps
//! skipped, the scale backing off, the run recovering, the scale resumed from a checkpoint);
//! and bad settings refused.
//!
//! Tolerances (f32 reference, 20 steps, tiny model): losses within 2e-3 relative and final
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
fn bf16_compute_tracks_f32_in_every_layout() {
    type Adjust = fn(&mut TrainConfig);
    let layouts: [(&str, u8, Adjust); 13] = [
        ("dp=1", 0, |_| {}),
        ("dp=2", 0, |_| {}),
        ("dp=4", 1, |_| {}),
        ("dp=2", 2, |_| {}),
        ("fsdp=2", 3, |_| {}),
        ("dp=2,fsdp=2", 3, |c| {
            c.parallel.reshard_after_forward = false
        }),
        ("dp=2,tp=2", 0, |_| {}),
        ("tp=2", 0, |c| c.parallel.sequence_parallel = true),
        ("dp=2,pp=2", 0, pipeline),
        ("tp=2,pp=2", 0, pipeline),
        ("cp=2", 0, |_| {}),
        ("cp=2", 0, |c| {
            c.parallel.cp_attention = "all-to-all".parse().unwrap()
        }),
        ("dp=2", 0, |c| {
            c.parallel.activation_checkpointing = "full".parse().unwrap()
        }),
    ];
    for (mesh, zero, adjust) in layouts {
        let mut c = precision_job(mesh, zero);
        adjust(&mut c);
        let what = format!("bf16 {mesh} zero={zero}");
        tracks_f32(&c, &what, |c| c.precision.param_dtype = Precision::BF16);
    }
}

fn pipeline(c: &mut TrainConfig) {
    c.model.n_layers = Some(4);
    c.model.tie_embeddings = false;
    c.run.micro_batches = 4;
}

/// Under bf16 the schedules and recomputation still compute exactly the same thing: bit for
/// bit equal to 1F1B (pipelines) and to no recomputation (a recomputed block, and a ZeRO-3
/// unit resharded after forward).
#[test]
fn under_bf16_schedules_and_recomputation_stay_bitwise_equal() {
    let bf16 = |mesh: &str, adjust: &dyn Fn(&mut TrainConfig)| {
        let mut c = precision_job(mesh, 0);
        c.run.steps = 6;
        c.precision.param_dtype = Precision::BF16;
        adjust(&mut c);
        run(&c, mesh)
    };
    let bits = |r: &TrainReport| -> (Vec<u64>, Vec<Vec<u32>>) {
        (
            r.steps.iter().map(|s| s.loss.to_bits()).collect(),
            r.params
                .iter()
                .map(|(_, v)| v.iter().map(|x| x.to_bits()).collect())
                .collect(),
        )
    };
    let one_f_one_b = bf16("pp=2", &pipeline);
    let zero_bubble = bf16("pp=2", &|c| {
        pipeline(c);
        c.parallel.pp_schedule = "zb-h1".parse().unwrap();
    });
    assert_eq!(bits(&one_f_one_b), bits(&zero_bubble), "zb-h1 vs 1f1b");
    let plain = bf16("dp=2", &|_| {});
    let recomputed = bf16("dp=2", &|c| {
        c.parallel.activation_checkpointing = "full".parse().unwrap()
    });
    assert_eq!(bits(&plain), bits(&recomputed), "recomputation");
    // ZeRO-3 resharding after forward recomputes each block from its stored f32 rows (cast
    // inside the recomputation), so its reduced gradients reach the rows as kept units' do.
    let zero3 = |reshard: bool| {
        let mut c = precision_job("fsdp=2", 3);
        c.run.steps = 6;
        c.precision.param_dtype = Precision::BF16;
        c.parallel.reshard_after_forward = reshard;
        run(&c, &format!("fsdp=2 reshard={reshard}"))
    };
    assert_eq!(bits(&zero3(false)), bits(&zero3(true)), "ZeRO-3 resharding");
}

/// Mixture of experts: routing runs in f32, but the router's input is bf16, so a few routing
/// decisions flip against f32 and the experts' weights drift apart; the loss stays close.
#[test]
fn bf16_mixture_of_experts_tracks_the_f32_loss() {
    for mesh in ["ep=2", "dp=2,ep=2", "ep=2,tp=2"] {
        let mut c = precision_job(mesh, 0);
        c.moe.experts = 4;
        c.moe.replicate_hot = usize::from(mesh == "ep=2");
        let full = run(&c, mesh);
        c.precision.param_dtype = Precision::BF16;
        let reduced = run(&c, mesh);
        let cmp = compare(&full, &reduced, PARAM_TOLERANCE);
        assert!(
            cmp.max_rel_loss_diff <= 2.0 * LOSS_TOLERANCE,
            "{mesh}: {cmp}"
        );
        assert!(cmp.max_rel_loss_diff > 1e-6, "{mesh}: {cmp}");
    }
}

/// `c` (a bf16 job) against the same model on one bf16 rank (a pipeline's is untied and
/// deeper) with none of the layout's parallel settings: within the bf16 bounds.
fn agrees_with_one_bf16_rank(c: &TrainConfig, what: &str) {
    let mut single = c.clone();
    single.parallel.mesh = "dp=1".into();
    single.parallel.zero = 0;
    single.parallel.sequence_parallel = false;
    single.parallel.activation_checkpointing = "none".parse().unwrap();
    let one = run(&single, "bf16 dp=1");
    let r = run(c, &format!("bf16 {what}"));
    let cmp = compare(&one, &r, PARAM_TOLERANCE);
    assert!(cmp.max_rel_loss_diff <= LOSS_TOLERANCE, "{what}: {cmp}");
    assert!(cmp.max_rel_param_diff <= PARAM_TOLERANCE, "{what}: {cmp}");
}

#[test]
fn bf16_layouts_agree_with_one_bf16_rank() {
    type Adjust = fn(&mut TrainConfig);
    let layouts: [(&str, u8, Adjust); 9] = [
        ("dp=2", 0, |_| {}),
        ("dp=2", 2, |_| {}),
        ("dp=2,fsdp=2", 3, |_| {}),
        ("dp=2,tp=2", 0, |_| {}),
        ("tp=2", 0, |c| c.parallel.sequence_parallel = true),
        ("dp=2,pp=2", 0, pipeline),
        ("cp=2", 0, |_| {}),
        ("cp=2", 0, |c| {
            c.parallel.cp_attention = "all-to-all".parse().unwrap()
        }),
        ("dp=2", 0, |c| {
            c.parallel.activation_checkpointing = "full".parse().unwrap()
        }),
    ];
    for (mesh, zero, adjust) in layouts {
        let mut c = precision_job(mesh, zero);
        adjust(&mut c);
        c.precision.param_dtype = Precision::BF16;
        agrees_with_one_bf16_rank(&c, &format!("{mesh} zero={zero}"));
    }
    // Mixture of experts: bf16 inputs can flip near-tied routing decisions between layouts, so
    // the losses are compared (as against f32 below), not the experts' weights.
    for mesh in ["ep=2", "dp=2,ep=2"] {
        let moe = |mesh: &str| {
            let mut c = precision_job(mesh, 0);
            c.moe.experts = 4;
            c.precision.param_dtype = Precision::BF16;
            run(&c, &format!("bf16 moe {mesh}"))
        };
        let cmp = compare(&moe("dp=1"), &moe(mesh), PARAM_TOLERANCE);
        assert!(
            cmp.max_rel_loss_diff <= 2.0 * LOSS_TOLERANCE,
            "{mesh}: {cmp}"
        );
    }
}

#[test]
fn bf16_gradient_reduction_rounds_the_buckets_and_stays_close() {
    // DDP buckets, ZeRO-2's reduce-scatter, and HSDP (reduce-scatter within fsdp, all-reduce
    // over dp), each reducing in bf16 against the same layout reducing in f32.
    for (mesh, zero) in [("dp=2", 0), ("dp=2", 2), ("dp=2,fsdp=2", 3)] {
        let c = precision_job(mesh, zero);
        let what = format!("{mesh} zero={zero} reduce_dtype bf16");
        tracks_f32(&c, &what, |c| c.precision.reduce_dtype = Precision::BF16);
    }
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
fn bad_precision_settings_are_refused_up_front() {
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
    let err = toml::from_str::<TrainConfig>("[precision]\nparam_dtype = \"fp8\"").unwrap_err();
    assert!(err.to_string().contains("unknown variant `fp8`"), "{err}");
}

/// f16 with dynamic loss scaling through ZeRO-3 and a pipeline: the scale backs off from an
/// overflowing start the same way and the runs track f32 once it fits.
#[test]
fn f16_loss_scaling_works_through_zero3_and_pipelines() {
    // Pipelines through the plan: its loss scale, with the job's ZeRO-1 rows and ZeRO-3 units.
    for (mesh, zero) in [
        ("fsdp=2", 3u8),
        ("pp=2", 0),
        ("dp=2,pp=2", 1),
        ("fsdp=2,pp=2", 3),
    ] {
        let mut c = precision_job(mesh, zero);
        if mesh.contains("pp=2") {
            pipeline(&mut c);
        }
        c.precision.param_dtype = Precision::F16;
        c.precision.initial_loss_scale = (1u64 << 20) as f64;
        let r = run(&c, mesh);
        assert!(r.steps[0].skipped, "{mesh}: 2^20 overflows f16");
        let applied = r.steps.iter().filter(|s| !s.skipped).count();
        assert!(applied >= 12, "{mesh}: only {applied} steps applied");
        let (first, last) = (r.steps[0].loss, r.steps.last().unwrap().loss);
        assert!(last < 0.9 * first, "{mesh}: loss {first} -> {last}");
    }
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

/// The composed layouts under bf16 compute agree with one bf16 rank within the bf16 bounds:
/// fully sharded tp shares, sharded pipeline stages, pipelines over cp ranks, ZeRO-1 over tp,
/// the four-axis topology; and mixtures of experts in pipeline stages, over cp sequences and
/// under sequence parallelism (losses, as above: bf16 can flip near-tied routing).
#[test]
fn bf16_composed_layouts_agree_with_one_bf16_rank() {
    for (mesh, zero, untie) in [
        ("fsdp=2,tp=2", 3, false),
        ("fsdp=2,pp=2", 3, true),
        ("pp=2,cp=2", 0, true),
        ("dp=2,tp=2", 1, false),
        ("dp=2,tp=2,pp=2,cp=2", 0, true),
    ] {
        let mut c = precision_job(mesh, zero);
        c.data.seq_len = 24;
        c.model.tie_embeddings = !untie;
        c.precision.param_dtype = Precision::BF16;
        agrees_with_one_bf16_rank(&c, &format!("{mesh} zero={zero}"));
    }
    for (mesh, zero, sp) in [
        ("ep=2,pp=2", 0, false),
        ("fsdp=2,ep=2,cp=2", 3, false),
        ("ep=2,tp=2", 0, true),
    ] {
        let moe = |mesh: &str, zero: u8, sp: bool| {
            let mut c = precision_job(mesh, zero);
            c.data.seq_len = 24;
            c.parallel.sequence_parallel = sp;
            c.moe.experts = 4;
            c.precision.param_dtype = Precision::BF16;
            run(&c, &format!("bf16 moe {mesh}"))
        };
        let cmp = compare(
            &moe("dp=1", 0, false),
            &moe(mesh, zero, sp),
            PARAM_TOLERANCE,
        );
        assert!(
            cmp.max_rel_loss_diff <= 2.0 * LOSS_TOLERANCE,
            "MoE {mesh} zero={zero} sp={sp}: {cmp}"
        );
    }
}
