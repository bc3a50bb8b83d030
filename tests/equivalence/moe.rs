//! Expert parallelism through the training job: a mixture-of-experts transformer trained on
//! one rank holding every expert and on `ep` (and `dp x ep`) layouts must give the same loss and
//! gradient norm at every step, the same final parameters and the same tokens per expert (so the
//! same tokens dropped) at every step.

use super::{TOLERANCE, job};
use flashover::train::{TrainConfig, train, verify};
use flashover_models::moe::{DropPolicy, RouterKind};

fn moe_job(mesh: &str, experts: usize, top_k: usize, micro_batches: usize) -> TrainConfig {
    let mut c = job(mesh, 8, micro_batches);
    c.run.steps = 6;
    c.moe.experts = experts;
    c.moe.top_k = top_k;
    c.moe.d_expert = Some(24);
    c.moe.z_loss_coef = 1e-3;
    c
}

#[test]
fn expert_parallel_matches_one_rank_dropless_at_ep_2_and_4_with_dp_and_with_tp() {
    for (mesh, top_k, micro) in [
        ("ep=2", 2, 1),
        ("ep=4", 1, 2),
        ("dp=2,ep=2", 2, 1),
        ("ep=2,tp=2", 2, 1),
    ] {
        let (reference, candidate, cmp) =
            verify(&moe_job(mesh, 4, top_k, micro), TOLERANCE).unwrap();
        assert!(cmp.pass, "{mesh} top-{top_k}: {cmp}");
        assert_eq!(cmp.max_routing_diff, Some(0), "{mesh}");
        let moe = candidate.steps[0].moe.as_ref().unwrap();
        assert_eq!(moe.drop_rate, 0.0, "dropless");
        assert!(moe.a2a_remote_bytes > 0, "{mesh}: tokens must cross ranks");
        let routed: u64 = moe.tokens_per_expert.iter().flatten().sum();
        // Every token of every layer is routed top_k times.
        assert_eq!(routed, (2 * 8 * 16 * top_k) as u64, "{mesh}");
        assert!(
            reference.steps.last().unwrap().loss < reference.steps[0].loss,
            "the model must learn"
        );
    }
}

#[test]
fn capacity_drops_the_same_tokens_as_one_rank_with_either_policy_and_balanced_routing() {
    // Routing is discontinuous in the router's logits, which layouts round differently once
    // their parameters differ in the last bits (after step 1): decisions made by a margin below
    // that can differ (docs/expert_parallel.md). Dropping by position decides on choice and
    // position alone; dropping by probability and Sinkhorn routing compare near-equal values
    // far more often, so they run fewer steps here.
    for (policy, router, sinkhorn, steps) in [
        (DropPolicy::Position, RouterKind::Softmax, 0, 6),
        (DropPolicy::Probability, RouterKind::Sigmoid, 0, 2),
        (DropPolicy::Position, RouterKind::Softmax, 8, 2),
    ] {
        let mut c = moe_job("ep=2", 4, 2, 2);
        c.run.steps = steps;
        c.moe.capacity_factor = Some(0.75);
        c.moe.drop_policy = policy;
        c.moe.router = router;
        c.moe.sinkhorn_iters = sinkhorn;
        c.moe.shared_expert = true;
        let (_, candidate, cmp) = verify(&c, TOLERANCE).unwrap();
        assert!(cmp.pass, "{policy:?}, sinkhorn {sinkhorn}: {cmp}");
        assert_eq!(cmp.max_routing_diff, Some(0));
        let drop = candidate.steps[0].moe.as_ref().unwrap().drop_rate;
        assert!(
            drop > 0.0 && drop < 1.0,
            "capacity 0.75 must drop some assignments: {drop}"
        );
    }
}

/// Without a pipeline the job's own MoE strategy copies the experts; with one, the plan's
/// `replicate_hot_experts` does (ZeRO-3 then by rows, the copies being of whole experts).
#[test]
fn replicating_hot_experts_keeps_the_result_and_cuts_the_traffic() {
    for (mesh, zero, micro) in [
        ("ep=4", 0, 1),
        ("ep=2,pp=2", 0, 2),
        ("fsdp=2,ep=2,pp=2", 3, 2),
    ] {
        let remote_bytes = |hot: usize| {
            let mut c = moe_job(mesh, 4, 2, micro);
            c.parallel.zero = zero;
            c.moe.replicate_hot = hot;
            let (_, candidate, cmp) = verify(&c, TOLERANCE).unwrap();
            assert!(cmp.pass, "{mesh} replicate_hot {hot}: {cmp}");
            assert_eq!(cmp.max_routing_diff, Some(0));
            // Step 0 has no loads to choose from: copies start with step 1.
            candidate.steps[1..]
                .iter()
                .map(|s| s.moe.as_ref().unwrap().a2a_remote_bytes)
                .sum::<u64>()
        };
        let (none, copied) = (remote_bytes(0), remote_bytes(2));
        assert!(
            copied < none,
            "{mesh}: tokens for copied experts stay on their rank: {copied} bytes vs {none}"
        );
    }
}

/// Mean imbalance (max / mean tokens per expert) over steps 6-30 of a 30-step top-1 run at
/// ep=2 with `balance` applied to the job.
fn mean_imbalance(balance: impl Fn(&mut TrainConfig)) -> f64 {
    let mut c = moe_job("ep=2", 4, 1, 1);
    c.run.steps = 30;
    c.optim.lr = 1e-2;
    c.moe.aux_loss_coef = 0.0;
    balance(&mut c);
    let report = train(&c, &|_| {}).unwrap();
    let tail = &report.steps[5..];
    tail.iter()
        .map(|s| s.moe.as_ref().unwrap().imbalance)
        .sum::<f64>()
        / tail.len() as f64
}

#[test]
fn the_load_balancing_loss_reaches_the_router() {
    // With a heavy balancing weight, routing must become more even than without it.
    let free = mean_imbalance(|_| {});
    let balanced = mean_imbalance(|c| c.moe.aux_loss_coef = 1.0);
    assert!(
        balanced < free,
        "imbalance with the loss {balanced} vs without {free}"
    );
}

#[test]
fn balancing_by_routing_bias_matches_one_rank_and_evens_the_load() {
    let mut c = moe_job("ep=2", 4, 1, 1);
    c.moe.aux_loss_coef = 0.0;
    c.moe.bias_update_rate = 0.05;
    let (_, _, cmp) = verify(&c, TOLERANCE).unwrap();
    assert!(cmp.pass, "{cmp}");
    assert_eq!(cmp.max_routing_diff, Some(0));
    // The rate is large next to these small logits' spread: much larger and loads oscillate.
    let free = mean_imbalance(|_| {});
    let biased = mean_imbalance(|c| c.moe.bias_update_rate = 0.01);
    assert!(
        biased < free,
        "imbalance with the bias {biased} vs without {free}"
    );
}

#[test]
fn moe_jobs_that_cannot_run_are_refused_naming_the_fields() {
    let errors = moe_job("ep=4", 6, 2, 1).validate().join("\n");
    assert!(
        errors.contains("moe.experts = 6 does not divide by ep = 4"),
        "{errors}"
    );
    let errors = moe_job("ep=2", 4, 5, 1).validate().join("\n");
    assert!(
        errors.contains("moe.top_k = 5 must be between 1 and moe.experts = 4"),
        "{errors}"
    );
    let mut dense = job("ep=2", 8, 1);
    dense.moe.experts = 0;
    let errors = dense.validate().join("\n");
    assert!(errors.contains("rule `ep-needs-experts`"), "{errors}");
}
