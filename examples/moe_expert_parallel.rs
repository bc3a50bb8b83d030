//! Expert parallelism in *your own* Burn model: put Flashover's mixture-of-experts layer in it,
//! spread the experts over ranks, and train exactly what one device would.
//!
//! A small regression network with a mixture of four experts (top-2) between two linear layers
//! is trained twice on the same data and seed: on one rank holding every expert with a plain
//! Burn loop, and on four rank threads (`ep=4`), each holding one expert and a quarter of the
//! batch, tokens sent to their expert's rank and back by all-to-all. Losses and weights match
//! (fp32, 1e-5 relative).
//!
//! Run: `cargo run --example moe_expert_parallel`

#[allow(dead_code)] // the shared MLP and its loop are the other examples'
mod common;

use burn::module::Module;
use burn::nn::Linear;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor};
use common::{GLOBAL_BATCH, STEPS, batch, differences, mse};
use flashover::{Axis, CommunicatorExt, ReduceOp, launch};
use flashover_models::moe::{LocalExperts, Moe, MoeConfig, MoeHook};
use flashover_models::{ForwardContext, SwiGlu, init};
use flashover_parallel::expert_parallel::{ExpertParallel, place_experts};
use flashover_parallel::params::{ParamLayout, accumulate_grads};
use flashover_parallel::placement::{GradientReducer, PlacementTable};
use flashover_parallel::precision::Precision;
use flashover_parallel::{FlatAdamWConfig, ModuleAdamW};
use std::ops::Range;
use std::sync::Arc;

const EXPERTS: usize = 4;
const WIDTH: usize = 16;

/// Your model, with a mixture of experts inside. `experts`: which of them this copy holds.
#[derive(Module, Debug)]
struct MoeNet {
    inp: Linear,
    moe: Moe,
    out: Linear,
}

impl MoeNet {
    fn new(experts: Range<usize>, device: &Device) -> Self {
        let config = MoeConfig::new(EXPERTS, 2, 24);
        let expert = |x: usize| {
            let name = |w: &str| format!("experts.{x}.{w}");
            SwiGlu {
                w_gate: init::linear(7, &name("gate"), WIDTH, 24, 0.3, device),
                w_up: init::linear(7, &name("up"), WIDTH, 24, 0.3, device),
                w_down: init::linear(7, &name("down"), 24, WIDTH, 0.3, device),
            }
        };
        MoeNet {
            inp: init::linear(7, "inp", 8, WIDTH, 0.3, device),
            moe: Moe {
                router: init::linear(7, "router", WIDTH, EXPERTS, 0.3, device),
                experts: experts.clone().map(expert).collect(),
                shared: None,
                first_expert: experts.start,
                config,
                expert_bias: vec![],
            },
            out: init::linear(7, "out", WIDTH, 1, 0.3, device),
        }
    }

    /// Each sample is a one-token sequence through a residual MoE block.
    fn forward(&self, x: Tensor<2>, ctx: &ForwardContext) -> Tensor<2> {
        let n = x.dims()[0];
        let h = self.inp.forward(x).reshape([n, 1, WIDTH]);
        let h = h.clone() + self.moe.forward_with(h, ctx, 0);
        self.out.forward(h.reshape([n, WIDTH]))
    }
}

/// Loss with the router's balancing loss, which the layer leaves in the hook.
fn loss(model: &MoeNet, x: Tensor<2>, y: Tensor<2>, hook: &MoeHook) -> (Tensor<1>, f32) {
    let ctx = ForwardContext {
        moe: Some(hook.clone()),
        ..ForwardContext::default()
    };
    let fit = mse(model.forward(x, &ctx), y);
    let value = fit.clone().into_scalar::<f32>();
    match hook.take_aux_loss() {
        Some(aux) => (fit + aux, value),
        None => (fit, value),
    }
}

/// The plain Burn loop on one device, every expert local.
fn train_single() -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let mut model = MoeNet::new(0..EXPERTS, &device);
    let hook = MoeHook::new(Arc::new(LocalExperts));
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
        let (x, y) = batch(step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH, &device);
        let (l, value) = loss(&model, x, y, &hook);
        losses.push(value);
        let grads = GradientsParams::from_grads(l.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    (losses, weights(&model))
}

/// The same with the experts over `ep=4`: the lines marked `+` are what changed.
fn train_expert_parallel() -> (Vec<f32>, Vec<f32>) {
    let results = launch("ep=4", |ctx| {
        let device = Device::flex().autodiff();
        let ep = ctx.group(Axis::Ep);
        let experts = ExpertParallel::new(ep, EXPERTS)?; // +
        let experts_first = experts.experts_of(ep.rank()).start; // +
        let mut model = MoeNet::new(experts.experts_of(ep.rank()), &device); // + own experts
        let hook = MoeHook::new(Arc::new(experts)); // + tokens travel by all-to-all
        let mut placements = PlacementTable::whole(&model); // + where each weight lives:
        place_experts(&mut placements, &model, experts_first)?; // + experts are this rank's own
        let reducer = GradientReducer::new(&ctx, Precision::F32)?; // +
        let mut optim = ModuleAdamW::new(&FlatAdamWConfig::new(), &model); // Burn's AdamW, flat
        let per_rank = GLOBAL_BATCH / ep.size();
        let mut losses = vec![];
        for step in 0..STEPS {
            let start = step * GLOBAL_BATCH + ep.rank() * per_rank; // + this rank's slice
            let (x, y) = batch(start..start + per_rank, &device);
            let (l, value) = loss(&model, x, y, &hook);
            let mut global = [value];
            ep.all_reduce(&mut global, ReduceOp::Avg)?; // + (for printing only)
            losses.push(global[0]);
            let grads = GradientsParams::from_grads(l.backward(), &model);
            let mut flat = vec![0.0; ParamLayout::of(&model).numel]; // +
            accumulate_grads(&model, &grads, &mut flat, &[]); // +
            let entries = placements.entries_of(&model)?; // +
            let mean = 1.0 / ep.size() as f32; // + shared weights averaged, experts kept
            reducer.reduce(&entries, &mut flat, mean, None)?; // +
            model = optim.step_flat(1e-2, model, &flat)?;
        }
        Ok::<_, flashover_parallel::ParallelError>((losses, weights(&model)))
    })
    .expect("expert-parallel training");
    results.into_iter().next().unwrap()
}

/// The input layer's weights (replicated: every rank's copy).
fn weights(model: &MoeNet) -> Vec<f32> {
    model
        .inp
        .weight
        .val()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap()
}

fn main() {
    let single = train_single();
    let parallel = train_expert_parallel();
    println!("step  loss(1 rank)  loss(ep=4)");
    for (i, (a, b)) in single.0.iter().zip(&parallel.0).enumerate() {
        if i % 5 == 0 || i + 1 == STEPS {
            println!("{i:>4}  {a:>12.6}  {b:>10.6}");
        }
    }
    let (loss, weights) = differences(&single, &parallel);
    println!("max relative difference: losses {loss:.2e}, input-layer weights {weights:.2e}");
    assert!(
        loss < 1e-5 && weights < 1e-5,
        "expert parallelism must match one rank"
    );
    assert!(single.0[STEPS - 1] < single.0[0], "the model must learn");
}
