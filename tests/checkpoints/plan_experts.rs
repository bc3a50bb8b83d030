//! Checkpoints of a user's mixture-of-experts model under an `expert_parallel` plan: each `ep`
//! rank saves the experts it holds (with their optimizer state), and the run resumes on a
//! layout that holds them otherwise, continuing as the uninterrupted single-rank run does
//! (fp32, 1e-5).

use super::Scratch;
use super::plan::{BATCH, Run, SAVED_AT, STEPS, single_rank_of, span_of};
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover::models::moe::Moe;
use flashover::models::{MoeConfig, SwiGlu};
use flashover::nn::MoeForward;
use flashover::prelude::*;

const VOCAB: usize = 6;
const WIDTH: usize = 8;
const EXPERTS: usize = 4;
const SEQ: usize = 4;

/// An input projection (also the tied output head) around one mixture-of-experts layer.
#[derive(Module, Debug)]
struct MoeNet {
    input: Linear,
    moe: Moe,
}

fn linear(d_in: usize, d_out: usize, salt: f32, device: &Device) -> Linear {
    let values = (0..d_in * d_out)
        .map(|i| ((i as f32 * 12.9898 + salt * 78.233).sin() * 43758.547).fract() - 0.5)
        .collect();
    Linear {
        weight: Param::from_data(TensorData::new(values, [d_in, d_out]), device),
        bias: None,
    }
}

impl MoeNet {
    fn new(device: &Device) -> Self {
        let expert = |e: usize| SwiGlu {
            w_gate: linear(WIDTH, 6, 1.0 + e as f32, device).into(),
            w_up: linear(WIDTH, 6, 1.3 + e as f32, device).into(),
            w_down: linear(6, WIDTH, 1.6 + e as f32, device).into(),
        };
        MoeNet {
            input: linear(VOCAB, WIDTH, 0.3, device),
            moe: Moe {
                router: linear(WIDTH, EXPERTS, 0.5, device),
                experts: (0..EXPERTS).map(expert).collect(),
                shared: None,
                first_expert: 0,
                config: MoeConfig::new(EXPERTS, 2, 6),
                expert_bias: vec![],
            },
        }
    }

    /// Per-position cross-entropy of the tied head, plus the layer's auxiliary loss.
    fn loss(&self, (x, y): &(Tensor<3>, Tensor<2, Int>)) -> Tensor<1> {
        let h = self.input.forward(x.clone());
        let (out, aux) = self.moe.forward(h.clone());
        let [n, t, d] = h.dims();
        let logits = (h + out)
            .reshape([n * t, d])
            .matmul(self.input.weight.val().transpose());
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, y.clone().reshape([n * t]));
        aux.map_or(loss.clone(), |a| loss + a)
    }
}

fn batch(samples: std::ops::Range<usize>, device: &Device) -> (Tensor<3>, Tensor<2, Int>) {
    let n = samples.len();
    let x: Vec<f32> = samples
        .clone()
        .flat_map(|s| (0..SEQ * VOCAB).map(move |f| ((s * 3 + f * 5) as f32 * 0.29).cos()))
        .collect();
    let y: Vec<i64> = samples
        .flat_map(|s| (0..SEQ).map(move |p| ((s * 7 + p * 3 + 1) % VOCAB) as i64))
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [n, SEQ, VOCAB]), device),
        Tensor::from_data(TensorData::new(y, [n, SEQ]), device),
    )
}

fn single_rank() -> Run {
    single_rank_of(MoeNet::new, |model, samples, device| {
        model.loss(&batch(samples, device))
    })
}

/// Steps `steps` under `plan` on `mesh` (see `plan::span_of`).
fn span(
    mesh: &str,
    plan: &ParallelizePlan,
    steps: std::ops::Range<usize>,
    dir: &std::path::Path,
) -> Run {
    span_of(
        mesh,
        plan,
        steps,
        dir,
        MoeNet::new,
        |model, par, step, ctx| {
            let device = ctx.device().clone().autodiff();
            let loss = model.loss(&batch(par.data().batch_share(BATCH, step)?, &device));
            let mean = par.data().mean_loss(loss.clone().into_scalar::<f32>())?;
            Ok((mean, par.gradients(model, loss.backward(), None, ctx)?.0))
        },
    )
}

#[test]
fn an_expert_parallel_checkpoint_resumes_on_another_layout_as_the_uninterrupted_run() {
    let reference = single_rank();
    let experts = ParallelizePlan::new().expert_parallel("moe");
    let plain = ParallelizePlan::new();
    let cases = [
        ("ep=2", &experts, "dp=2", &plain),
        ("dp=2", &plain, "ep=4", &experts),
        (
            "ep=4",
            &experts,
            "fsdp=2,ep=2",
            &experts.clone().fully_shard(""),
        ),
    ];
    for (first_mesh, first, second_mesh, second) in cases {
        let dir = Scratch::new("plan-experts");
        let (head, _) = span(first_mesh, first, 0..SAVED_AT, &dir.0);
        let (tail, weights) = span(second_mesh, second, SAVED_AT..STEPS, &dir.0);
        let losses: Vec<f32> = head.into_iter().chain(tail).collect();
        let l = flashover::check::relative_difference(&reference.0, &losses);
        let w = flashover::check::relative_difference(&reference.1, &weights);
        assert!(
            l < 1e-5 && w < 1e-5,
            "{first_mesh} then {second_mesh}: losses {l:e}, weights {w:e}"
        );
    }
}
