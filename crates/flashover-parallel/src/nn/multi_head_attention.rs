//! Burn's `MultiHeadAttention`, splittable by whole heads over `tp` and fully shardable.

use super::dropout::{Positions, drop_elements, drops};
use super::sequence_split;
use super::{Linear, LinearConfig};
use crate::context_parallel::{heads_to_sequence, sequence_to_heads};
use crate::placed::{context_split, tp_split};
use crate::plan::TensorParallelRule;
use burn::config::Config;
use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, Gelu, Initializer};
use burn::tensor::activation::{quiet_softmax, softmax};
use burn::tensor::{Bool, Device, Tensor};
use flashover_kernels::AttentionMask;

/// Burn's [`burn::nn::attention::MultiHeadAttentionConfig`] for [`MultiHeadAttention`]: the
/// same fields and defaults.
#[derive(Config, Debug)]
pub struct MultiHeadAttentionConfig {
    /// The model's width (of queries, keys, values and the output).
    pub d_model: usize,
    /// Attention heads; `d_model / n_heads` features each.
    pub n_heads: usize,
    /// Dropout on the attention weights.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// The score masked positions get before the softmax.
    #[config(default = -1.0e4)]
    pub min_float: f64,
    /// Burn's `quiet_softmax` (a softmax that may attend to nothing) instead of the softmax.
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// How the four projections are initialised (Burn's default).
    #[config(
        default = "Initializer::KaimingUniform { gain: 1.0 / 3.0f64.sqrt(), fan_out_only: false }"
    )]
    pub initializer: Initializer,
    /// Whether the key projection has a bias.
    #[config(default = true)]
    pub key_bias: bool,
    /// Whether the value projection has a bias.
    #[config(default = true)]
    pub value_bias: bool,
    /// Whether the query projection has a bias.
    #[config(default = true)]
    pub query_bias: bool,
    /// Whether the output projection has a bias.
    #[config(default = true)]
    pub output_bias: bool,
}

/// Burn's [`burn::nn::attention::MultiHeadAttention`] with the same fields (so the same
/// record), the same initialisation and, on one rank, the same forward. Its projections are
/// [`Linear`], so a plan can split it over `tp` by whole heads
/// ([`Self::tensor_parallel_rules`]): query, key and value column-wise, each rank computing
/// its heads, the output row-wise. It counts its heads from the query projection's width on
/// this rank (`query.d_output() / d_k`), never from `n_heads`, which stays the model's.
/// Inside a stack that splits sequences over `cp` (a plan's `sequence_split_stacks` with a
/// `context_parallel` rule), its input is this rank's positions, and it attends all-to-all:
/// each rank's heads at its positions become every position of its share of the heads, and
/// back after (the heads it computes must divide by `cp`).
///
/// Dropout on the attention weights draws the one-device mask's part of this rank's heads
/// ([`crate::nn::Dropout`]'s draws; without them, a split layer with `dropout > 0` refuses its
/// forward in training).
#[derive(Module, Debug)]
pub struct MultiHeadAttention {
    /// `[d_model, d_model]` (column-wise under `tp`: this rank's heads).
    pub query: Linear,
    /// `[d_model, d_model]` (column-wise under `tp`: this rank's heads).
    pub key: Linear,
    /// `[d_model, d_model]` (column-wise under `tp`: this rank's heads).
    pub value: Linear,
    /// `[d_model, d_model]` (row-wise under `tp`: this rank's heads' rows).
    pub output: Linear,
    /// On the attention weights.
    pub dropout: Dropout,
    /// Unused by the forward; kept because Burn's layer has it (same record).
    pub activation: Gelu,
    /// The model's width.
    pub d_model: usize,
    /// The model's head count (this rank computes `query.d_output() / d_k` of them).
    pub n_heads: usize,
    /// Features per head.
    pub d_k: usize,
    /// The score masked positions get.
    pub min_float: f64,
    /// Whether the softmax may attend to nothing.
    pub quiet_softmax: bool,
}

/// The queries, keys and values of one attention call, and its masks (Burn's `MhaInput`).
#[derive(Debug, Clone)]
pub struct MhaInput {
    query: Tensor<3>,
    key: Tensor<3>,
    value: Tensor<3>,
    /// Built by [`Self::self_attn`]: the three are one tensor, so split projections enter the
    /// tensor-parallel region once for all three.
    shared: bool,
    mask_pad: Option<Tensor<2, Bool>>,
    mask_attn: Option<Tensor<3, Bool>>,
}

impl MhaInput {
    /// Self-attention: queries, keys and values all from `x: [batch, seq, d_model]`.
    pub fn self_attn(x: Tensor<3>) -> Self {
        MhaInput {
            query: x.clone(),
            key: x.clone(),
            value: x,
            shared: true,
            mask_pad: None,
            mask_attn: None,
        }
    }

    /// Queries `[batch, seq_q, d_model]` attending over keys and values `[batch, seq_k,
    /// d_model]`.
    pub fn new(query: Tensor<3>, key: Tensor<3>, value: Tensor<3>) -> Self {
        MhaInput {
            query,
            key,
            value,
            shared: false,
            mask_pad: None,
            mask_attn: None,
        }
    }

    /// Hides the keys where `mask: [batch, seq_k]` is true (padding).
    pub fn mask_pad(mut self, mask: Tensor<2, Bool>) -> Self {
        self.mask_pad = Some(mask);
        self
    }

    /// Hides the scores where `mask: [batch, seq_q, seq_k]` is true.
    pub fn mask_attn(mut self, mask: Tensor<3, Bool>) -> Self {
        self.mask_attn = Some(mask);
        self
    }
}

/// What [`MultiHeadAttention::forward`] returns (Burn's `MhaOutput`).
#[derive(Debug, Clone)]
pub struct MhaOutput {
    /// The attention weights `[batch, heads, seq_q, seq_k]`, after dropout (this rank's heads
    /// under `tp`).
    pub weights: Tensor<4>,
    /// The output `[batch, seq_q, d_model]`.
    pub context: Tensor<3>,
}

impl MultiHeadAttentionConfig {
    /// A new layer, initialised as Burn's `MultiHeadAttentionConfig::init` does (the same
    /// draws in the same order).
    pub fn init(&self, device: &Device) -> MultiHeadAttention {
        let projection = |bias| {
            LinearConfig::new(self.d_model, self.d_model)
                .with_initializer(self.initializer.clone())
                .with_bias(bias)
                .init(device)
        };
        MultiHeadAttention {
            query: projection(self.query_bias),
            key: projection(self.key_bias),
            value: projection(self.value_bias),
            output: projection(self.output_bias),
            dropout: DropoutConfig::new(self.dropout).init(),
            activation: Gelu::new(),
            d_model: self.d_model,
            n_heads: self.n_heads,
            d_k: self.d_model / self.n_heads,
            min_float: self.min_float,
            quiet_softmax: self.quiet_softmax,
        }
    }
}

impl From<burn::nn::attention::MultiHeadAttention> for MultiHeadAttention {
    fn from(mha: burn::nn::attention::MultiHeadAttention) -> Self {
        MultiHeadAttention {
            query: mha.query.into(),
            key: mha.key.into(),
            value: mha.value.into(),
            output: mha.output.into(),
            dropout: mha.dropout,
            activation: mha.activation,
            d_model: mha.d_model,
            n_heads: mha.n_heads,
            d_k: mha.d_k,
            min_float: mha.min_float,
            quiet_softmax: mha.quiet_softmax,
        }
    }
}

impl MultiHeadAttention {
    /// The plan's rules that split this layer at `path` over `tp` by whole heads (`path` may
    /// hold `*` segments, to name the layer in every block): query, key and value column-wise
    /// in units of `d_k`, the output row-wise.
    pub fn tensor_parallel_rules(&self, path: &str) -> Vec<TensorParallelRule> {
        let at = |name: &str| format!("{path}.{name}");
        let (q, k, v, o) = (at("query"), at("key"), at("value"), at("output"));
        vec![
            TensorParallelRule::colwise(&[&q, &k, &v]).in_units(self.d_k),
            TensorParallelRule::rowwise(&[&o]),
        ]
    }

    /// Attention heads this rank computes: `n_heads`, or under `tp` its share of them.
    fn local_heads(&self) -> usize {
        let width = self.query.d_output();
        assert_eq!(
            width % self.d_k,
            0,
            "MultiHeadAttention: the query projection holds {width} features here, not whole \
             heads of {}: split it with MultiHeadAttention::tensor_parallel_rules (in units \
             of d_k)",
            self.d_k
        );
        width / self.d_k
    }

    /// Burn's attention: `softmax(q k^T / sqrt(d_k))` with the masks, dropout on the weights,
    /// times `v`, heads joined and projected. Shapes as Burn's: queries `[batch, seq_q,
    /// d_model]`, keys and values `[batch, seq_k, d_model]` (under sequence parallelism, this
    /// rank's positions of a self-attention input). Under `tp` it computes its
    /// `local_heads` and the output projection sums the ranks' parts.
    pub fn forward(&self, input: MhaInput) -> MhaOutput {
        let (weights, context) = self.attend(input, true);
        MhaOutput {
            weights: weights.expect("the composed attention keeps its weights"),
            context,
        }
    }

    /// [`Self::forward`]'s `context` alone, as Burn's encoder and decoder layers use it. Where
    /// attention takes the fused op on this device ([`crate::nn::takes_fused_attention`]: by
    /// default on a GPU) and the weights need nothing the op lacks (no `mask_attn`, Burn's
    /// softmax rather than `quiet_softmax`, no dropout drawn on them: in eval or at
    /// probability 0), it runs the fused attention: no `[batch, heads, seq_q, seq_k]` tensor in
    /// forward or backward, padding keys scoring `min_float` as [`Self::forward`]'s do.
    /// Otherwise it is [`Self::forward`]'s context.
    pub fn forward_context(&self, input: MhaInput) -> Tensor<3> {
        self.attend(input, false).1
    }

    /// The attention weights (`None` where the fused op ran: only when `keep_weights` is
    /// false) and the projected output.
    fn attend(&self, input: MhaInput, keep_weights: bool) -> (Option<Tensor<4>>, Tensor<3>) {
        let d_model = self.query.d_input();
        for (name, x) in [("query", &input.query), ("key", &input.key)] {
            assert_eq!(
                x.dims()[2],
                d_model,
                "MultiHeadAttention: the {name}'s last dimension is not d_model"
            );
        }
        let [q, k, v] = match input.shared {
            true => Linear::forward_shared([&self.query, &self.key, &self.value], input.query),
            false => [
                self.query.forward(input.query),
                self.key.forward(input.key),
                self.value.forward(input.value),
            ],
        };
        let heads = self.local_heads();
        let [batch, seq_q, width] = q.dims();
        let by_heads = |x: Tensor<3>| {
            let [b, s, _] = x.dims();
            x.reshape([b, s, heads, self.d_k]).swap_dims(1, 2)
        };
        let [mut q, mut k, mut v] = [q, k, v].map(by_heads);
        // This rank's heads are heads `rank * heads..` of the whole layer's over tp.
        let mut first_head = tp_split(&self.query.weight).map_or(0, |s| s.group.rank() * heads);
        let cp = context_split(&self.query.weight);
        if let Some(split) = cp {
            // In a stack splitting sequences over cp: this rank's positions of its heads
            // become every position of its share of them (all-to-all), and back after.
            sequence_split::refuse_outside_stack(&self.query.weight);
            let n = split.group.size();
            assert!(
                heads.is_multiple_of(n),
                "MultiHeadAttention: all-to-all attention over cp={n} splits the {heads} heads \
                 this rank computes, which do not divide by {n}: use a head count divisible by \
                 cp (x tp)"
            );
            first_head += split.group.rank() * heads / n;
            [q, k, v] = [q, k, v].map(|x| sequence_to_heads(x, &split.group));
        }
        let [_, heads_here, n_q, _] = q.dims();
        let scores = (batch * heads_here * n_q * k.dims()[2]) as u64;
        let fused = !keep_weights
            && input.mask_attn.is_none()
            && !self.quiet_softmax
            && !drops(self.dropout.prob, &self.dropout.training, &q.device())
            && super::takes_fused_attention(&q.device());
        let (weights, mut context) = match fused {
            true => {
                let mask = match input.mask_pad {
                    Some(pad) => AttentionMask::new(false).with_padding(pad, self.min_float as f32),
                    None => AttentionMask::new(false),
                };
                (None, crate::attention_op::fused_attention(q, k, v, mask).0)
            }
            false => {
                let scores = q.matmul(k.transpose()).div_scalar((self.d_k as f32).sqrt());
                let weights = self.weights(scores, input.mask_pad, input.mask_attn, first_head);
                (Some(weights.clone()), weights.matmul(v))
            }
        };
        if let Some(split) = cp {
            split.count_scores(scores);
            context = heads_to_sequence(context, &split.group);
        }
        let context = context.swap_dims(1, 2).reshape([batch, seq_q, width]);
        (weights, self.output.forward(context))
    }

    /// The masked softmax of `scores: [batch, heads, seq_q, seq_k]` of the layer's heads
    /// from `first_head`, with dropout.
    fn weights(
        &self,
        mut scores: Tensor<4>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
        first_head: usize,
    ) -> Tensor<4> {
        if let Some(mask) = mask_pad {
            let [batch, seq_k] = mask.dims();
            scores = scores.mask_fill(mask.reshape([batch, 1, 1, seq_k]), self.min_float);
        }
        if let Some(mask) = mask_attn {
            let [batch, seq_q, seq_k] = mask.dims();
            scores = scores.mask_fill(mask.reshape([batch, 1, seq_q, seq_k]), self.min_float);
        }
        let weights = match self.quiet_softmax {
            true => quiet_softmax(scores, 3),
            false => softmax(scores, 3),
        };
        let split = tp_split(&self.query.weight).map(|s| ("MultiHeadAttention", s.group.size()));
        let dropout = &self.dropout;
        drop_elements(
            dropout.prob,
            &dropout.training,
            weights,
            [0, first_head, 0, 0],
            Positions::Whole,
            split,
        )
    }
}
