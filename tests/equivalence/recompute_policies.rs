//! Activation checkpointing on the reference transformer, one rank: with dropout on, the loss
//! and every parameter's gradient under each policy equal those without recomputation, bit for
//! bit (the recomputed forward runs the same operations in the same order, and dropout masks
//! are a function of the position, not a random stream).

use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover_models::{Dropout, ForwardContext, Transformer, TransformerConfig, next_token_loss};
use flashover_parallel::activation_checkpointing::CheckpointPolicy;
use flashover_parallel::params::{accumulate_grads, zero_grads};

fn tokens(device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let t: Vec<i64> = (0..2 * 9).map(|i| (i * 7 % 16) as i64).collect();
    let all = Tensor::<2, Int>::from_data(TensorData::new(t, [2, 9]), device);
    (all.clone().narrow(1, 0, 8), all.narrow(1, 1, 8))
}

/// Loss and flat gradient of the tiny model (3 blocks) under `policy`, dropout 0.2.
fn run(policy: &str) -> (f32, Vec<f32>) {
    let policy: CheckpointPolicy = policy.parse().unwrap();
    let mut device = Device::flex().autodiff();
    if policy.is_selective() {
        device = device.gradient_checkpointing();
    }
    let config = TransformerConfig {
        n_layers: 3,
        ..TransformerConfig::tiny(16)
    };
    let model: Transformer = config.init(5, &device);
    let recompute = policy.block_recompute();
    let ctx = ForwardContext {
        dropout: Some(Dropout {
            p: 0.2,
            seed: 3,
            step: 1,
        }),
        checkpointing: recompute.as_ref().map(|r| r.hook()),
        ..ForwardContext::default()
    };
    let (inputs, targets) = tokens(&device);
    let loss = next_token_loss(model.forward_with(inputs, &ctx), targets);
    let value = loss.clone().into_scalar::<f32>();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let zeros = zero_grads(&model, &device.clone().inner());
    let (flat, found) = accumulate_grads(&model, &grads, zeros, &[]);
    assert!(
        found.iter().all(|&f| f),
        "{policy}: every parameter gets a gradient"
    );
    let expected = (0..3).filter(|&l| policy.recomputes_block(l)).count();
    assert_eq!(
        recompute.map_or(0, |r| r.recomputed()),
        expected,
        "{policy}: blocks run again in backward"
    );
    (value, flashover_parallel::params::to_f32(flat))
}

#[test]
fn every_policy_gives_the_gradients_of_no_recomputation_bit_for_bit() {
    let (loss, grads) = run("none");
    for policy in ["full", "every:2", "blocks:1", "selective"] {
        let (l, g) = run(policy);
        assert_eq!(l.to_bits(), loss.to_bits(), "{policy}: loss");
        assert!(
            g.iter()
                .zip(&grads)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{policy}: gradients differ"
        );
    }
}
