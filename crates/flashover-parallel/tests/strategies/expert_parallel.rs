//! The expert-parallel MoE layer against one rank holding every expert: outputs, input
//! gradients and every parameter's gradient, dropless and with capacity, top-1 and top-2; a
//! router that sends every token to one expert; expert counts that do not divide.

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{Device, Tensor, TensorData};
use flashover_parallel::ParallelError;
use flashover_parallel::expert_parallel::{ExpertParallel, expert_slots};
use flashover_parallel::forward_context::ForwardContext;
use flashover_parallel::moe::{
    DropPolicy, ExpertDispatch, LocalExperts, Moe, MoeConfig, MoeHook, SwiGlu,
};
use flashover_parallel::params::to_f32;
use flashover_runtime::{Axis, CommunicatorExt, ReduceOp, launch};

const D: usize = 8;
const SEQ: usize = 6;
const BATCH: usize = 4;

fn values(n: usize, salt: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 * 0.37 + salt).sin()) * 0.5)
        .collect()
}

fn linear(d_in: usize, d_out: usize, salt: f32, scale: f32, device: &Device) -> Linear {
    let w = values(d_in * d_out, salt)
        .iter()
        .map(|v| v * scale)
        .collect();
    Linear {
        weight: Param::from_data(TensorData::new(w, [d_in, d_out]), device),
        bias: None,
    }
}

/// Experts `experts` of a layer whose expert `x` is seeded by `x` (the same on every rank).
fn layer(config: &MoeConfig, experts: std::ops::Range<usize>, router: f32, device: &Device) -> Moe {
    let f = config.d_expert;
    let expert = |x: usize| SwiGlu {
        w_gate: linear(D, f, x as f32, 1.0, device).into(),
        w_up: linear(D, f, x as f32 + 0.5, 1.0, device).into(),
        w_down: linear(f, D, x as f32 + 0.25, 1.0, device).into(),
    };
    Moe {
        router: linear(D, config.n_experts, 7.0, router, device),
        experts: experts.clone().map(expert).collect(),
        shared: None,
        first_expert: experts.start,
        config: config.clone(),
        expert_bias: vec![],
    }
}

/// Output, input gradient, router gradient and every held expert's `w_gate` gradient of
/// `samples` of the batch through `moe`, with `(y * y).sum()` as the loss.
struct Pass {
    y: Vec<f32>,
    gx: Vec<f32>,
    g_router: Vec<f32>,
    g_experts: Vec<Vec<f32>>,
    kept: Vec<u64>,
    routed: Vec<u64>,
}

fn pass(
    moe: &Moe,
    samples: std::ops::Range<usize>,
    dispatch: &dyn ExpertDispatch,
    device: &Device,
) -> Pass {
    let hook = MoeHook::new();
    let all = values(BATCH * SEQ * D, 0.11);
    let rows = &all[samples.start * SEQ * D..samples.end * SEQ * D];
    let x = Tensor::<3>::from_data(
        TensorData::new(rows.to_vec(), [samples.len(), SEQ, D]),
        device,
    )
    .require_grad();
    let ctx = ForwardContext {
        moe: Some(hook.clone()),
        ..ForwardContext::default()
    };
    let y = moe.forward_dispatched(x.clone(), &ctx, 0, dispatch);
    let grads = (y.clone() * y.clone()).sum().backward();
    let stats = hook.take_stats();
    Pass {
        y: to_f32(y),
        gx: to_f32(x.grad(&grads).unwrap()),
        g_router: to_f32(moe.router.weight.grad(&grads).unwrap()),
        g_experts: moe
            .experts
            .iter()
            .map(|e| {
                e.w_gate
                    .weight
                    .grad(&grads)
                    .map_or_else(|| vec![0.0; D * moe.config.d_expert], to_f32)
            })
            .collect(),
        kept: stats.kept[0].clone(),
        routed: stats.routed[0].clone(),
    }
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale;
    assert!(diff < 1e-5, "{what}: relative difference {diff:e}");
}

/// Runs `config` on one rank and over `ep` ranks (each with `BATCH / ep` samples) and compares.
fn check(config: &MoeConfig, ep: usize, router_scale: f32) -> Pass {
    let device = Device::flex().autodiff();
    let whole = layer(config, 0..config.n_experts, router_scale, &device);
    let reference = pass(&whole, 0..BATCH, &LocalExperts, &device);
    let results = launch(format!("ep={ep}").as_str(), |ctx| {
        let device = Device::flex().autodiff();
        let group = ctx.group(Axis::Ep);
        let experts = ExpertParallel::new(group, config.n_experts)?;
        let mine = experts.experts_of(group.rank());
        let moe = layer(config, mine.clone(), router_scale, &device);
        let per = BATCH / ep;
        let samples = group.rank() * per..(group.rank() + 1) * per;
        let mut out = pass(&moe, samples, &experts, &device);
        group.all_reduce(&mut out.g_router, ReduceOp::Sum)?;
        group.all_reduce(&mut out.kept, ReduceOp::Sum)?;
        group.all_reduce(&mut out.routed, ReduceOp::Sum)?;
        Ok::<_, ParallelError>((mine, out))
    })
    .unwrap();
    let what = format!("ep={ep} {config:?}");
    let y: Vec<f32> = results.iter().flat_map(|(_, p)| p.y.clone()).collect();
    let gx: Vec<f32> = results.iter().flat_map(|(_, p)| p.gx.clone()).collect();
    close(&y, &reference.y, &format!("{what}: outputs"));
    close(&gx, &reference.gx, &format!("{what}: input gradients"));
    for (mine, p) in &results {
        close(
            &p.g_router,
            &reference.g_router,
            &format!("{what}: router gradient"),
        );
        for (local, global) in mine.clone().enumerate() {
            close(
                &p.g_experts[local],
                &reference.g_experts[global],
                &format!("{what}: expert {global} gradient"),
            );
        }
        assert_eq!(p.kept, reference.kept, "{what}: kept per expert");
        assert_eq!(p.routed, reference.routed, "{what}: routed per expert");
    }
    reference
}

#[test]
fn expert_parallel_matches_one_rank_dropless_and_with_capacity_top1_and_top2() {
    for top_k in [1, 2] {
        for ep in [2, 4] {
            let mut config = MoeConfig::new(4, top_k, 12);
            let dropless = check(&config, ep, 1.0);
            assert_eq!(dropless.kept, dropless.routed, "dropless keeps everything");
            for (policy, sinkhorn) in [
                (DropPolicy::Position, 0),
                (DropPolicy::Probability, 0),
                (DropPolicy::Position, 5),
            ] {
                config.capacity_factor = Some(1.0);
                config.drop_policy = policy;
                config.sinkhorn_iters = sinkhorn;
                let capped = check(&config, ep, 1.0);
                let dropped: u64 =
                    capped.routed.iter().sum::<u64>() - capped.kept.iter().sum::<u64>();
                // Top-k overfills some experts here; balanced routing may fill each exactly.
                assert!(
                    dropped > 0 || sinkhorn > 0,
                    "capacity 1.0 must drop some of these tokens: {capped:?}",
                    capped = capped.kept
                );
            }
        }
    }
}

#[test]
fn a_router_that_sends_every_token_to_one_expert_neither_hangs_nor_miscounts() {
    // A zero router scores every expert the same; ties go to the lowest index: expert 0.
    let mut config = MoeConfig::new(4, 1, 12);
    let all = check(&config, 2, 0.0);
    assert_eq!(all.routed, vec![(BATCH * SEQ) as u64, 0, 0, 0]);
    assert_eq!(all.kept, all.routed);
    config.capacity_factor = Some(1.0);
    let capped = check(&config, 4, 0.0);
    let capacity = config.capacity(SEQ).unwrap() as u64; // 2 per sequence
    assert_eq!(capped.routed, vec![(BATCH * SEQ) as u64, 0, 0, 0]);
    assert_eq!(capped.kept, vec![capacity * BATCH as u64, 0, 0, 0]);
}

#[test]
fn experts_that_do_not_divide_over_ep_are_refused_by_name() {
    let errors = launch("ep=4", |ctx| {
        Ok::<_, ParallelError>(
            ExpertParallel::new(ctx.group(Axis::Ep), 6)
                .unwrap_err()
                .to_string(),
        )
    })
    .unwrap();
    assert!(
        errors[0].contains("6 experts do not divide over the 4 ranks"),
        "{}",
        errors[0]
    );
}

#[test]
fn experts_are_found_by_structure_whatever_the_layer_is_called() {
    #[derive(burn::module::Module, Debug)]
    struct Net {
        ffn: Moe,
        head: Linear,
    }
    let device = Device::flex();
    let net = Net {
        ffn: layer(&MoeConfig::new(4, 2, 12), 0..2, 1.0, &device),
        head: linear(D, 1, 0.3, 1.0, &device),
    };
    // The router, two experts' three weights each, the head.
    let expected = [vec![false], vec![true; 6], vec![false]].concat();
    assert_eq!(expert_slots(&net), expected);
}
