//! Activation checkpointing through the training job: with dropout on, every policy trains
//! exactly as no recomputation does (losses and gradient norms every step, every final
//! parameter, bit for bit), alone and combined with dp x tp, pipelines (including the
//! zero-bubble schedule's deferred weight gradients), ZeRO-3 and context parallelism.

use super::job;
use flashover::train::{TrainConfig, TrainReport, train};

fn recompute_job(mesh: &str, policy: &str) -> TrainConfig {
    let mut c = job(mesh, 8, 2);
    c.run.steps = 4;
    c.model.n_layers = Some(4);
    c.model.tie_embeddings = false;
    c.model.dropout = 0.1;
    c.parallel.activation_checkpointing = policy.parse().unwrap();
    c
}

/// Losses, gradient norms and final parameters as bit patterns.
type Bits = (Vec<u64>, Vec<u64>, Vec<(String, Vec<u32>)>);

fn bits(r: &TrainReport) -> Bits {
    (
        r.steps.iter().map(|s| s.loss.to_bits()).collect(),
        r.steps.iter().map(|s| s.grad_norm.to_bits()).collect(),
        r.params
            .iter()
            .map(|(n, v)| (n.clone(), v.iter().map(|x| x.to_bits()).collect()))
            .collect(),
    )
}

/// Trains `mesh` without recomputation and with each `(policy, blocks recomputed per step on
/// the busiest rank)`; everything must be equal bit for bit, and the blocks really recomputed.
fn same_as_without(mesh: &str, policies: &[(&str, u64)], tweak: &dyn Fn(&mut TrainConfig)) {
    compare_with_plain(mesh, policies, tweak, &|policy, plain, report| {
        let plain = bits(plain);
        let (losses, norms, params) = bits(report);
        assert_eq!(losses, plain.0, "{mesh} {policy}: losses");
        assert_eq!(norms, plain.1, "{mesh} {policy}: gradient norms");
        assert!(params == plain.2, "{mesh} {policy}: parameters differ");
    });
}

/// [`same_as_without`] within `tolerance` (relative) instead of bit for bit: where recomputation
/// adds a gradient's terms in another order.
fn close_to_without(
    mesh: &str,
    policies: &[(&str, u64)],
    tweak: &dyn Fn(&mut TrainConfig),
    tolerance: f64,
) {
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-12);
    compare_with_plain(mesh, policies, tweak, &|policy, plain, report| {
        for (a, b) in report.steps.iter().zip(&plain.steps) {
            assert!(
                rel(a.loss, b.loss) <= tolerance,
                "{mesh} {policy}: loss {a:?} {b:?}"
            );
            let norms = rel(a.grad_norm, b.grad_norm);
            assert!(norms <= tolerance, "{mesh} {policy}: norm {a:?} {b:?}");
        }
        for ((name, a), (_, b)) in report.params.iter().zip(&plain.params) {
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
            let worst = a
                .iter()
                .zip(b)
                .fold(0f64, |m, (x, y)| m.max((x - y).abs() as f64));
            assert!(
                worst <= tolerance * scale,
                "{mesh} {policy}: {name} off by {worst}"
            );
        }
    });
}

/// Trains `mesh` without recomputation and with each `(policy, blocks recomputed per step on
/// the busiest rank)`, checks the blocks really were recomputed, and hands both reports to
/// `check`.
fn compare_with_plain(
    mesh: &str,
    policies: &[(&str, u64)],
    tweak: &dyn Fn(&mut TrainConfig),
    check: &dyn Fn(&str, &TrainReport, &TrainReport),
) {
    let run = |policy: &str| {
        let mut c = recompute_job(mesh, policy);
        tweak(&mut c);
        train(&c, &|_| {}).unwrap_or_else(|e| panic!("{mesh} {policy}: {e}"))
    };
    let plain = run("none");
    for &(policy, recomputed) in policies {
        let report = run(policy);
        assert!(
            report
                .steps
                .iter()
                .all(|s| s.recomputed_blocks == recomputed),
            "{mesh} {policy}: {recomputed} blocks must run again in backward each step, not {:?}",
            report
                .steps
                .iter()
                .map(|s| s.recomputed_blocks)
                .collect::<Vec<_>>()
        );
        check(policy, &plain, &report);
    }
}

#[test]
fn every_policy_trains_bit_for_bit_as_without_recomputation() {
    // 4 blocks, 2 micro-batches per step.
    same_as_without(
        "dp=2",
        &[
            ("full", 8),
            ("every:2", 4),
            ("blocks:1,3", 4),
            ("selective", 0),
        ],
        &|_| {},
    );
}

#[test]
fn recomputation_composes_with_tensor_pipeline_zero3_and_context_parallelism() {
    same_as_without("dp=2,tp=2", &[("full", 8), ("selective", 0)], &|_| {});
    // Each stage holds 2 of the 4 blocks; every:2 counts globally (blocks 0 and 2).
    same_as_without("pp=2", &[("full", 4), ("every:2", 2)], &|c| {
        c.parallel.pp_schedule = "1f1b".parse().unwrap();
    });
    same_as_without("pp=2", &[("full", 4)], &|c| {
        c.parallel.pp_schedule = "zb-h1".parse().unwrap();
    });
    // ZeRO-3 units, kept from forward to backward or resharded after forward (gathered again
    // in backward, nothing recomputed for it): the policy's blocks recompute inside the unit.
    for reshard in [false, true] {
        same_as_without("fsdp=2", &[("full", 8)], &|c| {
            c.parallel.zero = 3;
            c.parallel.reshard_after_forward = reshard;
        });
    }
    same_as_without("cp=2", &[("full", 8), ("selective", 0)], &|c| {
        c.parallel.cp_attention = "ring".parse().unwrap()
    });
}

/// Mixture-of-experts blocks recomputed as a whole: the routers' auxiliary losses leave each
/// recomputed block as a second output, so their gradient reaches the routers and they count
/// once; experts over `ep` run their all-to-alls again in backward. The routers' gradients add
/// the auxiliary terms inside the recomputation, in another order: equal to rounding (fp32).
#[test]
fn recomputed_mixture_of_experts_blocks_train_as_without_recomputation() {
    let moe = |c: &mut TrainConfig| {
        c.moe.experts = 4;
        c.moe.aux_loss_coef = 0.01;
        c.moe.z_loss_coef = 0.001;
    };
    close_to_without("dp=2", &[("full", 8), ("every:2", 4)], &moe, 1e-6);
    close_to_without("ep=2", &[("full", 8)], &moe, 1e-6);
    close_to_without("dp=2,ep=2", &[("full", 8)], &moe, 1e-6);
}

#[test]
fn policies_the_job_cannot_run_are_refused_by_field() {
    let c = recompute_job("dp=2", "blocks:1,7");
    let e = c.validate().join("\n");
    assert!(e.contains("names block 7, but the model has 4"), "{e}");
    let text = "[parallel]\nactivation_checkpointing = \"sometimes\"\n";
    let (_, e) = TrainConfig::from_toml_lenient(text).unwrap();
    assert!(
        e[0].contains("parallel.activation_checkpointing = `sometimes`"),
        "{e:?}"
    );
}
