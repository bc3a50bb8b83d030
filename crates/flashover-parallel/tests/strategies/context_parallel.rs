//! Context-parallel attention against whole-sequence causal attention on one rank: outputs and
//! the gradients of queries, keys and values (keys' and values' gradients come home around the
//! ring or through the all-to-alls), for ring attention at cp = 2, 3 and 4 with and without
//! load balancing, all-to-all attention at cp = 2 and 4, with and without dropout.

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Device, Tensor, TensorData};
use flashover_parallel::ParallelError;
use flashover_parallel::context_parallel::{ContextParallel, CpAttention};
use flashover_parallel::dropout::Dropout;
use flashover_parallel::forward_context::ForwardContext;
use flashover_parallel::params::to_f32;
use flashover_runtime::{Axis, launch};

const B: usize = 2;
const H: usize = 4;
const T: usize = 24;
const HD: usize = 4;

fn values(salt: f32) -> Vec<f32> {
    (0..B * H * T * HD)
        .map(|i| ((i as f32 * 0.37 + salt).sin()) * 0.8)
        .collect()
}

/// The rows of a `[B, H, T, HD]` tensor at sequence positions `positions`, as a tensor.
fn rows(all: &[f32], positions: &[usize], device: &Device) -> Tensor<4> {
    let mut out = Vec::with_capacity(B * H * positions.len() * HD);
    for bh in 0..B * H {
        for &p in positions {
            let start = (bh * T + p) * HD;
            out.extend_from_slice(&all[start..start + HD]);
        }
    }
    Tensor::from_data(TensorData::new(out, [B, H, positions.len(), HD]), device)
}

struct Pass {
    out: Vec<f32>,
    grads: [Vec<f32>; 3],
}

/// `(out * w).sum()` through `attend` for the rows at `positions`, and its gradients.
fn pass(
    positions: &[usize],
    attend: impl FnOnce(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>,
    device: &Device,
) -> Pass {
    let [q, k, v] =
        [0.1, 0.5, 0.9].map(|salt| rows(&values(salt), positions, device).require_grad());
    let w = rows(&values(1.3), positions, device);
    let out = attend(q.clone(), k.clone(), v.clone());
    let grads = (out.clone() * w).sum().backward();
    Pass {
        out: to_f32(out),
        grads: [q, k, v].map(|x| to_f32(x.grad(&grads).expect("a gradient"))),
    }
}

/// One rank's causal attention, written out as the reference model computes it.
fn reference(ctx: &ForwardContext, device: &Device) -> Pass {
    let all: Vec<usize> = (0..T).collect();
    pass(
        &all,
        |q, k, v| {
            let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((HD as f64).sqrt());
            let mask = Tensor::<2, Bool>::tril_mask([T, T], 0, device)
                .reshape([1, 1, T, T])
                .expand([B, H, T, T]);
            let probs = ctx.attention(softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3), 0);
            probs.matmul(v)
        },
        device,
    )
}

/// The reference's values at `positions` (rows of `[B, H, T, HD]`).
fn at(all: &[f32], positions: &[usize]) -> Vec<f32> {
    to_f32(rows(all, positions, &Device::flex()))
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale;
    assert!(diff < 1e-5, "{what}: relative difference {diff:e}");
}

fn check(cp: usize, algorithm: CpAttention, load_balanced: bool, dropout: f64) {
    let base = ForwardContext {
        dropout: (dropout > 0.0).then_some(Dropout {
            p: dropout,
            seed: 9,
            step: 1,
        }),
        ..ForwardContext::default()
    };
    let device = Device::flex().autodiff();
    let expected = reference(&base, &device);
    let results = launch(format!("cp={cp}").as_str(), |ctx| {
        let device = Device::flex().autodiff();
        let plan = ContextParallel::new(ctx.group(Axis::Cp), T, algorithm, load_balanced, H)?;
        let fwd = plan.forward_context(base.clone());
        let hook = fwd.core_attention.clone().expect("a context-parallel hook");
        let positions = plan.positions().to_vec();
        let out = pass(
            &positions,
            |q, k, v| hook.0.attend(q, k, v, &fwd, 0),
            &device,
        );
        Ok::<_, ParallelError>((positions, out, plan.work()))
    })
    .unwrap();
    let what = format!("{algorithm:?} cp={cp} balanced={load_balanced} dropout={dropout}");
    for (rank, (positions, got, work)) in results.iter().enumerate() {
        let what = format!("{what} rank {rank}");
        close(
            &got.out,
            &at(&expected.out, positions),
            &format!("{what}: output"),
        );
        for (name, (g, e)) in ["q", "k", "v"]
            .iter()
            .zip(got.grads.iter().zip(&expected.grads))
        {
            close(g, &at(e, positions), &format!("{what}: gradient of {name}"));
        }
        assert!(work.score_elements > 0, "{what}: work is counted");
    }
}

#[test]
fn ring_attention_equals_one_rank_at_cp_2_3_4_with_and_without_load_balancing() {
    for cp in [2, 3, 4] {
        check(cp, CpAttention::Ring, true, 0.0);
    }
    check(3, CpAttention::Ring, false, 0.0);
    check(4, CpAttention::Ring, false, 0.0);
}

#[test]
fn all_to_all_attention_equals_one_rank_at_cp_2_and_4() {
    check(2, CpAttention::AllToAll, true, 0.0);
    check(4, CpAttention::AllToAll, false, 0.0);
}

#[test]
fn dropout_inside_split_attention_drops_what_one_rank_drops() {
    check(2, CpAttention::Ring, true, 0.25);
    check(3, CpAttention::Ring, false, 0.25);
    check(2, CpAttention::AllToAll, true, 0.25);
}

#[test]
fn load_balancing_evens_the_ring_work_and_heads_that_do_not_split_are_refused() {
    let work = |balanced: bool| {
        launch("cp=4", |ctx| {
            let plan =
                ContextParallel::new(ctx.group(Axis::Cp), T, CpAttention::Ring, balanced, H)?;
            let fwd = plan.forward_context(ForwardContext::default());
            let hook = fwd.core_attention.clone().unwrap();
            let device = Device::flex().autodiff();
            pass(
                plan.positions(),
                |q, k, v| hook.0.attend(q, k, v, &fwd, 0),
                &device,
            );
            Ok::<_, ParallelError>(plan.work().score_elements)
        })
        .unwrap()
    };
    let (plain, balanced) = (work(false), work(true));
    assert_eq!(
        plain,
        vec![288, 576, 864, 1152],
        "rank r computes r + 1 blocks"
    );
    assert!(balanced.iter().all(|&w| w == balanced[0]), "{balanced:?}");
    let errors = launch("cp=3", |ctx| {
        ContextParallel::new(ctx.group(Axis::Cp), T, CpAttention::AllToAll, true, H).map(|_| ())
    })
    .unwrap_err();
    assert!(
        errors.to_string().contains("a rank holds 4 heads"),
        "{errors}"
    );
}
