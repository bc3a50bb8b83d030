//! Layout equivalence through the training job: the same model, data and seed trained on one
//! rank and with DDP, ZeRO-1/2/3, HSDP and tensor parallelism (with and without sequence
//! parallelism, with dp) must give the same loss and gradient norm at every
//! step and the same final parameters (fp32, 1e-5 relative: the reduction order differs from
//! one rank's, so not bitwise).

use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover::train::{TrainConfig, compare, memory_formula, train, verify};
use flashover::{Axis, OpKind, launch};
use flashover_models::TransformerConfig;
use flashover_models::transformer;
use flashover_parallel::ParallelError;
use flashover_parallel::context_parallel::CpAttention;
use flashover_parallel::parallelize::{ContextParallelRule, parallelize};
use flashover_parallel::params::flatten_params;

const TOLERANCE: f64 = 1e-5;

#[path = "equivalence/activation_checkpointing.rs"]
mod activation_checkpointing;
#[path = "equivalence/composition.rs"]
mod composition;
#[path = "equivalence/context_parallel.rs"]
mod context_parallel;
#[path = "equivalence/job_plan.rs"]
mod job_plan;
#[path = "equivalence/mixed_precision.rs"]
mod mixed_precision;
#[path = "equivalence/moe.rs"]
mod moe;
#[path = "../crates/flashover-parallel/tests/strategies/plan_loops.rs"]
mod plan_loops;
#[path = "equivalence/recompute_policies.rs"]
mod recompute_policies;
#[path = "equivalence/reference_plan.rs"]
mod reference_plan;

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
    wrong.parallel.gradient_reduction = "sum".parse().unwrap();
    let (_, _, cmp) = verify(&wrong, TOLERANCE).unwrap();
    assert!(!cmp.pass, "summed gradients must fail verification: {cmp}");
    assert!(
        (cmp.max_rel_grad_norm_diff - 1.0).abs() < 1e-3,
        "norm doubled: {cmp}"
    );
    // Pipelines sum as DDP does: through the plan (ZeRO 0) and on their own stages (ZeRO-1).
    let summed = |mesh: &str, zero: u8| {
        let mut c = job(mesh, 8, 2);
        c.model.n_layers = Some(4);
        c.parallel.zero = zero;
        c.parallel.gradient_reduction = "sum".parse().unwrap();
        train(&c, &|_| {}).unwrap()
    };
    let ddp = summed("dp=2", 0);
    for zero in [0, 1] {
        let cmp = compare(&ddp, &summed("dp=2,pp=2", zero), TOLERANCE);
        assert!(
            cmp.pass,
            "dp=2,pp=2 zero {zero} against dp=2, both summed: {cmp}"
        );
    }
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
        err.contains("run.global_batch = 10 must be a positive multiple of the data-parallel ranks dp x fsdp x ep (4)"),
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
fn zero2_zero3_and_hsdp_match_one_rank() {
    let cases = [
        ("dp=3", 2, true),
        ("fsdp=3", 3, true),
        ("fsdp=2", 3, false),
        ("dp=2,fsdp=2", 3, true),
    ];
    for (mesh, zero, reshard) in cases {
        let mut c = job(mesh, 24, 2);
        c.parallel.zero = zero;
        c.parallel.reshard_after_forward = reshard;
        let (_, candidate, cmp) = verify(&c, TOLERANCE).unwrap();
        assert!(cmp.pass, "{mesh} ZeRO-{zero} reshard={reshard}: {cmp}");
        let memory = candidate.memory[0];
        if zero == 3 {
            assert!(memory.gathered_peak > 0, "ZeRO-3 gathers units: {memory:?}");
        }
    }
}

#[test]
fn sharded_memory_shrinks_with_the_stage_and_follows_the_formula() {
    let mut states = vec![];
    for zero in 0..=3 {
        let mesh = if zero == 3 { "fsdp=4" } else { "dp=4" };
        let mut c = job(mesh, 8, 1);
        // Memory is measured in the last step; the second runs in the bucket order adopted
        // after the first.
        c.run.steps = 2;
        c.parallel.zero = zero;
        // Buckets small against the model, so the few in flight stay a small fraction.
        c.parallel.bucket_mb = 0.002;
        let report = train(&c, &|_| {}).unwrap();
        let m = report.memory[0];
        let formula = memory_formula(zero, report.num_params, 4);
        let without_gathered = (m.total() - m.gathered_peak) as f64;
        // ZeRO-2 also holds up to two bucket buffers in flight; the largest bucket here is one
        // 64 x 32 MLP matrix.
        let in_flight = if zero == 2 { 2.0 * 4.0 * 2048.0 } else { 0.0 };
        // ZeRO-1's gradients are what its buckets held at once: the whole gradient when
        // backward ends before the communication thread reduces them, less when buckets are
        // all-reduced to rows during backward (as little as ZeRO-2's rows): which one depends
        // on the threads' timing, so ZeRO-1 is bounded below by ZeRO-2's formula.
        let floor = if zero == 1 {
            memory_formula(2, report.num_params, 4)
        } else {
            formula
        };
        if zero > 0 {
            // Measured state (padding included) within 10% of the formula.
            assert!(
                without_gathered <= formula * 1.10 + in_flight && without_gathered >= floor * 0.9,
                "ZeRO-{zero}: measured {without_gathered} vs formula {formula}: {m:?}"
            );
        }
        if zero == 3 {
            // The root unit, the block computing and the next block prefetched, at most.
            let blocks = report.num_params - 2 * 32 * 32 - 32;
            let largest_unit = 4 * blocks / 2;
            assert!(
                m.gathered_peak <= 4 * (2 * 32 * 32 + 32) + 2 * largest_unit,
                "{m:?}"
            );
        }
        states.push(m.total() - m.gathered_peak);
    }
    assert!(states.windows(2).all(|w| w[1] < w[0]), "{states:?}");
}

#[test]
fn layouts_the_job_cannot_run_are_refused_up_front() {
    let refused = [
        ("dp=2", 4, "parallel.zero = 4: expected 0 (DDP), 1, 2 or 3"),
        ("fsdp=2", 0, "rule `fsdp-needs-zero`"),
        ("dp=2", 3, "ZeRO-3 shards parameters over the fsdp axis"),
        ("cp=2", 3, "rule `zero3-needs-fsdp`"),
        ("ep=2", 0, "rule `ep-needs-experts`"),
        ("tp=3", 0, "model.n_heads = 4 does not divide by tp = 3"),
    ];
    for (mesh, zero, message) in refused {
        let mut c = job(mesh, 8, 1);
        c.parallel.zero = zero;
        let err = train(&c, &|_| {}).unwrap_err();
        assert!(err.contains(message), "{mesh} zero {zero}: {err}");
    }
}

#[test]
fn tensor_parallel_matches_one_rank_with_and_without_sequence_parallel_and_with_dp() {
    let cases = [
        ("tp=2", false, 32),
        ("tp=4", false, 32),
        ("tp=2", true, 32),
        ("tp=4", true, 32),
        ("dp=2,tp=2", false, 32),
        ("dp=2,tp=2", true, 32),
        // A vocabulary that does not divide by tp: padded rows, same results.
        ("tp=4", false, 30),
        ("tp=2", true, 31),
    ];
    for (mesh, sp, vocab) in cases {
        let mut c = job(mesh, 24, 2);
        c.parallel.sequence_parallel = sp;
        c.data.vocab = vocab;
        let (reference, _, cmp) = verify(&c, TOLERANCE).unwrap();
        assert!(cmp.pass, "{mesh} sp={sp} vocab {vocab}: {cmp}");
        assert!(
            reference.steps.iter().any(|s| s.grad_norm > 0.5),
            "clipping must bite"
        );
    }
}

/// (all-reduces, all-gathers, reduce-scatters) on the tp group for one forward and backward of
/// the 2-layer test transformer at tp=2, and with `cp` > 1 on each rank's share of every
/// sequence (ring attention over cp).
fn tp_collectives(sequence_parallel: bool, cp: usize) -> (u64, u64, u64) {
    let counts = launch(format!("tp=2,cp={cp}").as_str(), |ctx| {
        let device = Device::flex().autodiff();
        let config = TransformerConfig::new(32, 32, 2, 4, 64);
        let full = config.init(7, &device);
        let tp = ctx.group(Axis::Tp);
        // The reference model's plan: Megatron's split, sequence parallelism as asked.
        let mut plan = transformer::plan(&config)?;
        if !sequence_parallel {
            plan.sequence_parallel.clear();
        }
        if cp > 1 {
            plan = plan.context_parallel(ContextParallelRule {
                attention: vec![],
                algorithm: CpAttention::Ring,
                load_balance: true,
            });
        }
        let (model, par) = parallelize(full, &plan, &ctx)?;
        let ids = |salt: i64| -> Tensor<2, Int> {
            let v: Vec<i64> = (0..16).map(|i| (i * 7 + salt) % 32).collect();
            Tensor::from_data(TensorData::new(v, [2, 8]), &device)
        };
        // Each rank's share of every sequence under cp (all of it without).
        let fwd = transformer::split_sequences(&par, &model, transformer::forward_context(), 8)?;
        let inputs = par.sequences().share(ids(1), 1)?;
        let targets = par.sequences().share(ids(2), 1)?;
        let before = tp.stats();
        let _ = model.forward_loss(inputs, targets, &fwd).backward();
        let ops = tp.stats().since(&before).ops;
        let calls = |op| ops.get(&op).map_or(0, |s| s.calls);
        Ok::<_, ParallelError>((
            calls(OpKind::AllReduce),
            calls(OpKind::AllGather),
            calls(OpKind::ReduceScatter),
        ))
    })
    .unwrap();
    counts[0]
}

#[test]
fn tensor_parallel_issues_megatrons_collectives_and_no_more() {
    let layers = 2;
    // Without sequence parallelism: 4 all-reduces per block (f and g around attention and the
    // MLP, forward and backward), 1 for the embedding (g), 1 for the head's input (f,
    // backward), 3 in the vocabulary-parallel loss (max, sum of exponentials, target logit).
    assert_eq!(tp_collectives(false, 1), (4 * layers + 5, 0, 0));
    // With it, each block's two all-reduces become all-gather / reduce-scatter pairs forward and
    // backward (4 + 4 per block), the embedding's a reduce-scatter (+ all-gather backward), the
    // head's input an all-gather (+ reduce-scatter backward); the norm weights' gradients are
    // all-reduced (2 per block + the final norm), plus the loss's 3.
    let sequence_parallel = (2 * layers + 1 + 3, 4 * layers + 2, 4 * layers + 2);
    assert_eq!(tp_collectives(true, 1), sequence_parallel);
    // Under context parallelism each rank's share of the sequence is split again over tp:
    // the same collectives, on shorter sequences.
    assert_eq!(tp_collectives(false, 2), (4 * layers + 5, 0, 0));
    assert_eq!(tp_collectives(true, 2), sequence_parallel);
}

#[test]
fn sharding_a_single_rank_model_and_gathering_it_back_is_exact() {
    for tie in [true, false] {
        let out = launch("tp=4", |ctx| {
            let device = Device::flex().autodiff();
            let mut config = TransformerConfig::new(30, 32, 2, 4, 64);
            config.tie_embeddings = tie;
            let full = config.init(3, &device);
            let plan = transformer::plan(&config)?;
            let (local, par) = parallelize(full.clone(), &plan, &ctx)?;
            let back = par.sharded().whole(local)?;
            Ok::<_, ParallelError>((flatten_params(&full), flatten_params(&back)))
        })
        .unwrap();
        for (full, back) in out {
            assert_eq!(full, back, "tie_embeddings = {tie}");
        }
    }
}

#[test]
fn dropout_drops_the_same_elements_in_every_layout() {
    let with_dropout = |mesh: &str, zero: u8, sp: bool| {
        let mut c = job(mesh, 24, 2);
        c.model.dropout = 0.1;
        c.parallel.zero = zero;
        c.parallel.sequence_parallel = sp;
        c
    };
    // Dropout is active: the same job without it trains differently.
    let plain = train(&job("dp=1", 24, 1), &|_| {}).unwrap();
    let dropped = train(&with_dropout("dp=1", 0, false), &|_| {}).unwrap();
    assert!(
        !compare(&plain, &dropped, 1e-3).pass,
        "dropout must change the run"
    );
    // Masks are keyed by the logical tensor: data, tensor (with and without sequence) and
    // fully sharded (recomputing blocks in backward) layouts all match one rank.
    for (mesh, zero, sp) in [
        ("dp=3", 0, false),
        ("dp=2,tp=2", 0, false),
        ("tp=2", 0, true),
        ("fsdp=2", 3, false),
    ] {
        let (_, _, cmp) = verify(&with_dropout(mesh, zero, sp), TOLERANCE).unwrap();
        assert!(cmp.pass, "{mesh} zero {zero} sp {sp}: {cmp}");
    }
}

#[test]
fn pipeline_training_matches_one_rank_for_every_schedule() {
    let pipeline = |mesh: &str, schedule: &str, chunks: usize, micro: usize| {
        let mut c = job(mesh, 24, micro);
        c.model.n_layers = Some(4);
        c.model.tie_embeddings = false;
        c.parallel.pp_schedule = schedule.parse().unwrap();
        c.parallel.pp_chunks = chunks;
        c
    };
    for (mesh, schedule, chunks, micro) in [
        ("pp=2", "gpipe", 1, 3),
        ("pp=2", "1f1b", 1, 4),
        ("pp=4", "1f1b", 1, 4),
        ("pp=3", "zb-h1", 1, 3),
        ("pp=2", "interleaved", 2, 4),
        ("dp=2,pp=2", "1f1b", 1, 3),
        // 3D: data x tensor x pipeline, and tensor x interleaved pipeline.
        ("dp=2,tp=2,pp=2", "1f1b", 1, 3),
        ("tp=2,pp=2", "interleaved", 2, 4),
    ] {
        let (_, _, cmp) = verify(&pipeline(mesh, schedule, chunks, micro), TOLERANCE).unwrap();
        assert!(
            cmp.pass,
            "{mesh} {schedule} x{chunks}, {micro} micro-batches: {cmp}"
        );
    }
    // With sequence parallelism inside the stages.
    let mut sp = pipeline("tp=2,pp=2", "gpipe", 1, 2);
    sp.parallel.sequence_parallel = true;
    let (_, _, cmp) = verify(&sp, TOLERANCE).unwrap();
    assert!(cmp.pass, "tp x pp with sequence parallelism: {cmp}");
    // Stages balanced by estimated cost rather than block count.
    let mut by_cost = pipeline("pp=2", "1f1b", 1, 4);
    by_cost.parallel.pp_split = "cost".into();
    let (_, _, cmp) = verify(&by_cost, TOLERANCE).unwrap();
    assert!(cmp.pass, "cost split: {cmp}");
    // Tied embedding and head: the first and last stages keep their copies equal.
    for (mesh, schedule, chunks) in [("pp=2", "1f1b", 1), ("dp=2,tp=2,pp=2", "interleaved", 2)] {
        let mut tied = pipeline(mesh, schedule, chunks, 4);
        tied.model.tie_embeddings = true;
        let (_, _, cmp) = verify(&tied, TOLERANCE).unwrap();
        assert!(cmp.pass, "tied {mesh} {schedule}: {cmp}");
    }
    let err = train(&pipeline("pp=2", "interleaved", 2, 3), &|_| {}).unwrap_err();
    assert!(
        err.contains("needs micro-batches (3) to be a multiple of pp (2)"),
        "{err}"
    );
}

#[test]
fn a_pipeline_trace_shows_every_rank_and_action() {
    let path = std::env::temp_dir().join(format!("flashover-trace-{}.json", std::process::id()));
    let mut c = job("pp=2", 8, 2);
    c.model.tie_embeddings = false;
    c.run.steps = 2;
    c.run.trace = Some(path.clone());
    train(&c, &|_| {}).unwrap();
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).ok();
    let events = trace["traceEvents"].as_array().unwrap();
    for rank in 0..2 {
        let count = |prefix: &str| {
            events
                .iter()
                .filter(|e| e["tid"] == rank && e["name"].as_str().unwrap().starts_with(prefix))
                .count()
        };
        // Two steps of two micro-batches: four forwards, four backwards, two step spans.
        assert_eq!(
            (count("F"), count("B"), count("step")),
            (4, 4, 2),
            "rank {rank}"
        );
    }
}
