//! Compositions of strategies that each used to be refused, trained against one rank through
//! `verify`: 20 steps, clipping on, two micro-batches, fp32 within 1e-5 (losses, gradient norms
//! and every parameter).

use super::{TOLERANCE, job};
use flashover::train::{TrainConfig, verify};

/// A composition job: the equivalence tests' tiny model, 20 steps, 2 micro-batches per rank.
fn composed(mesh: &str, global_batch: usize) -> TrainConfig {
    let mut c = job(mesh, global_batch, 2);
    c.run.steps = 20;
    c.data.seq_len = 24;
    c
}

fn assert_matches_one_rank(c: &TrainConfig, what: &str) {
    let (reference, _, cmp) = verify(c, TOLERANCE).unwrap();
    assert!(cmp.pass, "{what}: {cmp}");
    assert!(
        reference.steps.iter().any(|s| s.grad_norm > 0.5),
        "{what}: clipping must be active in some step for the test to mean anything"
    );
}

#[test]
fn pipeline_stages_over_context_parallel_sequences_train_as_one_rank() {
    for (mesh, attention, schedule, tied) in [
        ("pp=2,cp=2", "ring", "1f1b", true),
        ("pp=2,cp=2", "all-to-all", "zb-h1", false),
        ("dp=2,pp=2,cp=2", "ring", "gpipe", true),
        ("tp=2,pp=2,cp=2", "ring", "1f1b", false),
    ] {
        let mut c = composed(mesh, 8);
        c.parallel.cp_attention = attention.parse().unwrap();
        c.parallel.pp_schedule = schedule.parse().unwrap();
        c.model.tie_embeddings = tied;
        assert_matches_one_rank(&c, &format!("{mesh} {attention} {schedule} tied={tied}"));
    }
}

#[test]
fn fully_sharded_tensor_parallel_shares_train_as_one_rank() {
    for (mesh, sequence_parallel) in [
        ("fsdp=2,tp=2", false),
        ("fsdp=2,tp=2", true),
        ("dp=2,fsdp=2,tp=2", false),
    ] {
        let mut c = composed(mesh, 8);
        c.parallel.zero = 3;
        c.parallel.sequence_parallel = sequence_parallel;
        assert_matches_one_rank(&c, &format!("{mesh} --zero 3 sp={sequence_parallel}"));
    }
}

#[test]
fn fully_sharded_context_parallel_ranks_train_as_one_rank() {
    let mut c = composed("fsdp=2,cp=2", 8);
    c.parallel.zero = 3;
    assert_matches_one_rank(&c, "fsdp=2,cp=2 --zero 3");
}

#[test]
fn sharded_pipeline_stages_train_as_one_rank() {
    for (mesh, zero, tied, schedule) in [
        ("fsdp=2,pp=2", 3, false, "1f1b"),
        ("fsdp=2,pp=2", 3, true, "1f1b"),
        ("dp=2,fsdp=2,pp=2", 3, true, "gpipe"),
        ("tp=2,pp=2", 1, true, "1f1b"),
        ("dp=2,tp=2,pp=2", 1, false, "1f1b"),
        ("dp=2,pp=2", 2, true, "zb-h1"),
        ("fsdp=2,tp=2,pp=2", 3, true, "1f1b"),
        ("tp=2,pp=2", 0, false, "zb-h1"),
        ("dp=2,tp=2,pp=2", 1, true, "zb-h1"),
    ] {
        let mut c = composed(mesh, 8);
        c.parallel.zero = zero;
        c.parallel.pp_schedule = schedule.parse().unwrap();
        c.model.tie_embeddings = tied;
        assert_matches_one_rank(&c, &format!("{mesh} --zero {zero} tied={tied} {schedule}"));
    }
}

#[test]
fn fully_sharded_pipeline_stages_over_context_parallel_sequences_train_as_one_rank() {
    let mut c = composed("fsdp=2,pp=2,cp=2", 8);
    c.parallel.zero = 3;
    assert_matches_one_rank(&c, "fsdp=2,pp=2,cp=2 --zero 3");
}

/// The seed's topology scaled down (data x tensor x pipeline x context, with and without
/// sequence parallelism), the same with fully sharded data parallelism, and HSDP x TP x PP:
/// four mesh axes at once, sixteen ranks; and all five dense axes, 32 ranks.
#[test]
fn four_and_five_axis_layouts_train_as_one_rank() {
    for (mesh, zero, sp) in [
        ("dp=2,tp=2,pp=2,cp=2", 0, false),
        ("dp=2,tp=2,pp=2,cp=2", 0, true),
        ("fsdp=2,tp=2,pp=2,cp=2", 3, false),
        ("dp=2,fsdp=2,tp=2,pp=2", 3, false),
        ("dp=2,fsdp=2,tp=2,pp=2,cp=2", 3, true),
    ] {
        let mut c = composed(mesh, 8);
        c.parallel.zero = zero;
        c.parallel.sequence_parallel = sp;
        c.run.steps = 10;
        c.model.tie_embeddings = false;
        assert_matches_one_rank(&c, &format!("{mesh} --zero {zero} sp={sp}"));
    }
}

/// Mixtures of experts with sharded optimizer state or parameters: expert gradients summed over
/// their dp replicas, the rest over dp x ep, each rank stepping its own rows.
#[test]
fn sharded_mixtures_of_experts_train_as_one_rank() {
    for (mesh, zero) in [
        ("dp=2,ep=2", 1),
        ("dp=2,ep=2", 2),
        ("fsdp=2,ep=2", 3),
        ("fsdp=2,ep=2,tp=2", 3),
        // Four axes: HSDP over the non-expert weights, experts over ep, tp shares.
        ("dp=2,fsdp=2,ep=2,tp=2", 3),
    ] {
        let mut c = composed(mesh, 16);
        c.parallel.zero = zero;
        c.moe.experts = 4;
        c.moe.top_k = 2;
        c.moe.d_expert = Some(24);
        c.moe.z_loss_coef = 1e-3;
        let (reference, _, cmp) = verify(&c, TOLERANCE).unwrap();
        assert!(cmp.pass, "MoE {mesh} --zero {zero}: {cmp}");
        assert_eq!(cmp.max_routing_diff, Some(0), "MoE {mesh} --zero {zero}");
        assert!(
            reference.steps.iter().any(|s| s.grad_norm > 0.5),
            "clipping active"
        );
    }
}

/// Activation checkpointing inside the new compositions: recomputed blocks train as one rank.
#[test]
fn recomputation_inside_composed_layouts_trains_as_one_rank() {
    for (mesh, zero, policy) in [
        ("fsdp=2,tp=2", 3, "full"),
        ("fsdp=2,pp=2", 3, "every:2"),
        ("pp=2,cp=2", 0, "selective"),
        ("dp=2,tp=2,pp=2", 1, "full"),
    ] {
        let mut c = composed(mesh, 8);
        c.parallel.zero = zero;
        c.parallel.activation_checkpointing = policy.parse().unwrap();
        c.parallel.reshard_after_forward = false;
        let (_, candidate, cmp) = verify(&c, TOLERANCE).unwrap();
        assert!(cmp.pass, "{mesh} --zero {zero} {policy}: {cmp}");
        if policy != "selective" {
            assert!(
                candidate.steps.iter().all(|s| s.recomputed_blocks > 0),
                "{mesh} {policy}: blocks must be recomputed"
            );
        }
    }
}

/// Each rank of a ZeRO-3 layout holds a shard of the parameters, not a replica: the report's
/// parameter bytes per rank are below the whole model's, and parameters are gathered for use
/// (which replicated layouts, tensor-parallel ones included, never report).
#[test]
fn fully_sharded_layouts_hold_shards_not_replicas() {
    for mesh in [
        "fsdp=2,tp=2",
        "dp=2,fsdp=2,tp=2",
        "fsdp=2,cp=2",
        "fsdp=2,pp=2",
    ] {
        let mut c = composed(mesh, 8);
        c.parallel.zero = 3;
        c.run.steps = 2;
        let report = flashover::train::train(&c, &|_| {}).unwrap();
        let whole = report.num_params * 4;
        for rank in &report.steps[1].ranks {
            assert!(
                rank.memory.params < whole,
                "{mesh}: rank {} holds {} parameter bytes of {whole}",
                rank.rank,
                rank.memory.params
            );
            assert!(rank.memory.gathered_peak > 0, "{mesh}: nothing gathered");
        }
    }
}

/// ZeRO-1/2 over tensor-parallel shares without pipelines: the bucketed all-reduce stays, the
/// AdamW state is cut by rows of each share.
#[test]
fn sharded_optimizer_state_over_tensor_parallel_shares_trains_as_one_rank() {
    for (mesh, zero) in [("dp=2,tp=2", 1), ("dp=2,tp=2", 2), ("dp=2,tp=2,cp=2", 1)] {
        let mut c = composed(mesh, 8);
        c.parallel.zero = zero;
        let (_, candidate, cmp) = verify(&c, TOLERANCE).unwrap();
        assert!(cmp.pass, "{mesh} --zero {zero}: {cmp}");
        // Each rank holds its rows' moments, not the share's.
        let replicated = flashover::train::train(&composed(mesh, 8), &|_| {}).unwrap();
        let (sharded, whole) = (
            candidate.steps[0].ranks[0].memory.optimizer,
            replicated.steps[0].ranks[0].memory.optimizer,
        );
        assert!(sharded * 2 <= whole + 64, "{mesh}: {sharded} vs {whole}");
    }
}

/// Mixtures of experts under sequence parallelism: the tokens are gathered over tp before the
/// MoE layer (routing is per whole sequence) and each rank keeps its positions of the output,
/// with cp, pipelines and ZeRO-3 too; capacity 1.0, so the drops must be one rank's.
#[test]
fn mixtures_of_experts_under_sequence_parallelism_train_as_one_rank() {
    for (mesh, zero) in [
        ("tp=2", 0),
        ("ep=2,tp=2", 1),
        ("tp=2,cp=2", 0),
        ("fsdp=2,tp=2,pp=2", 3),
    ] {
        let mut c = composed(mesh, 8);
        c.parallel.zero = zero;
        c.parallel.sequence_parallel = true;
        c.moe.experts = 4;
        c.moe.top_k = 2;
        c.moe.d_expert = Some(24);
        c.moe.capacity_factor = Some(1.0);
        let what = format!("MoE {mesh} --zero {zero} --sequence-parallel");
        let (_, _, cmp) = verify(&c, TOLERANCE).unwrap();
        assert!(cmp.pass, "{what}: {cmp}");
        assert_eq!(cmp.max_routing_diff, Some(0), "{what}");
    }
}

/// Mixtures of experts in pipeline stages: each stage's routers' auxiliary losses join that
/// stage's backward, routing statistics are summed over the stages, experts over ep inside
/// each stage, with ZeRO rows and tp shares; the routing biases (one table on every rank) move
/// as one rank's do; hot experts copied to every ep rank send their gradients home.
#[test]
fn mixtures_of_experts_in_pipeline_stages_train_as_one_rank() {
    for (mesh, zero, schedule, tied) in [
        ("ep=2,pp=2", 0, "1f1b", true),
        ("ep=4,pp=2", 1, "zb-h1", false),
        ("fsdp=2,ep=2,pp=2", 3, "1f1b", false),
        ("dp=2,ep=2,pp=2", 1, "zb-h1", false),
        ("ep=2,tp=2,pp=2", 0, "interleaved", true),
        // Four axes, 16 ranks: experts over ep, stages over pp, sequences over cp; and five,
        // 32 ranks, with tp shares.
        ("fsdp=2,ep=2,pp=2,cp=2", 3, "1f1b", false),
        ("fsdp=2,ep=2,tp=2,pp=2,cp=2", 3, "1f1b", false),
    ] {
        let mut c = composed(mesh, 8);
        c.parallel.zero = zero;
        c.parallel.pp_schedule = schedule.parse().unwrap();
        c.model.n_layers = Some(4);
        c.model.tie_embeddings = tied;
        c.moe.experts = 4;
        c.moe.top_k = 2;
        c.moe.d_expert = Some(24);
        c.moe.z_loss_coef = 1e-3;
        c.moe.capacity_factor = Some(1.25);
        c.moe.bias_update_rate = 1e-3;
        c.moe.replicate_hot = usize::from(mesh.starts_with("ep=4"));
        let what = format!("MoE {mesh} --zero {zero} {schedule} tied={tied}");
        let (reference, candidate, cmp) = verify(&c, TOLERANCE).unwrap();
        assert!(cmp.pass, "{what}: {cmp}");
        assert_eq!(cmp.max_routing_diff, Some(0), "{what}");
        assert!(
            reference.steps.iter().any(|s| s.grad_norm > 0.5),
            "{what}: clipping must be active"
        );
        // The routing record covers every layer, summed over the stages.
        let record = candidate.steps[0].moe.as_ref().expect("a routing record");
        assert_eq!(record.tokens_per_expert.len(), 4, "{what}");
        assert!(record.aux_loss > 0.0, "{what}");
        // Tokens crossed between ep ranks, and the record counts them.
        assert!(record.a2a_remote_bytes > 0, "{what}: no token rows counted");
    }
}

/// Every layout the rule table accepts that combines `n` of its features (each at degree 2),
/// once each: features that only repeat another's effect (tp under sp, pp under a schedule,
/// dp under ZeRO-1/2, MoE under ep) give a layout already listed, and two ZeRO stages or two
/// schedules are one setting twice.
fn accepted_layouts(n: usize) -> Vec<(String, flashover::plan::Layout, bool)> {
    use flashover::plan::rules::{Feature, layout_with, refusals};
    fn choose(from: &[Feature], n: usize) -> Vec<Vec<Feature>> {
        match (n, from.split_first()) {
            (0, _) => vec![vec![]],
            (_, None) => vec![],
            (_, Some((first, rest))) => {
                let mut with: Vec<Vec<Feature>> = choose(rest, n - 1);
                with.iter_mut().for_each(|c| c.insert(0, *first));
                with.extend(choose(rest, n));
                with
            }
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut layouts = vec![];
    for features in choose(&Feature::ALL, n) {
        let exclusive = features
            .iter()
            .any(|a| features.iter().any(|b| a.exclusive(*b)));
        if exclusive {
            continue;
        }
        let (layout, experts) = layout_with(&features);
        let key = format!("{layout} experts={experts}");
        if refusals(&layout, experts).is_empty() && seen.insert(key) {
            layouts.push((format!("{features:?}: {layout}"), layout, experts));
        }
    }
    layouts
}

/// The job that trains `layout` in the generated matrix tests: tiny model, 3 steps, 2
/// micro-batches of at least 2 samples per data-parallel rank.
fn matrix_job(layout: &flashover::plan::Layout, experts: bool) -> TrainConfig {
    let data_ranks = layout.dp * layout.fsdp * layout.ep;
    let mut c = composed("dp=1", 4 * data_ranks.max(2));
    let layout = flashover::plan::Layout {
        micro_batch: c.run.global_batch / data_ranks.max(1) / c.run.micro_batches,
        ..layout.clone()
    };
    flashover::plan::apply_layout(&mut c, &layout);
    c.run.steps = 3;
    // Interleaving needs a block for each of its 2 x 2 virtual stages.
    c.model.n_layers = Some(4);
    if experts {
        c.moe.experts = 4;
        c.moe.top_k = 2;
        c.moe.d_expert = Some(24);
    }
    c
}

/// `layout` against one rank in fp32.
fn layout_trains_as_one_rank(what: &str, layout: &flashover::plan::Layout, experts: bool) {
    let c = matrix_job(layout, experts);
    let (_, _, cmp) = verify(&c, TOLERANCE).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(cmp.pass, "{what}: {cmp}");
}

/// Every cell of `docs/composition.md` that says `yes` is a claim: each pair of strategies the
/// rule table accepts trains as one rank does (a few steps, tiny model, up to 4 rank threads).
#[test]
fn every_pair_the_rule_table_accepts_trains_as_one_rank() {
    let pairs = accepted_layouts(2);
    for (what, layout, experts) in &pairs {
        layout_trains_as_one_rank(what, layout, *experts);
    }
    eprintln!("{} pairs train as one rank", pairs.len());
    assert!(pairs.len() >= 40, "only {} pairs checked", pairs.len());
}

/// The same for every triple (up to 8 rank threads): composition bugs that need three
/// strategies at once (a reduction over the wrong group only when two data axes and a split
/// meet) show here.
#[test]
fn every_triple_the_rule_table_accepts_trains_as_one_rank() {
    let pairs: Vec<String> = accepted_layouts(2)
        .into_iter()
        .map(|(_, l, e)| format!("{l}{e}"))
        .collect();
    let triples: Vec<_> = accepted_layouts(3)
        .into_iter()
        .filter(|(_, l, e)| !pairs.contains(&format!("{l}{e}")))
        .collect();
    for (what, layout, experts) in &triples {
        layout_trains_as_one_rank(what, layout, *experts);
    }
    eprintln!("{} triples train as one rank", triples.len());
    assert!(
        triples.len() >= 60,
        "only {} triples checked",
        triples.len()
    );
}

/// Every pair again in reduced precision on f32 master weights, against one rank in the same
/// precision: bf16, and f16 with a fixed loss scale of 1024 (no step skipped, so the layouts
/// take the same steps). Losses within 2e-4 and gradient norms within 4e-3 (measured at most
/// 2.6e-5 and 8.6e-4 over the 74 pairs in bf16). A wrong forward moves the loss; a reduction
/// over the wrong group or with the wrong scale moves the gradient norm (Adam would hide a
/// scale in the weights). Parameters are not compared: in Adam's first steps every weight moves
/// by about the learning rate whatever its gradient's size, so rounding that flips a near-zero
/// gradient's sign moves that weight by twice the rate (in bf16 up to 5e-2 of the largest
/// weight here, 1.9e-1 with experts, whose routing it also flips); `mixed_precision.rs` bounds
/// parameters over 20 steps.
#[test]
fn every_pair_the_rule_table_accepts_trains_as_one_rank_in_bf16_and_f16() {
    use flashover_parallel::precision::Precision;
    let pairs = accepted_layouts(2);
    for (precision, scale) in [(Precision::BF16, "none"), (Precision::F16, "1024")] {
        let (mut worst_loss, mut worst_norm) = (0f64, 0f64);
        for (what, layout, experts) in &pairs {
            let what = format!("{precision:?} {what}");
            let mut c = matrix_job(layout, *experts);
            c.precision.param_dtype = precision;
            c.precision.loss_scale = scale.into();
            let (_, run, cmp) = verify(&c, 5e-2).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(
                cmp.max_rel_loss_diff <= 2e-4 && cmp.max_rel_grad_norm_diff <= 4e-3,
                "{what}: {cmp}"
            );
            assert!(
                run.steps.iter().all(|s| !s.skipped),
                "{what}: a step overflowed"
            );
            worst_loss = worst_loss.max(cmp.max_rel_loss_diff);
            worst_norm = worst_norm.max(cmp.max_rel_grad_norm_diff);
        }
        eprintln!(
            "{} pairs train as one {precision:?} rank: losses within {worst_loss:.1e}, gradient norms within {worst_norm:.1e}",
            pairs.len()
        );
    }
}
