//! The transformer's layers: causal attention with RoPE, SwiGLU MLP, and the block.

use burn::module::Module;
use burn::tensor::FloatDType;
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Tensor};
use flashover_parallel::dropout::Site;
use flashover_parallel::expert_parallel::MoeForward;
use flashover_parallel::forward_context::ForwardContext;
use flashover_parallel::moe::{Moe, SwiGlu};
use flashover_parallel::nn::RmsNorm;
use flashover_parallel::nn::{Linear, fused_causal_attention};

/// Applies rotary embeddings to `x: [batch, heads, seq, head_dim]` ("rotate half" layout).
fn apply_rope(x: Tensor<4>, cos: &Tensor<2>, sin: &Tensor<2>) -> Tensor<4> {
    let [b, h, t, d] = x.dims();
    let half = d / 2;
    let x1 = x.clone().narrow(3, 0, half);
    let x2 = x.narrow(3, half, half);
    // The tables are built in f32; under a reduced-precision policy they follow `x`.
    let dtype = x1.dtype();
    let cos = cos
        .clone()
        .cast(dtype)
        .reshape([1, 1, t, half])
        .expand([b, h, t, half]);
    let sin = sin
        .clone()
        .cast(dtype)
        .reshape([1, 1, t, half])
        .expand([b, h, t, half]);
    let r1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
    let r2 = x1 * sin + x2 * cos;
    Tensor::cat(vec![r1, r2], 3)
}

/// Causal multi-head self-attention with rotary position embeddings.
///
/// `q, k, v = x Wq, x Wk, x Wv` split into `n_heads` heads of `head_dim`;
/// `out = softmax(q k^T / sqrt(head_dim) + causal mask) v`, heads concatenated, then `Wo`.
#[derive(Module, Debug)]
pub struct Attention {
    /// Query projection `[d_model, n_heads * head_dim]`.
    pub wq: Linear,
    /// Key projection.
    pub wk: Linear,
    /// Value projection.
    pub wv: Linear,
    /// Output projection `[n_heads * head_dim, d_model]`.
    pub wo: Linear,
    /// Heads held by this module (all of them, or a tensor-parallel share). The forward counts
    /// them from the query projection's output width, which a plan's split narrows.
    pub n_heads: usize,
    /// Features per head.
    pub head_dim: usize,
}

impl Attention {
    /// `x: [batch, seq, d_model]` -> `[batch, seq, d_model]`; `rope` from [`crate::rope_tables`].
    pub fn forward(&self, x: Tensor<3>, rope: &(Tensor<2>, Tensor<2>)) -> Tensor<3> {
        self.forward_with(x, rope, &ForwardContext::default(), 0)
    }

    /// [`Attention::forward`] as layer `layer`, with `ctx`'s dropout on the probabilities.
    pub fn forward_with(
        &self,
        x: Tensor<3>,
        rope: &(Tensor<2>, Tensor<2>),
        ctx: &ForwardContext,
        layer: usize,
    ) -> Tensor<3> {
        let [q, k, v] = Linear::forward_shared([&self.wq, &self.wk, &self.wv], x);
        // Heads are counted from the projection's output: a tensor-parallel split holds whole
        // heads, fewer of them. Under sequence parallelism `x` held this rank's positions
        // only and the projections all of them.
        let [b, t, width] = q.dims();
        let (h, hd) = (width / self.head_dim, self.head_dim);
        let split = |y: Tensor<3>| y.reshape([b, t, h, hd]).swap_dims(1, 2);
        let q = apply_rope(split(q), &rope.0, &rope.1);
        let k = apply_rope(split(k), &rope.0, &rope.1);
        let v = split(v);
        if let Some(core) = &ctx.core_attention {
            let out = core.0.attend(q, k, v, ctx, layer);
            return self.wo.forward(out.swap_dims(1, 2).reshape([b, t, h * hd]));
        }
        if ctx.takes_fused_attention(&q.device()) {
            let out = fused_causal_attention(q, k, v);
            return self.wo.forward(out.swap_dims(1, 2).reshape([b, t, h * hd]));
        }
        let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((hd as f64).sqrt());
        // `tril_mask` is true strictly above the diagonal: the future positions to hide.
        let mask = Tensor::<2, Bool>::tril_mask([t, t], 0, &scores.device())
            .reshape([1, 1, t, t])
            .expand([b, h, t, t]);
        // The softmax runs in f32 under reduced precision (as Megatron's fp32 softmax option).
        let dtype = scores.dtype();
        let scores = scores
            .cast(FloatDType::F32)
            .mask_fill(mask, f32::NEG_INFINITY);
        let probs = ctx.attention(softmax(scores, 3).cast(dtype), layer);
        let out = probs.matmul(v).swap_dims(1, 2).reshape([b, t, h * hd]);
        self.wo.forward(out)
    }
}

/// A pre-norm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.
#[derive(Module, Debug)]
pub struct Block {
    /// Norm before attention.
    pub attn_norm: RmsNorm,
    /// Self-attention.
    pub attn: Attention,
    /// Norm before the feed-forward.
    pub mlp_norm: RmsNorm,
    /// Dense feed-forward (`None` in a mixture-of-experts block).
    pub mlp: Option<SwiGlu>,
    /// Mixture-of-experts feed-forward (`None` in a dense block).
    pub moe: Option<Moe>,
}

impl Block {
    /// `x: [batch, seq, d_model]` -> same shape.
    pub fn forward(&self, x: Tensor<3>, rope: &(Tensor<2>, Tensor<2>)) -> Tensor<3> {
        self.forward_with(x, rope, &ForwardContext::default(), 0)
    }

    /// [`Block::forward`] as layer `layer`, with `ctx`'s dropout on the attention
    /// probabilities and on both branches' outputs.
    pub fn forward_with(
        &self,
        x: Tensor<3>,
        rope: &(Tensor<2>, Tensor<2>),
        ctx: &ForwardContext,
        layer: usize,
    ) -> Tensor<3> {
        let x = self.attention_residual(x, rope, ctx, layer);
        self.feed_forward_residual(x, ctx, layer, |block, x| block.feed_forward(x, ctx, layer))
    }

    /// The block's first half: `x + attn(norm(x))`, with `ctx`'s dropout on the branch.
    pub fn attention_residual(
        &self,
        x: Tensor<3>,
        rope: &(Tensor<2>, Tensor<2>),
        ctx: &ForwardContext,
        layer: usize,
    ) -> Tensor<3> {
        let attn = self
            .attn
            .forward_with(self.attn_norm.forward(x.clone()), rope, ctx, layer);
        x + ctx.hidden(attn, layer, Site::AttentionOut)
    }

    /// The block's second half, `x + feed(norm(x))` with `ctx`'s dropout on the branch, where
    /// `feed(block, x)` is the feed-forward ([`Block::feed_forward`], or a strategy's way of
    /// running it).
    pub fn feed_forward_residual(
        &self,
        x: Tensor<3>,
        ctx: &ForwardContext,
        layer: usize,
        feed: impl FnOnce(&Block, Tensor<3>) -> Tensor<3>,
    ) -> Tensor<3> {
        let mlp = feed(self, self.mlp_norm.forward(x.clone()));
        x + ctx.hidden(mlp, layer, Site::MlpOut)
    }

    /// The block's feed-forward (dense or mixture of experts) on normed `x`. A mixture of
    /// experts computes as the plan placed its experts (all here without one,
    /// [`MoeForward`]); `ctx`'s `moe` hook, when it has one, counts its routing as layer
    /// `layer` and collects its auxiliary losses (without one they are not added).
    pub fn feed_forward(&self, x: Tensor<3>, ctx: &ForwardContext, layer: usize) -> Tensor<3> {
        match (&self.moe, &self.mlp) {
            (Some(moe), _) => {
                let (y, aux) = match &ctx.moe {
                    Some(hook) => MoeForward::forward_counted(moe, x, hook, layer),
                    None => MoeForward::forward(moe, x),
                };
                if let (Some(aux), Some(hook)) = (aux, &ctx.moe) {
                    hook.push_aux_loss(aux);
                }
                y
            }
            (None, Some(mlp)) => mlp.forward(x),
            (None, None) => panic!("block {layer} has neither a dense nor an MoE feed-forward"),
        }
    }
}
