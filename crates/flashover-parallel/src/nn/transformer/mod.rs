//! Burn's transformer encoder, decoder and position-wise feed-forward, splittable over `tp` and
//! fully shardable: `use flashover::nn::transformer::{..}` in place of `burn::nn::transformer::{..}`
//! is the only change a model built from them needs. Same configs, same fields (so Burn's
//! saved records load), same initialisation and, on one rank, the same forward.
//!
//! What differs is what a plan needs: the linear layers are [`Linear`], whose forward follows a
//! `tp` split; attention counts its heads from its query projection's width on this rank; and
//! no layer reads a parameter's stored shape (Burn's `PositionWiseFeedForward` checks its
//! input against `linear_inner.weight.shape()`, which a fully sharded weight answers with its
//! shard's rows). [`TransformerEncoder::tensor_parallel_rules`] gives the Megatron split of
//! every block.

mod decoder;

pub use decoder::{
    TransformerDecoder, TransformerDecoderConfig, TransformerDecoderInput, TransformerDecoderLayer,
};

use super::dropout::{self, Positions, drop_elements};
use super::sequence_split::StackSplit;
use super::{Linear, LinearConfig, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use crate::dropout::draws;
use crate::placed::tp_split;
use crate::plan::{SequenceParallelRules, TensorParallelRule};
use burn::config::Config;
use burn::module::Module;
use burn::nn::activation::{Activation, ActivationConfig};
use burn::nn::{Dropout, DropoutConfig, Initializer, LayerNorm, LayerNormConfig};
use burn::tensor::{Bool, Device, Tensor};

/// Burn's [`burn::nn::transformer::PositionWiseFeedForwardConfig`] for
/// [`PositionWiseFeedForward`]: the same fields and defaults.
#[derive(Config, Debug)]
pub struct PositionWiseFeedForwardConfig {
    /// The model's width.
    pub d_model: usize,
    /// The hidden width.
    pub d_ff: usize,
    /// Dropout after the activation.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// How the two linear layers are initialised (Burn's default).
    #[config(
        default = "Initializer::KaimingUniform { gain: 1.0 / 3.0f64.sqrt(), fan_out_only: false }"
    )]
    pub initializer: Initializer,
    /// The activation between them.
    #[config(default = "ActivationConfig::Gelu")]
    pub activation: ActivationConfig,
}

/// Burn's [`burn::nn::transformer::PositionWiseFeedForward`], `linear_outer(dropout(act(
/// linear_inner(x))))`, with [`Linear`] layers: split over `tp`, the inner layer column-wise
/// and the outer row-wise (Megatron's MLP), each rank computes `d_ff / tp` hidden features.
#[derive(Module, Debug)]
pub struct PositionWiseFeedForward {
    /// `[d_model, d_ff]`.
    pub linear_inner: Linear,
    /// `[d_ff, d_model]`.
    pub linear_outer: Linear,
    /// After the activation.
    pub dropout: Dropout,
    /// Between the two layers (no parameters, as in Burn's record).
    #[module(skip)]
    pub activation: Activation,
}

impl PositionWiseFeedForwardConfig {
    /// A new layer, initialised as Burn's `PositionWiseFeedForwardConfig::init` does.
    pub fn init(&self, device: &Device) -> PositionWiseFeedForward {
        let linear = |d_in, d_out| {
            LinearConfig::new(d_in, d_out)
                .with_initializer(self.initializer.clone())
                .init(device)
        };
        PositionWiseFeedForward {
            linear_inner: linear(self.d_model, self.d_ff),
            linear_outer: linear(self.d_ff, self.d_model),
            dropout: DropoutConfig::new(self.dropout).init(),
            activation: self.activation.init(device),
        }
    }
}

impl From<burn::nn::transformer::PositionWiseFeedForward> for PositionWiseFeedForward {
    fn from(pwff: burn::nn::transformer::PositionWiseFeedForward) -> Self {
        PositionWiseFeedForward {
            linear_inner: pwff.linear_inner.into(),
            linear_outer: pwff.linear_outer.into(),
            dropout: pwff.dropout,
            activation: pwff.activation,
        }
    }
}

impl PositionWiseFeedForward {
    /// `x: [.., d_model]` -> `[.., d_model]`. Panics when `x`'s last dimension is not
    /// `d_model`, or when split over `tp` with dropout in training (see
    /// [`MultiHeadAttention`]).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let d_model = self.linear_inner.d_input();
        assert_eq!(
            x.dims()[D - 1],
            d_model,
            "PositionWiseFeedForward: the input's last dimension is not d_model"
        );
        let hidden = self.activation.forward(self.linear_inner.forward(x));
        // This rank's hidden features are features `rank * local..` of the whole layer's.
        let split = tp_split(&self.linear_inner.weight);
        let mut offsets = [0; D];
        offsets[D - 1] = split.map_or(0, |s| s.group.rank() * hidden.dims()[D - 1]);
        let split = split.map(|s| ("PositionWiseFeedForward", s.group.size()));
        let dropout = &self.dropout;
        // Inside a split region: whole sequences under sequence parallelism, this rank's
        // positions under context parallelism.
        let positions = Positions::InRegion(D - 2);
        let hidden = drop_elements(
            dropout.prob,
            &dropout.training,
            hidden,
            offsets,
            positions,
            split,
        );
        self.linear_outer.forward(hidden)
    }

    /// The plan's rules that split this layer at `path` over `tp` (`path` may hold `*`
    /// segments): the inner layer column-wise, the outer row-wise.
    pub fn tensor_parallel_rules(&self, path: &str) -> Vec<TensorParallelRule> {
        vec![
            TensorParallelRule::colwise(&[&format!("{path}.linear_inner")]),
            TensorParallelRule::rowwise(&[&format!("{path}.linear_outer")]),
        ]
    }
}

/// Burn's [`burn::nn::transformer::TransformerEncoderConfig`] for [`TransformerEncoder`]: the
/// same fields and defaults.
#[derive(Config, Debug)]
pub struct TransformerEncoderConfig {
    /// The model's width.
    pub d_model: usize,
    /// The feed-forward's hidden width.
    pub d_ff: usize,
    /// Attention heads.
    pub n_heads: usize,
    /// Layers.
    pub n_layers: usize,
    /// Dropout on the attention weights, the feed-forward's hidden features and both
    /// residual branches.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Normalise each branch's input (pre-norm) rather than each residual sum (post-norm).
    #[config(default = false)]
    pub norm_first: bool,
    /// Burn's `quiet_softmax` in attention.
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// How the linear layers are initialised (Burn's default).
    #[config(
        default = "Initializer::KaimingUniform { gain: 1.0 / 3.0f64.sqrt(), fan_out_only: false }"
    )]
    pub initializer: Initializer,
    /// The feed-forward's activation.
    #[config(default = "ActivationConfig::Gelu")]
    pub activation: ActivationConfig,
    /// The layer norms' epsilon.
    #[config(default = 1e-5)]
    pub layer_norm_eps: f64,
}

/// Burn's [`burn::nn::transformer::TransformerEncoder`]: `n_layers` of self-attention and
/// feed-forward, each with its residual, dropout and layer norms.
#[derive(Module, Debug)]
pub struct TransformerEncoder {
    /// The layers, in order.
    pub layers: Vec<TransformerEncoderLayer>,
    /// The model's width.
    pub d_model: usize,
    /// The feed-forward's hidden width.
    pub d_ff: usize,
    /// Attention heads (of the whole model).
    pub n_heads: usize,
    /// Layers.
    pub n_layers: usize,
    /// Dropout probability.
    pub dropout: f64,
    /// Pre-norm rather than post-norm.
    pub norm_first: bool,
    /// Burn's `quiet_softmax` in attention.
    pub quiet_softmax: bool,
}

/// Burn's [`burn::nn::transformer::TransformerEncoderLayer`].
#[derive(Module, Debug)]
pub struct TransformerEncoderLayer {
    /// Self-attention.
    pub mha: MultiHeadAttention,
    /// The feed-forward.
    pub pwff: PositionWiseFeedForward,
    /// After attention's residual (post-norm), or before the feed-forward (pre-norm).
    pub norm_1: LayerNorm,
    /// After the feed-forward's residual (post-norm), or before attention (pre-norm).
    pub norm_2: LayerNorm,
    /// On both residual branches.
    pub dropout: Dropout,
    /// Pre-norm rather than post-norm.
    pub norm_first: bool,
}

/// An encoder's input and masks (Burn's `TransformerEncoderInput`).
#[derive(Debug)]
pub struct TransformerEncoderInput {
    tensor: Tensor<3>,
    mask_pad: Option<Tensor<2, Bool>>,
    mask_attn: Option<Tensor<3, Bool>>,
}

impl TransformerEncoderInput {
    /// The input `[batch, seq, d_model]`.
    pub fn new(tensor: Tensor<3>) -> Self {
        TransformerEncoderInput {
            tensor,
            mask_pad: None,
            mask_attn: None,
        }
    }

    /// Hides the positions where `mask: [batch, seq]` is true (padding) from attention.
    pub fn mask_pad(mut self, mask: Tensor<2, Bool>) -> Self {
        self.mask_pad = Some(mask);
        self
    }

    /// Hides the scores where `mask: [batch, seq, seq]` is true.
    pub fn mask_attn(mut self, mask: Tensor<3, Bool>) -> Self {
        self.mask_attn = Some(mask);
        self
    }
}

impl TransformerEncoderConfig {
    /// A new encoder, initialised as Burn's `TransformerEncoderConfig::init` does.
    pub fn init(&self, device: &Device) -> TransformerEncoder {
        TransformerEncoder {
            layers: (0..self.n_layers).map(|_| self.layer(device)).collect(),
            d_model: self.d_model,
            d_ff: self.d_ff,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            dropout: self.dropout,
            norm_first: self.norm_first,
            quiet_softmax: self.quiet_softmax,
        }
    }

    fn layer(&self, device: &Device) -> TransformerEncoderLayer {
        let parts = LayerParts {
            d_model: self.d_model,
            d_ff: self.d_ff,
            n_heads: self.n_heads,
            dropout: self.dropout,
            quiet_softmax: self.quiet_softmax,
            initializer: &self.initializer,
            activation: &self.activation,
            layer_norm_eps: self.layer_norm_eps,
        };
        TransformerEncoderLayer {
            mha: parts.attention(device),
            norm_1: parts.norm(device),
            norm_2: parts.norm(device),
            pwff: parts.feed_forward(device),
            dropout: DropoutConfig::new(self.dropout).init(),
            norm_first: self.norm_first,
        }
    }
}

/// What an encoder's or decoder's configuration says of each layer's parts, which both build
/// as Burn's do (in the same order, so from the same draws).
struct LayerParts<'a> {
    d_model: usize,
    d_ff: usize,
    n_heads: usize,
    dropout: f64,
    quiet_softmax: bool,
    initializer: &'a Initializer,
    activation: &'a ActivationConfig,
    layer_norm_eps: f64,
}

impl LayerParts<'_> {
    fn attention(&self, device: &Device) -> MultiHeadAttention {
        MultiHeadAttentionConfig::new(self.d_model, self.n_heads)
            .with_initializer(self.initializer.clone())
            .with_dropout(self.dropout)
            .with_quiet_softmax(self.quiet_softmax)
            .init(device)
    }

    fn norm(&self, device: &Device) -> LayerNorm {
        LayerNormConfig::new(self.d_model)
            .with_epsilon(self.layer_norm_eps)
            .init(device)
    }

    fn feed_forward(&self, device: &Device) -> PositionWiseFeedForward {
        PositionWiseFeedForwardConfig::new(self.d_model, self.d_ff)
            .with_initializer(self.initializer.clone())
            .with_dropout(self.dropout)
            .with_activation(self.activation.clone())
            .init(device)
    }
}

impl From<burn::nn::transformer::TransformerEncoder> for TransformerEncoder {
    fn from(encoder: burn::nn::transformer::TransformerEncoder) -> Self {
        TransformerEncoder {
            layers: encoder.layers.into_iter().map(Into::into).collect(),
            d_model: encoder.d_model,
            d_ff: encoder.d_ff,
            n_heads: encoder.n_heads,
            n_layers: encoder.n_layers,
            dropout: encoder.dropout,
            norm_first: encoder.norm_first,
            quiet_softmax: encoder.quiet_softmax,
        }
    }
}

impl From<burn::nn::transformer::TransformerEncoderLayer> for TransformerEncoderLayer {
    fn from(layer: burn::nn::transformer::TransformerEncoderLayer) -> Self {
        TransformerEncoderLayer {
            mha: layer.mha.into(),
            pwff: layer.pwff.into(),
            norm_1: layer.norm_1,
            norm_2: layer.norm_2,
            dropout: layer.dropout,
            norm_first: layer.norm_first,
        }
    }
}

impl TransformerEncoder {
    /// `input: [batch, seq, d_model]` -> `[batch, seq, d_model]`, through every layer.
    pub fn forward(&self, input: TransformerEncoderInput) -> Tensor<3> {
        let run = |mut x: Tensor<3>| {
            for (i, layer) in self.layers.iter().enumerate() {
                let (pad, attn) = (input.mask_pad.clone(), input.mask_attn.clone());
                x = draws::in_layer(i, || layer.forward(x, pad, attn));
            }
            x
        };
        let split = self
            .layers
            .first()
            .and_then(|l| StackSplit::of(&l.mha.query.weight));
        match split {
            None => run(input.tensor),
            // Sequence or context parallelism: the layers run on this rank's positions (the
            // masks stay whole: attention reads every position's keys).
            Some(split) => {
                let x = split.split(input.tensor, "TransformerEncoder");
                let local = x.dims()[1];
                split.join(split.run(local, || run(x)))
            }
        }
    }

    /// The plan's rules that split every layer of this encoder at `path` over `tp`, as
    /// Megatron splits a block: attention by whole heads (query, key, value column-wise, the
    /// output row-wise) and the feed-forward's inner layer column-wise, its outer row-wise.
    /// Each layer then runs two all-reduces forward and two backward.
    ///
    /// ```
    /// use flashover_parallel::nn::transformer::TransformerEncoderConfig;
    /// use flashover_parallel::parallelize::ParallelizePlan;
    ///
    /// let encoder = TransformerEncoderConfig::new(32, 64, 4, 2).init(&Default::default());
    /// let plan = ParallelizePlan::new().tensor_parallel_rules(encoder.tensor_parallel_rules("encoder"));
    /// assert_eq!(plan.tensor_parallel.len(), 4);
    /// ```
    pub fn tensor_parallel_rules(&self, path: &str) -> Vec<TensorParallelRule> {
        let layer = format!("{path}.layers.*");
        match self.layers.first() {
            None => vec![],
            Some(first) => {
                let mut rules = first.mha.tensor_parallel_rules(&format!("{layer}.mha"));
                rules.extend(first.pwff.tensor_parallel_rules(&format!("{layer}.pwff")));
                rules
            }
        }
    }

    /// The plan's sequence parallelism of this encoder at `path`, with
    /// [`Self::tensor_parallel_rules`]: the encoder splits its whole input by sequence over
    /// `tp` and returns whole sequences; each layer's norms, residuals and dropout run on this
    /// rank's positions, the split layers all-gather their input along the sequence and
    /// reduce-scatter their output (Megatron's sequence parallelism).
    pub fn sequence_parallel_rules(&self, path: &str) -> SequenceParallelRules {
        SequenceParallelRules {
            stack: path.to_string(),
            modules: ["norm_1", "norm_2"]
                .map(|norm| format!("{path}.layers.*.{norm}"))
                .to_vec(),
        }
    }
}

impl TransformerEncoderLayer {
    /// Burn's encoder layer: attention and feed-forward branches, each with dropout and a
    /// residual, normalised before (pre-norm) or after (post-norm). `x: [batch, seq,
    /// d_model]`; `mask_pad: [batch, seq]`, `mask_attn: [batch, seq, seq]`.
    pub fn forward(
        &self,
        x: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Tensor<3> {
        draws::mark_layer_kind(draws::ENCODER_LAYER);
        let attention_in = match self.norm_first {
            true => self.norm_2.forward(x.clone()),
            false => x.clone(),
        };
        let mut input = MhaInput::self_attn(attention_in);
        if let Some(mask) = mask_pad {
            input = input.mask_pad(mask);
        }
        if let Some(mask) = mask_attn {
            input = input.mask_attn(mask);
        }
        let attended = self.drop_branch(self.mha.forward_context(input));
        let mut x = x + attended;
        let ff_in = match self.norm_first {
            true => self.norm_1.forward(x.clone()),
            false => {
                x = self.norm_1.forward(x);
                x.clone()
            }
        };
        let x = x + self.drop_branch(self.pwff.forward(ff_in));
        match self.norm_first {
            true => x,
            false => self.norm_2.forward(x),
        }
    }

    /// Dropout on a branch's output (see [`dropout::drop_residual`]).
    fn drop_branch(&self, branch: Tensor<3>) -> Tensor<3> {
        let query = &self.mha.query.weight;
        dropout::drop_residual(&self.dropout, branch, query, "TransformerEncoderLayer")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;
    use burn::tensor::Distribution;

    /// Burn's encoder and the drop-in built from it compute the same, bit for bit, with a
    /// padding mask, pre- and post-norm (dropout off: it draws from the device).
    #[test]
    fn the_drop_in_encoder_computes_what_burns_does() {
        let _composed = crate::attention_op::hold_kernel_use(flashover_kernels::KernelUse::Auto);
        let device = Device::flex();
        for norm_first in [false, true] {
            let config = burn::nn::transformer::TransformerEncoderConfig::new(16, 32, 4, 2)
                .with_dropout(0.0)
                .with_norm_first(norm_first);
            let burns = config.init(&device);
            let x = Tensor::<3>::random([2, 5, 16], Distribution::Default, &device);
            let pad = Tensor::<2, Bool>::from_bool(
                burn::tensor::TensorData::new(
                    vec![
                        false, false, false, true, true, false, false, false, false, true,
                    ],
                    [2, 5],
                ),
                &device,
            );
            let expected = burns.forward(
                burn::nn::transformer::TransformerEncoderInput::new(x.clone())
                    .mask_pad(pad.clone()),
            );
            let ours = TransformerEncoder::from(burns);
            let got = ours.forward(TransformerEncoderInput::new(x).mask_pad(pad));
            got.into_data().assert_eq(&expected.into_data(), true);
        }
    }

    /// A record of Burn's encoder loads into the drop-in built from the same configuration,
    /// which then computes what Burn's does, bit for bit.
    #[test]
    fn a_record_of_burns_encoder_loads_into_the_drop_in() {
        let _composed = crate::attention_op::hold_kernel_use(flashover_kernels::KernelUse::Auto);
        let device = Device::flex();
        let burns = burn::nn::transformer::TransformerEncoderConfig::new(16, 32, 4, 2)
            .with_dropout(0.0)
            .init(&device);
        let x = Tensor::<3>::random([2, 5, 16], Distribution::Default, &device);
        let expected = burns.forward(burn::nn::transformer::TransformerEncoderInput::new(
            x.clone(),
        ));
        let ours = TransformerEncoderConfig::new(16, 32, 4, 2)
            .with_dropout(0.0)
            .init(&device)
            .load_record(burns.into_record());
        let got = ours.forward(TransformerEncoderInput::new(x));
        got.into_data().assert_eq(&expected.into_data(), true);
    }

    /// The drop-in's configuration makes the same parameters, under the same names, as
    /// Burn's: a record saved from one loads into the other.
    #[test]
    fn the_drop_in_encoder_has_burns_parameters() {
        fn names<M: Module>(m: &M) -> Vec<(String, Vec<usize>)> {
            struct Names(Vec<String>, Vec<(String, Vec<usize>)>);
            impl burn::module::ModuleVisitor for Names {
                fn enter_module(&mut self, name: &str, _: &str) {
                    self.0.push(name.to_string());
                }
                fn exit_module(&mut self, _: &str, _: &str) {
                    self.0.pop();
                }
                fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                    self.1.push((self.0.join("."), p.val().dims().to_vec()));
                }
            }
            let mut v = Names(vec![], vec![]);
            m.visit(&mut v);
            v.1
        }
        let device = Device::flex();
        let burns =
            burn::nn::transformer::TransformerEncoderConfig::new(16, 32, 4, 2).init(&device);
        let ours = TransformerEncoderConfig::new(16, 32, 4, 2).init(&device);
        assert_eq!(names(&burns), names(&ours));
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod fused_tests {
    use super::*;
    use burn::tensor::{DeviceKind, Distribution, TensorData};
    use flashover_kernels::KernelUse;

    /// With the kernels on (wgpu, forced), the drop-in encoder's attention runs as the fused
    /// op, its padding mask included: the output and the gradients of the input and of each
    /// layer's query and value projections are the composed attention's on the same device
    /// within 1e-4, and Burn's own encoder's on Flex within 1e-3 (the composed path on wgpu
    /// is itself 3e-4 from Flex in these gradients). The length is not a multiple of a tile.
    #[test]
    fn the_drop_in_encoder_attends_fused_with_padding_as_burns_encoder_does() {
        let _serial = crate::attention_op::hold_kernel_use(flashover_kernels::KernelUse::Auto);
        let flex = Device::flex().autodiff();
        let wgpu = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        let (batch, seq, d_model, layers) = (2, 37, 16, 2);
        let config = burn::nn::transformer::TransformerEncoderConfig::new(d_model, 32, 4, layers)
            .with_dropout(0.0);
        let burns = config.init(&flex);
        // A copy on wgpu whose parameters are leaves there.
        let ours = TransformerEncoder::from(burns.clone()).fork(&wgpu);
        let x = Tensor::<3>::random([batch, seq, d_model], Distribution::Default, &flex);
        let r = Tensor::<3>::random([batch, seq, d_model], Distribution::Default, &flex);
        // Sample 0: its last 10 positions are padding; sample 1: its first.
        let pad: Vec<bool> = (0..batch * seq)
            .map(|i| (i < seq && i >= seq - 10) || i == seq)
            .collect();
        let pad = TensorData::new(pad, [batch, seq]);
        let values = |t: Tensor<3>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        // `kernels`: None runs Burn's encoder on Flex, Some the drop-in on wgpu.
        let run = |kernels: Option<KernelUse>| {
            let device = match kernels {
                Some(use_kernels) => {
                    flashover_kernels::set_kernel_use(use_kernels);
                    &wgpu
                }
                None => &flex,
            };
            let launches = flashover_kernels::attention_kernel_launches();
            let x = x.clone().to_device(device).detach().require_grad();
            let pad = Tensor::<2, Bool>::from_data(pad.clone(), device);
            let out = match kernels {
                None => burns.forward(
                    burn::nn::transformer::TransformerEncoderInput::new(x.clone()).mask_pad(pad),
                ),
                Some(_) => ours.forward(TransformerEncoderInput::new(x.clone()).mask_pad(pad)),
            };
            let grads = (out.clone() * r.clone().to_device(device)).sum().backward();
            let mut all = vec![values(out), values(x.grad(&grads).unwrap().unsqueeze())];
            for layer in 0..layers {
                let weights = match kernels {
                    None => [
                        &burns.layers[layer].mha.query,
                        &burns.layers[layer].mha.value,
                    ]
                    .map(|l| l.weight.grad(&grads).unwrap()),
                    Some(_) => [&ours.layers[layer].mha.query, &ours.layers[layer].mha.value]
                        .map(|l| l.weight.grad(&grads).unwrap()),
                };
                all.extend(weights.map(|w| values(w.unsqueeze())));
            }
            (
                all,
                flashover_kernels::attention_kernel_launches() - launches,
            )
        };
        let (composed, none) = run(Some(KernelUse::Never));
        let (fused, launched) = run(Some(KernelUse::Always));
        let (burns_own, _) = run(None);
        assert_eq!(none, 0, "the composed path launches no attention kernel");
        assert!(
            launched >= 2 * layers,
            "each layer's attention runs the kernels forward and backward: {launched} launches"
        );
        let names = [
            "out",
            "d x",
            "d query 0",
            "d value 0",
            "d query 1",
            "d value 1",
        ];
        for (other, tolerance, what) in [(composed, 1e-4, "composed"), (burns_own, 1e-3, "Burn's")]
        {
            for ((f, b), name) in fused.iter().zip(&other).zip(names) {
                for (x, y) in f.iter().zip(b) {
                    assert!(
                        (x - y).abs() <= tolerance * y.abs().max(1.0),
                        "{name}: fused {x} vs {what} {y}"
                    );
                }
            }
        }
    }
}
