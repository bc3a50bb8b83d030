//! Deterministic, host-side initial weights.
//!
//! Burn's Flex seed is process-wide and its `Linear` initialises lazily, so random init on many
//! rank threads is not reproducible. Every parameter here is drawn from its own stream of a
//! SplitMix64 generator keyed by (model seed, parameter name), on the host.

use burn::module::Param;
use burn::nn::{Embedding, Linear};
use burn::tensor::{Device, Tensor, TensorData};
use flashover_data::SplitMix64;
use flashover_parallel::nn::RmsNorm;

/// FNV-1a hash of a parameter name: its stream index.
fn stream_of(name: &str) -> u64 {
    name.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01B3)
    })
}

/// `len` normal values with standard deviation `std`, from (seed, name).
pub fn normal(seed: u64, name: &str, len: usize, std: f64) -> Vec<f32> {
    let mut rng = SplitMix64::stream(seed, stream_of(name));
    (0..len).map(|_| (rng.normal() * std) as f32).collect()
}

/// A float parameter of `shape` with normal(0, std) values.
pub fn normal_param<const D: usize>(
    seed: u64,
    name: &str,
    shape: [usize; D],
    std: f64,
    device: &Device,
) -> Param<Tensor<D>> {
    let len = shape.iter().product();
    Param::from_data(TensorData::new(normal(seed, name, len, std), shape), device)
}

/// A bias-free linear layer `[d_in, d_out]` with normal(0, std) weights.
pub fn linear(
    seed: u64,
    name: &str,
    d_in: usize,
    d_out: usize,
    std: f64,
    device: &Device,
) -> Linear {
    Linear {
        weight: normal_param(seed, name, [d_in, d_out], std, device),
        bias: None,
    }
}

/// An embedding table `[vocab, d_model]` with normal(0, std) weights.
pub fn embedding(
    seed: u64,
    name: &str,
    vocab: usize,
    d_model: usize,
    std: f64,
    device: &Device,
) -> Embedding {
    Embedding {
        weight: normal_param(seed, name, [vocab, d_model], std, device),
    }
}

/// An RMSNorm over `d` features with unit gain.
pub fn rms_norm(d: usize, eps: f64, device: &Device) -> RmsNorm {
    RmsNorm {
        gamma: Param::from_data(TensorData::new(vec![1.0f32; d], [d]), device),
        epsilon: eps,
    }
}
