//! The model: embedding, blocks, final norm, LM head; configuration and presets.

use crate::init;
use crate::layers::{Attention, Block};
use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use flashover_parallel::forward_context::ForwardContext;
use flashover_parallel::moe::{Moe, MoeConfig, SwiGlu};
use flashover_parallel::nn::RmsNorm;
use flashover_parallel::nn::{Embedding, Linear, OutputHead};

/// Configuration of the reference transformer.
#[derive(Config, Debug, PartialEq)]
pub struct TransformerConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub d_model: usize,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Attention heads; must divide `d_model`.
    pub n_heads: usize,
    /// Hidden width of the SwiGLU MLP.
    pub d_ff: usize,
    /// Share the embedding table with the LM head.
    #[config(default = true)]
    pub tie_embeddings: bool,
    /// RoPE base frequency.
    #[config(default = 10000.0)]
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    #[config(default = 1e-5)]
    pub norm_eps: f64,
    /// Mixture-of-experts feed-forward in every block instead of the dense SwiGLU (`d_ff` is
    /// then unused).
    pub moe: Option<MoeConfig>,
}

impl TransformerConfig {
    /// A few thousand parameters: unit and equivalence tests.
    pub fn tiny(vocab_size: usize) -> Self {
        TransformerConfig::new(vocab_size, 32, 2, 4, 64)
    }

    /// About 0.8M parameters at vocab 256: the default `train` job on a laptop CPU.
    pub fn small(vocab_size: usize) -> Self {
        TransformerConfig::new(vocab_size, 128, 4, 4, 344)
    }

    /// About 110M parameters at vocab 32000 (GPT-2 small shape): GPU benchmarks.
    pub fn base(vocab_size: usize) -> Self {
        TransformerConfig::new(vocab_size, 768, 12, 12, 2048)
    }

    /// Checks the shape constraints; the message names the fields.
    pub fn validate(&self) -> Result<(), String> {
        let mut errors = vec![];
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("d_ff", self.d_ff),
        ] {
            if v == 0 {
                errors.push(format!("model.{name} must be at least 1"));
            }
        }
        if self.n_heads > 0 && !self.d_model.is_multiple_of(self.n_heads) {
            errors.push(format!(
                "model.n_heads = {} does not divide model.d_model = {}",
                self.n_heads, self.d_model
            ));
        } else if self.n_heads > 0 && !(self.d_model / self.n_heads).is_multiple_of(2) {
            errors.push(format!(
                "model.d_model / model.n_heads = {} must be even for rotary embeddings",
                self.d_model / self.n_heads
            ));
        }
        if let Some(moe) = &self.moe
            && let Err(e) = moe.validate()
        {
            errors.push(e);
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        let (v, d) = (self.vocab_size, self.d_model);
        v * d
            + self.n_layers * self.num_params_per_block()
            + d
            + if self.tie_embeddings { 0 } else { d * v }
    }

    /// Parameters in one block: attention, feed-forward (dense or every expert) and two norms.
    pub fn num_params_per_block(&self) -> usize {
        let (d, f) = (self.d_model, self.d_ff);
        let ffn = match &self.moe {
            Some(moe) => moe.num_params(d),
            None => 3 * d * f,
        };
        4 * d * d + ffn + 2 * d
    }

    /// How the model is parallelized, as data: the `flashover_parallel::parallelize` plan
    /// (TOML) that splits it as Megatron does, attention by whole heads (q, k, v column-wise,
    /// the output projection row-wise), the MLP by its hidden width (gate and up column-wise,
    /// down row-wise), the token embedding (and an untied head, padded as the embedding) by
    /// vocabulary; and, under
    /// sequence parallelism, the norms between those regions on sequence shards (drop
    /// `sequence_parallel` to keep whole sequences there). Fully sharded units, pipeline
    /// stages and recomputation are the job's choice, not the model's, and are added to it.
    /// A mixture-of-experts block has no MLP rules: its experts are spread over `ep`
    /// (`expert_parallel`), whole on every `tp` rank.
    pub fn plan_toml(&self) -> String {
        let head_dim = self.d_model / self.n_heads.max(1);
        let mut plan = format!(
            r#"sequence_parallel = ["blocks.*.attn_norm", "blocks.*.mlp_norm", "norm"]

[[tensor_parallel]]
style = "colwise"
paths = ["blocks.*.attn.wq", "blocks.*.attn.wk", "blocks.*.attn.wv"]
unit = {head_dim}

[[tensor_parallel]]
style = "rowwise"
paths = ["blocks.*.attn.wo"]
unit = {head_dim}

[[tensor_parallel]]
style = "vocab"
paths = ["embed"]
"#
        );
        match self.moe {
            None => plan.push_str(
                r#"
[[tensor_parallel]]
style = "colwise"
paths = ["blocks.*.mlp.w_gate", "blocks.*.mlp.w_up"]

[[tensor_parallel]]
style = "rowwise"
paths = ["blocks.*.mlp.w_down"]
"#,
            ),
            // Experts whole on every tp rank, spread over ep.
            Some(_) => plan.insert_str(0, "expert_parallel = [\"blocks.*.moe\"]\n"),
        }
        if !self.tie_embeddings {
            plan.push_str(
                r#"
[[tensor_parallel]]
style = "colwise"
paths = ["head"]
padded = true
"#,
            );
        }
        plan
    }

    /// Builds the model with weights drawn from `seed` (see [`init`]). Panics if the config is
    /// invalid: call [`TransformerConfig::validate`] first on user input.
    pub fn init(&self, seed: u64, device: &Device) -> Transformer {
        let experts = self.moe.as_ref().map_or(0, |m| m.n_experts);
        self.init_experts(seed, device, 0..experts)
    }

    /// [`TransformerConfig::init`] holding only experts `experts` of each mixture-of-experts
    /// layer (expert parallelism); each is initialised by its global index, as in the whole model.
    pub fn init_experts(
        &self,
        seed: u64,
        device: &Device,
        experts: std::ops::Range<usize>,
    ) -> Transformer {
        if let Err(e) = self.validate() {
            panic!("invalid transformer config: {e}");
        }
        let (d, f) = (self.d_model, self.d_ff);
        let std = 0.02;
        // Residual-branch outputs are scaled down with depth (GPT-2).
        let out_std = std / (2.0 * self.n_layers as f64).sqrt();
        let swiglu = |name: &str, d: usize, f: usize| SwiGlu {
            w_gate: init::linear(seed, &format!("{name}.w_gate"), d, f, std, device).into(),
            w_up: init::linear(seed, &format!("{name}.w_up"), d, f, std, device).into(),
            w_down: init::linear(seed, &format!("{name}.w_down"), f, d, out_std, device).into(),
        };
        let blocks = (0..self.n_layers)
            .map(|l| {
                let p = |n: &str| format!("blocks.{l}.{n}");
                Block {
                    attn_norm: init::rms_norm(d, self.norm_eps, device),
                    attn: Attention {
                        wq: init::linear(seed, &p("attn.wq"), d, d, std, device).into(),
                        wk: init::linear(seed, &p("attn.wk"), d, d, std, device).into(),
                        wv: init::linear(seed, &p("attn.wv"), d, d, std, device).into(),
                        wo: init::linear(seed, &p("attn.wo"), d, d, out_std, device).into(),
                        n_heads: self.n_heads,
                        head_dim: d / self.n_heads,
                    },
                    mlp_norm: init::rms_norm(d, self.norm_eps, device),
                    mlp: self.moe.is_none().then(|| swiglu(&p("mlp"), d, f)),
                    moe: self.moe.as_ref().map(|moe| Moe {
                        router: init::linear(seed, &p("moe.router"), d, moe.n_experts, std, device),
                        experts: experts
                            .clone()
                            .map(|x| swiglu(&p(&format!("moe.experts.{x}")), d, moe.d_expert))
                            .collect(),
                        shared: moe
                            .shared_expert
                            .then(|| swiglu(&p("moe.shared"), d, moe.d_expert)),
                        first_expert: experts.start,
                        config: moe.clone(),
                        expert_bias: vec![],
                    }),
                }
            })
            .collect();
        Transformer {
            embed: init::embedding(seed, "embed", self.vocab_size, d, std, device).into(),
            blocks,
            norm: init::rms_norm(d, self.norm_eps, device),
            head: (!self.tie_embeddings)
                .then(|| init::linear(seed, "head", d, self.vocab_size, std, device).into()),
            rope_theta: self.rope_theta,
        }
    }
}

/// The decoder-only transformer.
#[derive(Module, Debug)]
pub struct Transformer {
    /// Token embedding `[vocab, d_model]`.
    pub embed: Embedding,
    /// The blocks, in order.
    pub blocks: Vec<Block>,
    /// Final norm.
    pub norm: RmsNorm,
    /// LM head `[d_model, vocab]`; `None` when tied to the embedding.
    pub head: Option<Linear>,
    /// RoPE base frequency.
    pub rope_theta: f64,
}

impl Transformer {
    /// `tokens: [batch, seq]` -> logits `[batch, seq, vocab]`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.forward_with(tokens, &ForwardContext::default())
    }

    /// [`Transformer::forward`] with `ctx`'s dropout and hooks (see [`ForwardContext`]).
    pub fn forward_with(&self, tokens: Tensor<2, Int>, ctx: &ForwardContext) -> Tensor<3> {
        self.logits(self.hidden_states(tokens, ctx))
    }

    /// The mean next-token loss of `tokens` against `targets` (both `[batch, seq]`):
    /// [`crate::next_token_loss`] of [`Transformer::forward_with`]'s logits, or, when a plan
    /// split the head by vocabulary, the vocabulary-parallel loss (a split head never holds
    /// whole logits: [`OutputHead::next_token_loss`]).
    pub fn forward_loss(
        &self,
        tokens: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        ctx: &ForwardContext,
    ) -> Tensor<1> {
        self.head_loss(self.hidden_states(tokens, ctx), targets)
    }

    /// The embedding and every block: `tokens: [batch, seq]` -> the last block's output.
    pub fn hidden_states(&self, tokens: Tensor<2, Int>, ctx: &ForwardContext) -> Tensor<3> {
        self.hidden_states_with(tokens, ctx, |b, h, rope, ctx, layer| {
            b.forward_with(h, rope, ctx, layer)
        })
    }

    /// [`Transformer::hidden_states`] with each block run by `block(block, h, rope, ctx,
    /// layer)` (through `ctx`'s [`crate::CheckpointHook`] as usual): a strategy's way of
    /// running a block.
    pub fn hidden_states_with<F>(
        &self,
        tokens: Tensor<2, Int>,
        ctx: &ForwardContext,
        block: F,
    ) -> Tensor<3>
    where
        F: Fn(&Block, Tensor<3>, &(Tensor<2>, Tensor<2>), &ForwardContext, usize) -> Tensor<3>
            + Clone
            + Send
            + Sync
            + 'static,
    {
        let t = tokens.dims()[1];
        let h = self.embed.forward(tokens);
        let head_dim = self.blocks.first().map_or(2, |b| b.attn.head_dim);
        let rope = ctx.rope_tables(t, head_dim, self.rope_theta, &h.device());
        self.blocks.iter().enumerate().fold(h, |h, (layer, b)| {
            let (rope, block) = (rope.clone(), block.clone());
            let aux_losses = b.moe.is_some();
            ctx.block(layer, b, h, aux_losses, move |b: &Block, h, ctx| {
                block(b, h, &rope, ctx, layer)
            })
        })
    }

    /// The final norm and the loss of its output through the head (see
    /// [`Transformer::forward_loss`]).
    pub fn head_loss(&self, h: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        self.output_head()
            .next_token_loss(self.norm.forward(h), targets)
    }

    /// The LM head: its own layer, or the embedding table when tied.
    pub fn output_head(&self) -> OutputHead<'_> {
        match &self.head {
            Some(head) => OutputHead::Untied(head),
            None => OutputHead::Tied(&self.embed),
        }
    }

    /// Embedding lookup: `[batch, seq]` -> `[batch, seq, d_model]`.
    pub fn embed_tokens(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.embed.forward(tokens)
    }

    /// Final norm and LM head: `[batch, seq, d_model]` -> `[batch, seq, vocab]`.
    pub fn logits(&self, h: Tensor<3>) -> Tensor<3> {
        self.output_head().logits(self.norm.forward(h))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_builds_the_same_model_and_counts_its_parameters() {
        let dev = Device::flex();
        let cfg = TransformerConfig::tiny(16);
        let (a, b) = (cfg.init(3, &dev), cfg.init(3, &dev));
        assert_eq!(
            a.embed.weight.val().into_data(),
            b.embed.weight.val().into_data()
        );
        assert_eq!(a.num_params(), cfg.num_params());
        let untied = TransformerConfig {
            tie_embeddings: false,
            ..cfg.clone()
        };
        assert_eq!(untied.init(3, &dev).num_params(), untied.num_params());
    }

    #[test]
    fn invalid_shapes_are_named() {
        let e = TransformerConfig::new(16, 30, 1, 4, 8)
            .validate()
            .unwrap_err();
        assert!(
            e.contains("model.n_heads = 4 does not divide model.d_model = 30"),
            "{e}"
        );
    }

    #[test]
    fn attention_is_causal() {
        let dev = Device::flex();
        let model = TransformerConfig::tiny(16).init(1, &dev);
        let a = Tensor::<2, Int>::from_ints([[1, 2, 3, 4]], &dev);
        let b = Tensor::<2, Int>::from_ints([[1, 2, 9, 9]], &dev);
        let (la, lb) = (model.forward(a), model.forward(b));
        let first = |l: Tensor<3>| l.narrow(1, 0, 2).into_data().try_to_vec::<f32>().unwrap();
        assert_eq!(
            first(la),
            first(lb),
            "positions 0..2 must not see later tokens"
        );
    }
}
