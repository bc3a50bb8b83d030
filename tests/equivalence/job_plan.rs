//! A job's `[parallelize]` table in place of the reference model's own plan: other
//! tensor-parallel splits and other fully sharded units, trained against one rank through
//! `verify` (20 steps, clipping on, fp32 within 1e-5), and the rules the job sets up itself
//! refused with the reason.

use super::{TOLERANCE, job};
use flashover::train::{TrainConfig, train, verify};

/// For the equivalence tests' model (d_model 32, 4 heads of 8): attention split over `tp` by
/// whole heads, the MLP and the embedding left whole; each block a fully sharded unit under
/// ZeRO-3, the embedding and final norm whole.
const ATTENTION_ONLY: &str = r#"
[parallelize]
fully_shard = ["blocks"]

[[parallelize.tensor_parallel]]
style = "colwise"
paths = ["blocks.*.attn.wq", "blocks.*.attn.wk", "blocks.*.attn.wv"]
unit = 8

[[parallelize.tensor_parallel]]
style = "rowwise"
paths = ["blocks.*.attn.wo"]
unit = 8
"#;

fn with_table(mesh: &str, zero: u8, table: &str) -> TrainConfig {
    let mut c = job(mesh, 8, 2);
    c.run.steps = 20;
    c.parallel.zero = zero;
    c.parallelize = TrainConfig::from_toml(table).unwrap().parallelize;
    c
}

#[test]
fn a_jobs_parallelize_table_replaces_the_models_plan() {
    for (mesh, zero) in [
        ("tp=2", 0),
        ("dp=2,tp=2", 0),
        ("fsdp=2,tp=2", 3),
        ("fsdp=2", 3),
        // Pipelines run through the plan: its split in the stages, its units per layer.
        ("tp=2,pp=2", 0),
        ("fsdp=2,tp=2,pp=2", 3),
    ] {
        let c = with_table(mesh, zero, ATTENTION_ONLY);
        let (reference, candidate, cmp) = verify(&c, TOLERANCE).unwrap();
        assert!(cmp.pass, "{mesh} zero {zero}: {cmp}");
        assert!(
            reference.steps.iter().any(|s| s.grad_norm > 0.5),
            "clipping must be active in some step for the test to mean anything"
        );
        // Under a pipeline the table's units shard each stage's blocks over fsdp.
        if mesh == "fsdp=2,tp=2,pp=2" {
            let whole = train(&with_table("tp=2,pp=2", 0, ATTENTION_ONLY), &|_| {}).unwrap();
            let (sharded, whole) = (candidate.memory[0].params, whole.memory[0].params);
            assert!(
                sharded * 4 < whole * 3,
                "{sharded} of {whole} parameter bytes"
            );
        }
        // The table took effect: a rank holds the whole MLP and embedding (2 blocks of
        // 3 x 32 x 64, and 32 x 32), which the model's own plan splits over tp = 2.
        if mesh == "tp=2" {
            let own = train(&job(mesh, 8, 2), &|_| {}).unwrap();
            let extra = (2 * 3 * 32 * 64 + 32 * 32) / 2 * 4;
            assert_eq!(
                candidate.memory[0].params,
                own.memory[0].params + extra,
                "parameter bytes per rank, table against the model's plan"
            );
        }
    }
}

#[test]
fn a_parallelize_table_is_refused_where_the_job_sets_up_the_rule_itself() {
    let cases = [
        (
            "dp=2",
            0,
            "[parallelize]\n[parallelize.pipeline]\nlayers = \"blocks\"\nschedule = \"1f1b\"\nmicro_batches = 2\n",
            "parallelize.pipeline: the job cuts stages",
        ),
        (
            "fsdp=2,pp=2",
            1,
            "[parallelize]\nfully_shard = [\"blocks\"]\n",
            "parallelize.fully_shard: units need parallel.zero = 3, and under a pipeline",
        ),
        (
            "tp=2",
            0,
            "[parallelize]\nsequence_parallel = [\"norm\"]\n",
            "parallelize.sequence_parallel names modules but parallel.sequence_parallel = false",
        ),
        (
            "dp=2",
            0,
            "[parallelize]\n[parallelize.mixed_precision]\nparam_dtype = \"bf16\"\n",
            "parallelize.mixed_precision: the job computes and reduces as its [precision]",
        ),
        (
            "dp=2",
            0,
            "[parallelize]\nreplicate_hot_experts = 1\n",
            "parallelize.replicate_hot_experts: set moe.replicate_hot",
        ),
    ];
    for (mesh, zero, table, expected) in cases {
        let errors = with_table(mesh, zero, table).validate();
        assert!(
            errors.iter().any(|e| e.contains(expected)),
            "{mesh}: {errors:?}"
        );
    }
    // A path that names nothing is found by the job's validation (`flashover config check`),
    // before any rank starts, naming the path.
    let table = "[parallelize]\n[[parallelize.tensor_parallel]]\nstyle = \"colwise\"\npaths = [\"blocks.*.attn.wz\"]\n";
    let errors = with_table("tp=2", 0, table).validate();
    assert!(
        errors
            .iter()
            .any(|e| e.starts_with("parallelize: ") && e.contains("blocks.*.attn.wz")),
        "{errors:?}"
    );
    let err = train(&with_table("tp=2", 0, table), &|_| {}).unwrap_err();
    assert!(err.contains("blocks.*.attn.wz"), "{err}");
    // A rule for a layer that is not linear, on a mixture-of-experts model's narrow twin too.
    let table = "[parallelize]\n[[parallelize.tensor_parallel]]\nstyle = \"rowwise\"\npaths = [\"blocks.*.attn_norm\"]\n";
    let mut moe = with_table("tp=2", 0, table);
    moe.moe.experts = 4;
    moe.moe.top_k = 2;
    let errors = moe.validate();
    assert!(
        errors.iter().any(|e| e.contains("blocks.*.attn_norm")),
        "{errors:?}"
    );
}
