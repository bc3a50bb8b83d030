//! Causal attention's core, splittable over `cp` by a plan's `context_parallel` rule.

use crate::forward_context::ForwardContext;
use crate::placed::{ContextSplit, Placed};
use burn::module::{Module, Param};
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Device, Tensor};
use flashover_kernels::AttentionMask;

/// `softmax(q k^T / sqrt(head_dim) + causal mask) v`, the part of self-attention where
/// sequence positions meet. Under a plan's `context_parallel` rule each rank holds some
/// positions of every sequence ([`crate::parallelize::SequenceSplit::share`]), and this
/// core attends over the whole sequence's keys and values: ring attention passes key/value
/// blocks around the `cp` ranks, all-to-all attention swaps the sequence split for a head
/// split. Without the rule (or the axis) it attends locally, as one device does.
///
/// It holds one parameter with no elements, `context`: the plan attaches the sequence split
/// to it, the way it attaches a tensor-parallel split to a [`super::Linear`]'s weight.
#[derive(Module, Debug)]
pub struct CausalAttention {
    /// No elements: carries the plan's sequence split to the forward.
    pub context: Param<Tensor<1>>,
}

impl CausalAttention {
    /// A core on `device`.
    pub fn new(device: &Device) -> Self {
        CausalAttention {
            context: Param::from_tensor(Tensor::zeros([0], device)),
        }
    }

    /// The plan's sequence split, if it made one.
    fn split(&self) -> Option<&ContextSplit> {
        self.context
            .reparameterization::<Placed>()
            .and_then(Placed::context)
    }

    /// The positions in the whole sequence of a `seq`-long local sequence this core attends
    /// over: `0..seq`, or under the plan's `context_parallel` rule this rank's chunks of a
    /// sequence `cp` times as long. For rotary embeddings inside a layer, where the batch's
    /// positions do not reach (a pipeline stage's layers see only activations). Panics, naming
    /// the sizes, when `seq` does not make equal chunks.
    pub fn positions(&self, seq: usize) -> Vec<usize> {
        match self.split() {
            None => (0..seq).collect(),
            Some(split) => split
                .layout(seq * split.group.size())
                .unwrap_or_else(|e| panic!("context-parallel positions: {e}"))
                .positions(split.group.rank()),
        }
    }

    /// `q`, `k`, `v`: `[batch, heads, seq, head_dim]` of this rank's positions (rotary
    /// embeddings applied, if any) -> `[batch, heads, seq, head_dim]`: each query's average
    /// of the values at its own and earlier positions of the whole sequence, weighted by
    /// `softmax(q k^T / sqrt(head_dim))`.
    pub fn forward(&self, q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
        let Some(split) = self.split() else {
            return match takes_fused_attention(&q.device()) {
                true => fused_causal_attention(q, k, v),
                false => local_causal_attention(q, k, v),
            };
        };
        let [_, heads, local, _] = q.dims();
        let cp = split
            .attention(local * split.group.size(), heads)
            .unwrap_or_else(|e| panic!("context-parallel attention: {e}"));
        let ctx = cp.forward_context(ForwardContext::default());
        let core = ctx
            .core_attention
            .clone()
            .expect("a context-parallel forward context has an attention core");
        core.0.attend(q, k, v, &ctx, 0)
    }
}

/// Whether attention on `device` runs as one fused op that makes no `seq x seq` score
/// tensor (FlashAttention's forward and backward: on a CubeCL device where
/// [`flashover_kernels::uses_kernels`] says so, by default a GPU). The composed tensor
/// operations run elsewhere, and wherever dropout applies to the probabilities.
pub fn takes_fused_attention(device: &Device) -> bool {
    crate::attention_op::fuses(device)
}

/// Causal attention over positions all held here, `q`, `k`, `v`: `[batch, heads, seq,
/// head_dim]`, scaled by `1 / sqrt(head_dim)`, as the fused op (see
/// [`takes_fused_attention`]; on Flex it runs the kernels' reference). No dropout.
pub fn fused_causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    crate::attention_op::fused_attention(q, k, v, AttentionMask::new(true)).0
}

/// Causal attention over positions all held here.
fn local_causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    let [b, h, t, d] = q.dims();
    let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((d as f64).sqrt());
    // `tril_mask` is true strictly above the diagonal: the future positions to hide.
    let future = Tensor::<2, Bool>::tril_mask([t, t], 0, &scores.device())
        .reshape([1, 1, t, t])
        .expand([b, h, t, t]);
    softmax(scores.mask_fill(future, f32::NEG_INFINITY), 3).matmul(v)
}
