//! Context parallelism through the training job: sequences split over `cp` (ring or
//! all-to-all attention, load-balanced or contiguous chunks, with dropout) and combined with
//! dp, tp and ZeRO-2 must train as one rank does: the same loss and gradient norm at every step
//! and the same final parameters.

use super::{TOLERANCE, job};
use flashover::train::{TrainConfig, train, verify};

fn cp_job(mesh: &str, attention: &str, load_balance: bool) -> TrainConfig {
    let mut c = job(mesh, 8, 1);
    c.run.steps = 6;
    c.data.seq_len = 24;
    c.parallel.cp_attention = attention.parse().unwrap();
    c.parallel.cp_load_balance = load_balance;
    c
}

#[test]
fn ring_attention_trains_as_one_rank_at_cp_2_3_and_4() {
    for (mesh, balanced, micro) in [
        ("cp=2", true, 1),
        ("cp=3", true, 2),
        ("cp=4", true, 1),
        ("cp=3", false, 1),
    ] {
        let mut c = cp_job(mesh, "ring", balanced);
        c.run.micro_batches = micro;
        let (reference, _, cmp) = verify(&c, TOLERANCE).unwrap();
        assert!(cmp.pass, "{mesh} ring balanced={balanced}: {cmp}");
        assert!(
            reference.steps.last().unwrap().loss < reference.steps[0].loss,
            "the model must learn"
        );
    }
}

#[test]
fn all_to_all_attention_trains_as_one_rank_at_cp_2_3_and_4() {
    for (mesh, balanced, heads) in [("cp=2", true, 4), ("cp=3", true, 6), ("cp=4", false, 4)] {
        let mut c = cp_job(mesh, "all-to-all", balanced);
        // Whole heads per rank: 6 heads of 8 features at cp = 3.
        c.model.n_heads = Some(heads);
        c.model.d_model = Some(8 * heads);
        let (_, _, cmp) = verify(&c, TOLERANCE).unwrap();
        assert!(cmp.pass, "{mesh} all-to-all: {cmp}");
    }
}

#[test]
fn context_parallel_composes_with_dp_tp_sequence_parallel_zero2_and_dropout() {
    for (mesh, attention, zero, dropout, sp) in [
        ("dp=2,cp=2", "ring", 0, 0.1, false),
        ("dp=2,tp=2,cp=2", "ring", 0, 0.0, false),
        ("tp=2,cp=2", "all-to-all", 0, 0.1, false),
        ("dp=2,cp=2", "all-to-all", 2, 0.0, false),
        // Sequence parallelism splits each rank's share of the sequence again over tp.
        ("tp=2,cp=2", "ring", 0, 0.1, true),
        ("dp=2,tp=2,cp=2", "all-to-all", 0, 0.0, true),
    ] {
        let mut c = cp_job(mesh, attention, true);
        c.parallel.zero = zero;
        c.model.dropout = dropout;
        c.parallel.sequence_parallel = sp;
        let (_, _, cmp) = verify(&c, TOLERANCE).unwrap();
        assert!(
            cmp.pass,
            "{mesh} {attention} zero={zero} dropout={dropout} sp={sp}: {cmp}"
        );
    }
}

/// Mixtures of experts over split sequences: every cp rank routes the whole sequences (router
/// logits gathered over cp) and keeps its own tokens' part, so capacity, drops, Sinkhorn
/// balancing and the load-balancing loss are one rank's; with experts over ep, ZeRO-3 and
/// pipelines too.
#[test]
fn mixtures_of_experts_over_context_parallel_sequences_train_as_one_rank() {
    for (mesh, zero, attention, sinkhorn) in [
        ("cp=2", 0, "ring", 0),
        ("ep=2,cp=2", 0, "all-to-all", 3),
        ("fsdp=2,ep=2,cp=2", 3, "ring", 0),
        ("pp=2,cp=2", 1, "ring", 3),
        ("cp=4", 0, "ring", 0),
    ] {
        let mut c = cp_job(mesh, attention, true);
        c.run.micro_batches = 2;
        c.parallel.zero = zero;
        c.moe.experts = 4;
        c.moe.top_k = 2;
        c.moe.d_expert = Some(24);
        c.moe.capacity_factor = Some(1.0);
        c.moe.z_loss_coef = 1e-3;
        c.moe.sinkhorn_iters = sinkhorn;
        c.moe.bias_update_rate = 1e-3;
        let what = format!("MoE {mesh} --zero {zero} {attention} sinkhorn={sinkhorn}");
        let (_, candidate, cmp) = verify(&c, TOLERANCE).unwrap();
        assert!(cmp.pass, "{what}: {cmp}");
        assert_eq!(cmp.max_routing_diff, Some(0), "{what}");
        let record = candidate.steps[0].moe.as_ref().expect("a routing record");
        assert!(record.drop_rate > 0.0, "{what}: capacity 1.0 must drop");
    }
}

#[test]
fn each_rank_reports_its_attention_work_and_balancing_evens_it() {
    let spread = |mesh: &str, balanced: bool| {
        let report = train(&cp_job(mesh, "ring", balanced), &|_| {}).unwrap();
        let work: Vec<u64> = report.steps[0]
            .ranks
            .iter()
            .map(|r| r.attention_scores)
            .collect();
        assert!(work.iter().all(|&w| w > 0), "{work:?}");
        *work.iter().max().unwrap() as f64 / *work.iter().min().unwrap() as f64
    };
    assert_eq!(spread("cp=4", true), 1.0);
    assert_eq!(
        spread("cp=4", false),
        4.0,
        "the last rank computes 4 blocks, the first 1"
    );
    // Pipeline stages attend through the plan's split, which counts the same work.
    assert_eq!(spread("pp=2,cp=2", true), 1.0);
    assert_eq!(
        spread("pp=2,cp=2", false),
        2.0,
        "the second cp rank computes 2 blocks"
    );
}

#[test]
fn layouts_context_parallelism_cannot_run_fail_before_any_compute() {
    let errors = |mut c: TrainConfig, f: &dyn Fn(&mut TrainConfig)| {
        f(&mut c);
        c.validate().join("\n")
    };
    let e = errors(cp_job("cp=4", "ring", true), &|c| c.data.seq_len = 20);
    assert!(
        e.contains("data.seq_len = 20 does not divide by 8") && e.contains("e.g. 24"),
        "{e}"
    );
    let e = errors(cp_job("cp=3", "ring", false), &|c| c.data.seq_len = 20);
    assert!(e.contains("does not divide by 3"), "{e}");
    let e = errors(cp_job("cp=3", "all-to-all", true), &|_| {});
    assert!(
        e.contains("model.n_heads = 4 does not divide by tp x cp = 3"),
        "{e}"
    );
    let (_, e) =
        TrainConfig::from_toml_lenient("[parallel]\nmesh = \"cp=2\"\ncp_attention = \"rings\"\n")
            .unwrap();
    assert!(e[0].contains("parallel.cp_attention = `rings`"), "{e:?}");
    // Sequence parallelism splits each cp rank's share of the sequence again over tp: 18
    // positions cut over cp = 2 (contiguous chunks), but not their 9 over tp = 2.
    let e = errors(cp_job("tp=2,cp=2", "ring", false), &|c| {
        c.parallel.sequence_parallel = true;
        c.data.seq_len = 18;
    });
    assert!(
        e.contains("data.seq_len = 18 does not divide by cp x tp = 4"),
        "{e}"
    );
}
