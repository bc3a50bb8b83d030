//! The planner: every layout it proposes is valid and uses the whole world; fixed axes are
//! respected (the 64-GPU, tp = 8, pp = 2 exercise leaves dp = 4); layouts that do not fit are
//! dropped, and when nothing fits the result says by how much; the ranking is by estimated
//! throughput.

use flashover_plan::{
    Fixed, Hardware, ModelSpec, PlanRequest, Precision, Recompute, Workload, plan,
};

fn request(world: usize, gpu: &str, model: &str, seq: usize, batch: usize) -> PlanRequest {
    PlanRequest {
        world,
        hardware: Hardware::preset(gpu).unwrap(),
        model: ModelSpec::preset(model).unwrap(),
        workload: Workload {
            seq_len: seq,
            global_batch: batch,
            micro_batch: 1,
        },
        precision: Precision::Mixed,
        fixed: Fixed::default(),
        include_unsupported: true,
    }
}

#[test]
fn every_proposed_layout_is_valid_fits_and_is_ranked() {
    for req in [
        request(64, "h100", "llama-8b", 8192, 512),
        request(16, "a100", "llama-1b", 4096, 64),
        request(128, "h200", "llama-70b", 8192, 256),
    ] {
        let result = plan(&req).unwrap();
        assert!(
            !result.plans.is_empty(),
            "{}: nothing proposed",
            req.model.name
        );
        for p in &result.plans {
            let l = &p.layout;
            assert_eq!(l.world(), req.world, "{}", p.mesh);
            assert!(
                l.problems(&req.model, &req.workload, &req.hardware, req.world)
                    .is_empty(),
                "{}",
                p.mesh
            );
            assert!(l.tp <= req.hardware.devices_per_node, "{}", p.mesh);
            assert!(
                p.memory.total() <= req.hardware.usable_bytes(),
                "{}",
                p.mesh
            );
            assert!(!p.why.is_empty());
        }
        assert!(
            result
                .plans
                .windows(2)
                .all(|w| w[0].tokens_per_s >= w[1].tokens_per_s),
            "ranked by throughput"
        );
    }
}

#[test]
fn sixty_four_gpus_at_tp_8_and_pp_2_leave_dp_4() {
    let mut req = request(64, "h100", "llama-8b", 8192, 512);
    req.fixed = Fixed {
        tp: Some(8),
        pp: Some(2),
        cp: Some(1),
        ..Fixed::default()
    };
    let result = plan(&req).unwrap();
    assert!(!result.plans.is_empty());
    for p in &result.plans {
        assert_eq!((p.layout.tp, p.layout.pp), (8, 2));
        assert_eq!(p.layout.dp * p.layout.fsdp, 4, "{}", p.mesh);
    }
}

#[test]
fn a_model_too_big_for_the_world_yields_no_plan_and_the_smallest_need() {
    let mut req = request(8, "h100", "llama-405b", 8192, 64);
    req.fixed.recompute = Some(Recompute::Full);
    let result = plan(&req).unwrap();
    assert!(result.plans.is_empty());
    assert!(result.too_big > 0);
    // 405B parameters x 16 bytes over 8 devices alone is ~810 GB per device.
    assert!(result.smallest_memory > 700e9, "{}", result.smallest_memory);
}

#[test]
fn memory_shrinks_with_sharding_and_recomputation() {
    let req = request(64, "h100", "llama-70b", 4096, 64);
    let result = plan(&req).unwrap();
    // 70B does not fit with plain DDP on 80 GB devices: every plan shards something.
    for p in &result.plans {
        let l = &p.layout;
        assert!(
            l.tp * l.pp * l.ep > 1 || l.zero >= 1,
            "{} should not fit unsharded",
            p.mesh
        );
    }
}

#[test]
fn invalid_descriptions_are_refused_by_field() {
    let mut req = request(8, "h100", "llama-8b", 4096, 8);
    req.model.heads = 30;
    req.hardware.efficiency = 1.5;
    let e = plan(&req).unwrap_err();
    assert!(
        e.contains("model.heads = 30 does not divide model.hidden = 4096"),
        "{e}"
    );
    assert!(e.contains("hardware.efficiency = 1.5"), "{e}");
}
