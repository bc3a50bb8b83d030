//! Burn's `SwiGlu`, splittable over `tp`.

use super::{Linear, LinearConfig};
use crate::plan::TensorParallelRule;
use burn::config::Config;
use burn::module::Module;
use burn::nn::Initializer;
use burn::tensor::activation::silu;
use burn::tensor::{Device, Tensor};

/// Burn's [`burn::nn::SwiGluConfig`] for [`SwiGlu`]: the same fields and defaults, less
/// Burn's `layout` (the weights are stored `[d_input, d_output]`, Burn's default `Row`).
#[derive(Config, Debug)]
pub struct SwiGluConfig {
    /// Input features.
    pub d_input: usize,
    /// Output features.
    pub d_output: usize,
    /// Whether both linear layers have a bias.
    #[config(default = false)]
    pub bias: bool,
    /// How both linear layers are initialised (Burn's default).
    #[config(
        default = "Initializer::KaimingUniform { gain: 1.0 / 3.0f64.sqrt(), fan_out_only: false }"
    )]
    pub initializer: Initializer,
}

impl SwiGluConfig {
    /// A new layer, initialised as Burn's `SwiGluConfig::init` does (the same draws in the
    /// same order).
    pub fn init(&self, device: &Device) -> SwiGlu {
        let linear = || {
            LinearConfig::new(self.d_input, self.d_output)
                .with_bias(self.bias)
                .with_initializer(self.initializer.clone())
                .init(device)
        };
        SwiGlu {
            linear_inner: linear(),
            linear_outer: linear(),
        }
    }
}

/// Burn's [`burn::nn::SwiGlu`], `silu(linear_inner(x)) * linear_outer(x)`, with the same
/// fields (so the same record) and, on one rank, the same forward. Its layers are [`Linear`],
/// so a plan can split both column-wise over `tp` ([`Self::tensor_parallel_rules`]): each rank
/// computes its share of the output features, which the layer after it (a down projection,
/// split row-wise) reads.
#[derive(Module, Debug)]
pub struct SwiGlu {
    /// `[d_input, d_output]`, through the Swish (column-wise under `tp`).
    pub linear_inner: Linear,
    /// `[d_input, d_output]`, the gate it multiplies (column-wise under `tp`).
    pub linear_outer: Linear,
}

impl From<burn::nn::SwiGlu> for SwiGlu {
    fn from(swiglu: burn::nn::SwiGlu) -> Self {
        SwiGlu {
            linear_inner: swiglu.linear_inner.into(),
            linear_outer: swiglu.linear_outer.into(),
        }
    }
}

impl SwiGlu {
    /// `x: [.., d_input]` -> `[.., d_output]` (this rank's output features under `tp`; both
    /// layers enter the tensor-parallel region once).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let [inner, outer] = Linear::forward_shared([&self.linear_inner, &self.linear_outer], x);
        silu(inner) * outer
    }

    /// The plan's rule that splits this layer at `path` over `tp` (`path` may hold `*`
    /// segments): both layers column-wise. Pair it with a row-wise rule for the layer that
    /// reads its output.
    pub fn tensor_parallel_rules(&self, path: &str) -> Vec<TensorParallelRule> {
        let (inner, outer) = (
            format!("{path}.linear_inner"),
            format!("{path}.linear_outer"),
        );
        vec![TensorParallelRule::colwise(&[&inner, &outer])]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Distribution, Tolerance};

    #[test]
    fn the_drop_in_computes_what_burns_does_from_burns_record() {
        let device = Device::flex();
        let burns = burn::nn::SwiGluConfig::new(6, 10)
            .with_bias(true)
            .init(&device);
        let x = Tensor::<3>::random([2, 3, 6], Distribution::Normal(0.0, 1.0), &device);
        let expected = burns.forward(x.clone());
        let drop_in = SwiGluConfig::new(6, 10)
            .with_bias(true)
            .init(&device)
            .load_record(burns.into_record());
        drop_in
            .forward(x)
            .into_data()
            .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::absolute(0.0));
    }
}
