//! Burn's `RmsNorm`, fully shardable.

use crate::placed::value_dims;
use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::Initializer;
use burn::tensor::{DType, Device, Tensor};

/// Burn's [`burn::nn::RmsNormConfig`] for [`RmsNorm`]: the same fields and defaults.
#[derive(Config, Debug)]
pub struct RmsNormConfig {
    /// Features normalised (the input's last dimension).
    pub d_model: usize,
    /// Added to the mean square before its root, for stability.
    #[config(default = 1e-5)]
    pub epsilon: f64,
}

impl RmsNormConfig {
    /// A new layer with its scale at one, as Burn's `RmsNormConfig::init` makes it.
    pub fn init(&self, device: &Device) -> RmsNorm {
        assert!(self.epsilon > 0.0, "RmsNorm: epsilon must be positive");
        RmsNorm {
            gamma: Initializer::Ones.init([self.d_model], device),
            epsilon: self.epsilon,
        }
    }
}

/// Burn's [`burn::nn::RmsNorm`] (`y = x / sqrt(mean(x^2) + eps) * gamma` over the last
/// dimension): the same fields, so the same record, and the same forward, except that it
/// checks its input against the scale's [`value_dims`] rather than its stored shape, so a plan
/// can shard the scale over `fsdp` (Burn's reads `gamma.shape()`, which a shard answers with
/// its own rows).
#[derive(Module, Debug)]
pub struct RmsNorm {
    /// The scale, `[d_model]`.
    pub gamma: Param<Tensor<1>>,
    /// Added to the mean square before its root.
    pub epsilon: f64,
}

impl From<burn::nn::RmsNorm> for RmsNorm {
    fn from(norm: burn::nn::RmsNorm) -> Self {
        RmsNorm {
            gamma: norm.gamma,
            epsilon: norm.epsilon,
        }
    }
}

impl RmsNorm {
    /// `x: [.., d_model]` -> `[.., d_model]`, the mean square taken in f32 whatever `x`'s
    /// dtype, as Burn's. Panics when `x`'s last dimension is not `d_model`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let [d_model] = value_dims(&self.gamma);
        assert_eq!(
            x.dims()[D - 1],
            d_model,
            "RmsNorm: the input's last dimension is not d_model"
        );
        let dtype = x.dtype();
        let rms = (x.clone().cast(DType::F32).square().mean_dim(D - 1) + self.epsilon).sqrt();
        (x / rms.cast(dtype)) * self.gamma.val().unsqueeze()
    }
}
