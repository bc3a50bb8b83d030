//! Long sequences split over context-parallel ranks: each of four ranks holds a quarter of
//! every 512-token sequence (a head and a tail chunk, so causal work is even) for the whole
//! model, and attention passes key/value blocks around the ring.
//!
//! The reference transformer is trained twice on the same data and seed: on one rank with a
//! plain Burn loop over the whole sequences, and on `cp=4` rank threads. The loss curves and the
//! final weights match (fp32, 1e-5 relative).
//!
//! Run: `cargo run --example context_parallel_long_sequence`

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover::check::relative_difference;
use flashover::{Axis, launch};
use flashover_models::transformer::split_sequences;
use flashover_models::{ForwardContext, Transformer, TransformerConfig, next_token_loss};
use flashover_parallel::parallelize::{ContextParallelRule, ParallelizePlan, parallelize};

const SEQ: usize = 512;
const BATCH: usize = 2;
const STEPS: usize = 8;
const CP: usize = 4;

fn config() -> TransformerConfig {
    TransformerConfig::new(32, 32, 2, 4, 64)
}

/// Step `step`'s inputs and next-token targets, `[BATCH, SEQ]` each: a deterministic sequence
/// with long-range structure (token t depends on token t - 100).
fn batch(step: usize, device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let tokens: Vec<i64> = (0..BATCH)
        .flat_map(|b| {
            let mut s = vec![0i64; SEQ + 1];
            for t in 0..=SEQ {
                s[t] = if t < 100 {
                    ((t * 7 + b * 3 + step) % 32) as i64
                } else {
                    (s[t - 100] * 5 + 1) % 32
                };
            }
            s
        })
        .collect();
    let all = Tensor::<2, Int>::from_data(TensorData::new(tokens, [BATCH, SEQ + 1]), device);
    (all.clone().narrow(1, 0, SEQ), all.narrow(1, 1, SEQ))
}

fn weights(model: &Transformer) -> Vec<f32> {
    model
        .embed
        .weight
        .val()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap()
}

/// The plain Burn loop on one device, whole sequences.
fn train_single() -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let mut model = config().init(3, &device);
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
        let (inputs, targets) = batch(step, &device);
        let loss = next_token_loss(model.forward(inputs), targets);
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model, grads);
    }
    (losses, weights(&model))
}

/// The same loop with the sequence split over `cp` ranks: the lines marked `+` changed.
fn train_context_parallel() -> (Vec<f32>, Vec<f32>) {
    let results = launch(format!("cp={CP}").as_str(), |ctx| {
        let device = Device::flex().autodiff();
        // + Every sequence split over cp, in load-balanced chunks; the reference transformer's
        // + attention runs through its forward context, so the rule names no attention cores.
        let plan = ParallelizePlan::new().context_parallel(ContextParallelRule::ring(&[]));
        let (mut model, par) = parallelize(config().init(3, &device), &plan, &ctx)?; // +
        let mut optim = AdamWConfig::new().init();
        let mut losses = vec![];
        for step in 0..STEPS {
            let (inputs, targets) = batch(step, &device);
            let inputs = par.sequences().share(inputs, 1)?; // + this rank's positions
            let targets = par.sequences().share(targets, 1)?; // +
            let fwd = split_sequences(&par, &model, ForwardContext::default(), SEQ)?; // +
            let loss = next_token_loss(model.forward_with(inputs, &fwd), targets);
            losses.push(par.data().mean_loss(loss.clone().into_scalar::<f32>())?); // + the whole loss
            let (grads, _norm) = par.gradients(&model, loss.backward(), None, &ctx)?; // +
            model = optim.step(3e-3, model, grads);
        }
        let work = par
            .sequences()
            .attention_work()
            .map_or(0, |w| w.score_elements);
        println!(
            "rank {} held positions {:?}..., computed {work} attention scores",
            ctx.coord(Axis::Cp),
            &par.sequences().positions(SEQ)?[..3],
        );
        Ok::<_, flashover_parallel::ParallelError>((losses, weights(&model)))
    })
    .expect("context-parallel training");
    results.into_iter().next().unwrap()
}

fn main() {
    let single = train_single();
    let split = train_context_parallel();
    println!("step  loss(1 rank)  loss(cp={CP})");
    for (i, (a, b)) in single.0.iter().zip(&split.0).enumerate() {
        println!("{i:>4}  {a:>12.6}  {b:>11.6}");
    }
    let loss_diff = relative_difference(&single.0, &split.0);
    let w_diff = relative_difference(&single.1, &split.1);
    println!(
        "max relative loss difference {loss_diff:.2e}; max relative weight difference {w_diff:.2e}"
    );
    assert!(
        loss_diff < 1e-5 && w_diff < 1e-5,
        "cp={CP} must match one rank"
    );
    assert!(single.0[STEPS - 1] < single.0[0], "the model must learn");
    println!("match: {SEQ}-token sequences split over {CP} ranks train as on one rank");
}
