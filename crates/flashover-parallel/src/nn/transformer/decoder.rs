//! Burn's transformer decoder (self-attention, cross-attention over an encoder's memory,
//! feed-forward), splittable over `tp` and fully shardable.

use super::{LayerParts, PositionWiseFeedForward};
use crate::dropout::draws;
use crate::nn::dropout;
use crate::nn::sequence_split::StackSplit;
use crate::nn::{MhaInput, MultiHeadAttention};
use crate::plan::{SequenceParallelRules, TensorParallelRule};
use burn::config::Config;
use burn::module::Module;
use burn::nn::activation::ActivationConfig;
use burn::nn::{Dropout, DropoutConfig, Initializer, LayerNorm};
use burn::tensor::{Bool, Device, Tensor};

/// Burn's [`burn::nn::transformer::TransformerDecoderConfig`] for [`TransformerDecoder`]: the
/// same fields and defaults.
#[derive(Config, Debug)]
pub struct TransformerDecoderConfig {
    /// The model's width.
    pub d_model: usize,
    /// The feed-forward's hidden width.
    pub d_ff: usize,
    /// Attention heads.
    pub n_heads: usize,
    /// Layers.
    pub n_layers: usize,
    /// Dropout on the attention weights, the feed-forward's hidden features and the three
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

/// Burn's [`burn::nn::transformer::TransformerDecoder`]: `n_layers` of self-attention over the
/// target, cross-attention over the memory and feed-forward, each with its residual, dropout
/// and layer norm.
#[derive(Module, Debug)]
pub struct TransformerDecoder {
    /// The layers, in order.
    pub layers: Vec<TransformerDecoderLayer>,
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

/// Burn's [`burn::nn::transformer::TransformerDecoderLayer`].
#[derive(Module, Debug)]
pub struct TransformerDecoderLayer {
    /// Attention of the target over the memory.
    pub cross_attn: MultiHeadAttention,
    /// Attention of the target over itself.
    pub self_attn: MultiHeadAttention,
    /// The feed-forward.
    pub pwff: PositionWiseFeedForward,
    /// Around cross-attention.
    pub norm_1: LayerNorm,
    /// Around the feed-forward.
    pub norm_2: LayerNorm,
    /// Around self-attention (pre-norm), or after the feed-forward's residual (post-norm).
    pub norm_3: LayerNorm,
    /// On the three residual branches.
    pub dropout: Dropout,
    /// Pre-norm rather than post-norm.
    pub norm_first: bool,
}

/// A decoder's target and memory, and their masks (Burn's `TransformerDecoderInput`).
#[derive(Debug)]
pub struct TransformerDecoderInput {
    target: Tensor<3>,
    target_mask_pad: Option<Tensor<2, Bool>>,
    target_mask_attn: Option<Tensor<3, Bool>>,
    memory: Tensor<3>,
    memory_mask_pad: Option<Tensor<2, Bool>>,
    memory_mask_attn: Option<Tensor<3, Bool>>,
}

impl TransformerDecoderInput {
    /// The target `[batch, seq_t, d_model]` and the encoder's memory `[batch, seq_m, d_model]`.
    pub fn new(target: Tensor<3>, memory: Tensor<3>) -> Self {
        TransformerDecoderInput {
            target,
            target_mask_pad: None,
            target_mask_attn: None,
            memory,
            memory_mask_pad: None,
            memory_mask_attn: None,
        }
    }

    /// Hides the memory positions where `mask: [batch, seq_m]` is true from cross-attention.
    pub fn memory_mask_pad(mut self, mask: Tensor<2, Bool>) -> Self {
        self.memory_mask_pad = Some(mask);
        self
    }

    /// Hides cross-attention's scores where `mask: [batch, seq_t, seq_m]` is true.
    pub fn memory_mask_attn(mut self, mask: Tensor<3, Bool>) -> Self {
        self.memory_mask_attn = Some(mask);
        self
    }

    /// Hides the target positions where `mask: [batch, seq_t]` is true from self-attention.
    pub fn target_mask_pad(mut self, mask: Tensor<2, Bool>) -> Self {
        self.target_mask_pad = Some(mask);
        self
    }

    /// Hides self-attention's scores where `mask: [batch, seq_t, seq_t]` is true (a causal
    /// mask).
    pub fn target_mask_attn(mut self, mask: Tensor<3, Bool>) -> Self {
        self.target_mask_attn = Some(mask);
        self
    }
}

impl TransformerDecoderConfig {
    /// A new decoder, initialised as Burn's `TransformerDecoderConfig::init` does.
    pub fn init(&self, device: &Device) -> TransformerDecoder {
        TransformerDecoder {
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

    fn layer(&self, device: &Device) -> TransformerDecoderLayer {
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
        // Burn draws self-attention's weights first, then cross-attention's.
        let self_attn = parts.attention(device);
        let cross_attn = parts.attention(device);
        TransformerDecoderLayer {
            cross_attn,
            self_attn,
            norm_1: parts.norm(device),
            norm_2: parts.norm(device),
            norm_3: parts.norm(device),
            pwff: parts.feed_forward(device),
            dropout: DropoutConfig::new(self.dropout).init(),
            norm_first: self.norm_first,
        }
    }
}

impl From<burn::nn::transformer::TransformerDecoder> for TransformerDecoder {
    fn from(decoder: burn::nn::transformer::TransformerDecoder) -> Self {
        TransformerDecoder {
            layers: decoder.layers.into_iter().map(Into::into).collect(),
            d_model: decoder.d_model,
            d_ff: decoder.d_ff,
            n_heads: decoder.n_heads,
            n_layers: decoder.n_layers,
            dropout: decoder.dropout,
            norm_first: decoder.norm_first,
            quiet_softmax: decoder.quiet_softmax,
        }
    }
}

impl From<burn::nn::transformer::TransformerDecoderLayer> for TransformerDecoderLayer {
    fn from(layer: burn::nn::transformer::TransformerDecoderLayer) -> Self {
        TransformerDecoderLayer {
            cross_attn: layer.cross_attn.into(),
            self_attn: layer.self_attn.into(),
            pwff: layer.pwff.into(),
            norm_1: layer.norm_1,
            norm_2: layer.norm_2,
            norm_3: layer.norm_3,
            dropout: layer.dropout,
            norm_first: layer.norm_first,
        }
    }
}

impl TransformerDecoder {
    /// The target after every layer, `[batch, seq_t, d_model]`.
    pub fn forward(&self, mut input: TransformerDecoderInput) -> Tensor<3> {
        let run = |mut input: TransformerDecoderInput| {
            for (i, layer) in self.layers.iter().enumerate() {
                input = draws::in_layer(i, || layer.forward(input));
            }
            input.target
        };
        let first = self.layers.first();
        let Some(split) = first.and_then(|l| StackSplit::of(&l.self_attn.query.weight)) else {
            return run(input);
        };
        // Sequence or context parallelism: the layers run on this rank's positions of the
        // target and of the memory (the cross-attention's keys and values meet every position
        // of it again).
        input.target = split.split(input.target, "TransformerDecoder (target)");
        input.memory = split.split(input.memory, "TransformerDecoder (memory)");
        let local = input.target.dims()[1];
        split.join(split.run(local, || run(input)))
    }

    /// The plan's rules that split every layer of this decoder at `path` over `tp`: both
    /// attentions by whole heads and the feed-forward's pair, as
    /// [`super::TransformerEncoder::tensor_parallel_rules`] splits an encoder's.
    pub fn tensor_parallel_rules(&self, path: &str) -> Vec<TensorParallelRule> {
        let layer = format!("{path}.layers.*");
        match self.layers.first() {
            None => vec![],
            Some(first) => [
                first
                    .self_attn
                    .tensor_parallel_rules(&format!("{layer}.self_attn")),
                first
                    .cross_attn
                    .tensor_parallel_rules(&format!("{layer}.cross_attn")),
                first.pwff.tensor_parallel_rules(&format!("{layer}.pwff")),
            ]
            .concat(),
        }
    }

    /// The plan's sequence parallelism of this decoder at `path`, as
    /// [`super::TransformerEncoder::sequence_parallel_rules`]'s: it splits its whole target
    /// and memory by sequence and returns the whole target.
    pub fn sequence_parallel_rules(&self, path: &str) -> SequenceParallelRules {
        SequenceParallelRules {
            stack: path.to_string(),
            modules: ["norm_1", "norm_2", "norm_3"]
                .map(|norm| format!("{path}.layers.*.{norm}"))
                .to_vec(),
        }
    }
}

impl TransformerDecoderLayer {
    /// Burn's decoder layer: self-attention, cross-attention over the memory and feed-forward
    /// branches, each with dropout and a residual, normalised before (pre-norm) or after
    /// (post-norm). Returns `input` with its target replaced.
    pub fn forward(&self, mut input: TransformerDecoderInput) -> TransformerDecoderInput {
        draws::mark_layer_kind(draws::DECODER_LAYER);
        let x = input.target;
        let self_in = match self.norm_first {
            true => self.norm_3.forward(x.clone()),
            false => x.clone(),
        };
        let mut attend = MhaInput::self_attn(self_in);
        if let Some(mask) = &input.target_mask_pad {
            attend = attend.mask_pad(mask.clone());
        }
        if let Some(mask) = &input.target_mask_attn {
            attend = attend.mask_attn(mask.clone());
        }
        let mut x = x + self.drop_branch(self.self_attn.forward_context(attend));
        let cross_in = match self.norm_first {
            true => self.norm_1.forward(x.clone()),
            false => {
                x = self.norm_1.forward(x);
                x.clone()
            }
        };
        let memory = input.memory.clone();
        let mut attend = MhaInput::new(cross_in, memory.clone(), memory);
        if let Some(mask) = &input.memory_mask_pad {
            attend = attend.mask_pad(mask.clone());
        }
        if let Some(mask) = &input.memory_mask_attn {
            attend = attend.mask_attn(mask.clone());
        }
        let mut x = x + self.drop_branch(self.cross_attn.forward_context(attend));
        let ff_in = match self.norm_first {
            true => self.norm_2.forward(x.clone()),
            false => {
                x = self.norm_2.forward(x);
                x.clone()
            }
        };
        let x = x + self.drop_branch(self.pwff.forward(ff_in));
        input.target = match self.norm_first {
            true => x,
            false => self.norm_3.forward(x),
        };
        input
    }

    /// Dropout on a branch's output (see [`dropout::drop_residual`]).
    fn drop_branch(&self, branch: Tensor<3>) -> Tensor<3> {
        let query = &self.self_attn.query.weight;
        dropout::drop_residual(&self.dropout, branch, query, "TransformerDecoderLayer")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Distribution;

    /// Burn's decoder and the drop-in built from it compute the same, bit for bit, with a
    /// causal target mask and a padded memory, pre- and post-norm; a record of Burn's loads
    /// into the drop-in (dropout off: it draws from the device).
    #[test]
    fn the_drop_in_decoder_computes_what_burns_does() {
        let _composed = crate::attention_op::hold_kernel_use(flashover_kernels::KernelUse::Auto);
        let device = Device::flex();
        for norm_first in [false, true] {
            let config = burn::nn::transformer::TransformerDecoderConfig::new(16, 32, 4, 2)
                .with_dropout(0.0)
                .with_norm_first(norm_first);
            let burns = config.init(&device);
            let target = Tensor::<3>::random([2, 4, 16], Distribution::Default, &device);
            let memory = Tensor::<3>::random([2, 5, 16], Distribution::Default, &device);
            let causal = burn::nn::attention::generate_autoregressive_mask(2, 4, &device);
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
                burn::nn::transformer::TransformerDecoderInput::new(target.clone(), memory.clone())
                    .target_mask_attn(causal.clone())
                    .memory_mask_pad(pad.clone()),
            );
            let input = || {
                TransformerDecoderInput::new(target.clone(), memory.clone())
                    .target_mask_attn(causal.clone())
                    .memory_mask_pad(pad.clone())
            };
            let loaded = TransformerDecoderConfig::new(16, 32, 4, 2)
                .with_dropout(0.0)
                .with_norm_first(norm_first)
                .init(&device)
                .load_record(burns.clone().into_record());
            let converted = TransformerDecoder::from(burns);
            for ours in [converted, loaded] {
                let got = ours.forward(input());
                got.into_data()
                    .assert_eq(&expected.clone().into_data(), true);
            }
        }
    }
}
