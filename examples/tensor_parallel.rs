//! Tensor parallelism in *your own* Burn block: swap its `nn::Linear` layers for Flashover's
//! column- and row-parallel layers, and train exactly what one device would.
//!
//! The shared example MLP (`x -> l1 -> relu -> l2`) is trained on one rank with a plain Burn
//! loop, then with its weights split over `tp=4`: `l1` by output columns, `l2` by input rows
//! (Megatron's pairing: one all-reduce forward, one backward). Every tp rank sees the whole
//! batch; each holds and steps a quarter of the weights. Losses and the gathered weights match
//! (fp32, 1e-5 relative).
//!
//! Run: `cargo run --example tensor_parallel`

mod common;

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use common::{GLOBAL_BATCH, Mlp, STEPS, batch, differences, mse, train_single};
use flashover::{Axis, launch};
use flashover_parallel::ParallelError;
use flashover_parallel::tensor_parallel::{
    ColumnParallelLinear, RowParallelLinear, TensorParallel, gather_parts,
};

const TP: usize = 4;

/// Your block with its two linear layers split over `tp`: the forward reads as before.
#[derive(Module, Debug)]
struct TpMlp {
    l1: ColumnParallelLinear,
    l2: RowParallelLinear,
}

impl TpMlp {
    /// This rank's share of the single-device model (every rank passes the same one).
    fn shard(full: &Mlp, tp: &TensorParallel) -> Result<Self, ParallelError> {
        Ok(TpMlp {
            // Keep each rank's columns (no gather): they feed the row-parallel layer.
            l1: ColumnParallelLinear::from_full(&full.l1, tp, false)?,
            l2: RowParallelLinear::from_full(&full.l2, tp)?,
        })
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.l2.forward(relu(self.l1.forward(x)))
    }
}

/// The loop of `train_single` with the model split: the lines marked `+` are what changed.
fn train_tensor_parallel() -> (Vec<f32>, Vec<f32>) {
    let results = launch(format!("tp={TP}").as_str(), |ctx| {
        let device = Device::flex().autodiff();
        let tp = TensorParallel::new(ctx.group(Axis::Tp)); // +
        let mut model = TpMlp::shard(&Mlp::new(7, &device), &tp)?; // +
        let mut optim = AdamWConfig::new().init();
        let mut losses = vec![];
        for step in 0..STEPS {
            // Every tp rank computes on the whole batch.
            let (x, y) = batch(step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH, &device);
            let loss = mse(model.forward(x), y);
            losses.push(loss.clone().into_scalar::<f32>());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads); // each rank steps its own share
        }
        // + the whole first layer, gathered from the ranks' columns
        let l1 = gather_parts(model.l1.weight.val(), 1, &tp.group, None)?;
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
