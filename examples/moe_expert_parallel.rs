//! Expert parallelism in *your own* Burn model: put Flashover's mixture-of-experts layer in it,
//! spread the experts over ranks with one plan rule, and train exactly what one device would.
//!
//! A small regression network with a mixture of four experts (top-2) between two linear layers
//! is trained twice on the same data and seed: on one rank holding every expert with a plain
//! Burn loop, and on four rank threads (`ep=4`) parallelized by
//! `ParallelizePlan::new().expert_parallel("moe")`: each holds one expert and a quarter of the
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
use flashover::launch;
use flashover_models::moe::{Moe, MoeConfig};
use flashover_models::{SwiGlu, init};
use flashover_parallel::expert_parallel::MoeForward;
use flashover_parallel::parallelize::{ParallelizePlan, parallelize};

const EXPERTS: usize = 4;
const WIDTH: usize = 16;

/// Your model, with a mixture of experts inside.
#[derive(Module, Debug)]
struct MoeNet {
    inp: Linear,
    moe: Moe,
    out: Linear,
}

impl MoeNet {
    fn new(device: &Device) -> Self {
        let expert = |x: usize| {
            let name = |w: &str| format!("experts.{x}.{w}");
            SwiGlu {
                w_gate: init::linear(7, &name("gate"), WIDTH, 24, 0.3, device).into(),
                w_up: init::linear(7, &name("up"), WIDTH, 24, 0.3, device).into(),
                w_down: init::linear(7, &name("down"), 24, WIDTH, 0.3, device).into(),
            }
        };
        MoeNet {
            inp: init::linear(7, "inp", 8, WIDTH, 0.3, device),
            moe: Moe {
                router: init::linear(7, "router", WIDTH, EXPERTS, 0.3, device),
                experts: (0..EXPERTS).map(expert).collect(),
                shared: None,
                first_expert: 0,
                config: MoeConfig::new(EXPERTS, 2, 24),
                expert_bias: vec![],
            },
            out: init::linear(7, "out", WIDTH, 1, 0.3, device),
        }
    }

    /// The objective (the fit plus the router's balancing loss) and the fit's value. Each
    /// sample is a one-token sequence through a residual MoE block.
    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> (Tensor<1>, f32) {
        let n = x.dims()[0];
        let h = self.inp.forward(x).reshape([n, 1, WIDTH]);
        let (routed, aux) = self.moe.forward(h.clone());
        let fit = mse(self.out.forward((h + routed).reshape([n, WIDTH])), y);
        let value = fit.clone().into_scalar::<f32>();
        match aux {
            Some(aux) => (fit + aux, value),
            None => (fit, value),
        }
    }
}

/// The plain Burn loop on one device, every expert local.
fn train_single() -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let mut model = MoeNet::new(&device);
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
        let (x, y) = batch(step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH, &device);
        let (l, value) = model.loss(x, y);
        losses.push(value);
        let grads = GradientsParams::from_grads(l.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    (losses, weights(&model))
}

/// The same with the experts over `ep=4`: the lines marked `+` are what changed.
fn train_expert_parallel() -> (Vec<f32>, Vec<f32>) {
    let plan = ParallelizePlan::new().expert_parallel("moe"); // +
    let results = launch("ep=4", |ctx| {
        let device = Device::flex().autodiff();
        let (mut model, par) = parallelize(MoeNet::new(&device), &plan, &ctx)?; // + own experts
        let mut optim = AdamWConfig::new().init();
        let mut losses = vec![];
        for step in 0..STEPS {
            let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, step)?, &device); // + this rank's
            let (l, value) = model.loss(x, y);
            losses.push(par.data().mean_loss(value)?); // + (for printing only)
            let (grads, _norm) = par.gradients(&model, l.backward(), None, &ctx)?; // +
            model = optim.step(1e-2, model, grads);
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
