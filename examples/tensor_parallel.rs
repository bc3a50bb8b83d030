//! Tensor parallelism in *your own* Burn block: declare its linear layers as Flashover's
//! `nn::Linear` (Burn's `Linear`, same fields and record, with the collectives a split needs
//! in its forward), name them in a plan, and train exactly what one device would.
//!
//! The shared example MLP (`x -> l1 -> relu -> l2`) is trained on one rank with a plain Burn
//! loop, then with its weights split over `tp=4` by a plan: `l1` column-wise (by output
//! features), `l2` row-wise (by input features), Megatron's pairing: one all-reduce forward,
//! one backward. Every tp rank sees the whole batch; each holds and steps a quarter of the
//! weights. Losses and the gathered weights match (fp32, 1e-5 relative).
//!
//! Run: `cargo run --example tensor_parallel`

mod common;

use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use common::{GLOBAL_BATCH, Mlp, STEPS, batch, differences, mse, train_single};
use flashover::launch;
use flashover::nn::Linear;
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::{ParallelizePlan, TensorParallelRule, parallelize};

const TP: usize = 4;

/// The example MLP with Flashover's `Linear` in place of Burn's: the forward reads as before.
#[derive(Module, Debug)]
struct TpMlp {
    l1: Linear,
    l2: Linear,
}

impl TpMlp {
    /// The same initial weights as the single-device model.
    fn new(seed: u64, device: &Device) -> Self {
        let Mlp { l1, l2 } = Mlp::new(seed, device);
        TpMlp {
            l1: l1.into(),
            l2: l2.into(),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.l2.forward(relu(self.l1.forward(x)))
    }
}

/// The loop of `train_single` with the model split: the lines marked `+` are what changed.
fn train_tensor_parallel() -> (Vec<f32>, Vec<f32>) {
    let results = launch(format!("tp={TP}").as_str(), |ctx| {
        let device = Device::flex().autodiff();
        let plan = ParallelizePlan::new() // +
            .tensor_parallel(TensorParallelRule::colwise(&["l1"])) // + split by output columns
            .tensor_parallel(TensorParallelRule::rowwise(&["l2"])); // + split by input rows
        let (mut model, par) = parallelize(TpMlp::new(7, &device), &plan, &ctx)?; // +
        let mut optim = AdamWConfig::new().init();
        let mut losses = vec![];
        for step in 0..STEPS {
            // Every tp rank computes on the whole batch.
            let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, step)?, &device);
            let loss = mse(model.forward(x), y);
            losses.push(par.data().mean_loss(loss.clone().into_scalar::<f32>())?);
            let (grads, _norm) = par.gradients(&model, loss.backward(), None, &ctx)?; // +
            model = optim.step(1e-2, model, grads); // each rank steps its own share
        }
        let l1 = par.sharded().whole(model)?.l1.weight.val(); // + the whole layer, gathered from the ranks
        Ok::<_, ParallelError>((losses, l1.into_data().try_to_vec::<f32>().unwrap()))
    })
    .expect("tensor-parallel training");
    results.into_iter().next().unwrap()
}

fn main() {
    let single = train_single();
    let split = train_tensor_parallel();
    println!("step  loss(1 rank)  loss(tp={TP})");
    for (i, (a, b)) in single.0.iter().zip(&split.0).enumerate() {
        if i % 5 == 0 || i + 1 == STEPS {
            println!("{i:>4}  {a:>12.6}  {b:>11.6}");
        }
    }
    let (loss, weights) = differences(&single, &split);
    println!("max relative difference: losses {loss:.2e}, first-layer weights {weights:.2e}");
    assert!(
        loss < 1e-5 && weights < 1e-5,
        "tensor parallelism must match one rank"
    );
    assert!(
        single.0[STEPS - 1] < 0.5 * single.0[0],
        "the model must learn"
    );
    println!("match: the MLP split over {TP} ranks trains the same model as one rank");
}
