//! A tiny two-layer model with deterministic weights, shared by the strategy tests.

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::{Device, Tensor, TensorData};

/// `b(tanh(a(x)))`: 6 -> 16 -> 2, 128 weights, no biases.
#[derive(Module, Debug)]
pub struct Net {
    pub a: Linear,
    pub b: Linear,
}

fn linear(d_in: usize, d_out: usize, salt: f32, device: &Device) -> Linear {
    let w: Vec<f32> = (0..d_in * d_out)
        .map(|i| ((i as f32 * 0.37 + salt).sin()) * 0.3)
        .collect();
    Linear {
        weight: Param::from_data(TensorData::new(w, [d_in, d_out]), device),
        bias: None,
    }
}

impl Net {
    /// The same weights on every call.
    pub fn new(device: &Device) -> Self {
        Net {
            a: linear(6, 16, 0.1, device),
            b: linear(16, 2, 0.7, device),
        }
    }

    /// Forward pass.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.b.forward(self.a.forward(x).tanh())
    }
}
