//! Attention as one differentiable operation whose forward and backward are
//! `flashover_kernels`' attention kernels: on a CubeCL device no `queries x keys` tensor is
//! made, in forward or backward, and backward keeps only `q`, `k`, `v`, the output and each
//! query's log-sum-exp (FlashAttention's recipe). Flex runs the kernels' references.
//!
//! Burn's custom ops have one output each, so the op's output packs the attention and the
//! log-sum-exp side by side (`[heads, queries, head_dim + 1]`): a caller that merges blocks by
//! their log-sum-exps (ring attention) hands both gradients to the one backward, which folds
//! the log-sum-exp's into each query's delta (`flashover_kernels::attention_delta`).
//!
//! Not taken (the composed tensor operations run instead, their results the same): where
//! dropout applies to the attention probabilities (the kernels draw no masks), and where
//! [`flashover_kernels::uses_kernels`] says no (by default, off a GPU).

use crate::collective_op::{from_tensor, to_tensor};
use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension, tensor::FloatTensor};
use burn::tensor::{DType, FloatDType, Tensor};
use burn_dispatch::{DispatchKindConversion, DispatchTensor};
use flashover_kernels::{AttentionMask, attention_backward, attention_delta, attention_forward};

#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub trait FusedAttentionOps: Backend {
    /// `q: [heads, n_q, d]`, `k`, `v: [heads, n_k, d]` -> the attention and each query's
    /// log-sum-exp side by side, `[heads, n_q, d + 1]` (see the module docs), differentiable
    /// in `q`, `k` and `v`. `padding`: `[rows, n_k]`, 1 where a key is padding (its score is
    /// `pad_score`; a row of zeros for none), see `flashover_kernels::KeyPadding`.
    #[allow(clippy::too_many_arguments)]
    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        padding: FloatTensor<Self>,
        causal: bool,
        pad_score: f32,
        scale: f32,
    ) -> FloatTensor<Self>;
}

/// The kernels' forward on untracked tensors: `(packed, out, lse)`.
fn forward(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    mask: &AttentionMask,
    scale: f32,
) -> (Tensor<3>, Tensor<3>, Tensor<2>) {
    let (out, lse) = attention_forward(q, k, v, mask, scale);
    let packed = Tensor::cat(vec![out.clone(), lse.clone().unsqueeze_dim(2)], 2);
    (packed, out, lse)
}

crate::collective_op::for_inner_backends! {
    impl FusedAttentionOps {
        fn fused_attention(
            q: FloatTensor<Self>,
            k: FloatTensor<Self>,
            v: FloatTensor<Self>,
            padding: FloatTensor<Self>,
            causal: bool,
            pad_score: f32,
            scale: f32,
        ) -> FloatTensor<Self> {
            let [q, k, v] = [q, k, v].map(to_tensor::<Self, 3>);
            let mask = AttentionMask::from_values(causal, to_tensor::<Self, 2>(padding), pad_score);
            from_tensor::<Self, 3>(forward(q, k, v, &mask, scale).0)
        }
    }
}

/// The op's backward: the kernels' from `q`, `k`, `v`, the output and the log-sum-exp.
#[derive(Debug)]
struct AttentionBackward;

/// `(q, k, v, out, lse, padding, (causal, pad_score, scale))`, on the inner backend.
type AttentionState<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    (bool, f32, f32),
);

impl<B: Backend> Backward<B, 3> for AttentionBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = AttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (q, k, v, out, lse, padding, (causal, pad_score, scale)) = ops.state;
        let packed: Tensor<3> = to_tensor::<B, 3>(grads.consume::<B>(&ops.node));
        let width = packed.dims()[2] - 1;
        let d_out = packed.clone().narrow(2, 0, width);
        let d_lse = packed.narrow(2, width, 1).squeeze_dim::<2>(2);
        let delta = attention_delta(to_tensor::<B, 3>(out), d_out.clone(), Some(d_lse));
        let [q, k, v] = [q, k, v].map(to_tensor::<B, 3>);
        let lse = to_tensor::<B, 2>(lse);
        let mask = AttentionMask::from_values(causal, to_tensor::<B, 2>(padding), pad_score);
        let (d_q, d_k, d_v) = attention_backward(q, k, v, lse, delta, d_out, &mask, scale);
        for (parent, grad) in ops.parents.into_iter().zip([d_q, d_k, d_v]) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, from_tensor::<B, 3>(grad));
            }
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> FusedAttentionOps for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        padding: FloatTensor<Self>,
        causal: bool,
        pad_score: f32,
        scale: f32,
    ) -> FloatTensor<Self> {
        let nodes = [q.node(), k.node(), v.node()];
        let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
        // A mask, never differentiated.
        let padding = padding.into_primitive();
        let [tq, tk, tv] = [&q, &k, &v].map(|t| to_tensor::<B, 3>(t.clone()));
        let mask =
            AttentionMask::from_values(causal, to_tensor::<B, 2>(padding.clone()), pad_score);
        let (packed, out, lse) = forward(tq, tk, tv, &mask, scale);
        let packed = from_tensor::<B, 3>(packed);
        match AttentionBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = (
                    q,
                    k,
                    v,
                    from_tensor::<B, 3>(out),
                    from_tensor::<B, 2>(lse),
                    padding,
                    (causal, pad_score, scale),
                );
                prep.finish(state, packed)
            }
            OpsKind::UnTracked(prep) => prep.finish(packed),
        }
    }
}

/// Whether attention on `device` takes the fused op (see the module docs for where not).
pub(crate) fn fuses(device: &burn::tensor::Device) -> bool {
    flashover_kernels::uses_kernels(device)
}

/// Attention of `q` over `k`, `v` (`[batch, heads, len, head_dim]`), scaled by
/// `1 / sqrt(head_dim)`, over the keys `mask` says (its padding `[batch, n_k]`), as the fused
/// op: `(out, lse)`, the output
/// `[batch, heads, n_q, head_dim]` in `q`'s dtype and each query's log-sum-exp `[batch,
/// heads, n_q, 1]`. Reduced-precision inputs are computed in f32 (the kernels' dtype) and the
/// output cast back.
pub(crate) fn fused_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: AttentionMask,
) -> (Tensor<4>, Tensor<4>) {
    let [b, h, n_q, d] = q.dims();
    let n_k = k.dims()[2];
    let dtype = q.dtype();
    let flat = |t: Tensor<4>, n: usize| {
        let t = t.reshape([b * h, n, d]);
        match t.dtype() == DType::F32 {
            true => t,
            false => t.cast(FloatDType::F32),
        }
    };
    let (padding, pad_score) = mask.padding_values(n_k, &k.device());
    let packed = Tensor::<3>::from_dispatch(<Dispatch as FusedAttentionOps>::fused_attention(
        flat(q, n_q).into_dispatch(),
        flat(k, n_k).into_dispatch(),
        flat(v, n_k).into_dispatch(),
        padding.into_dispatch(),
        mask.causal,
        pad_score,
        1.0 / (d as f32).sqrt(),
    ));
    let back = |t: Tensor<3>| match dtype == DType::F32 {
        true => t,
        false => t.cast(dtype),
    };
    let out = back(packed.clone().narrow(2, 0, d)).reshape([b, h, n_q, d]);
    let lse = back(packed.narrow(2, d, 1)).reshape([b, h, n_q, 1]);
    (out, lse)
}

/// `flashover_kernels`' process-wide kernel use, held by a test that sets it or depends on
/// it (kernel launches counted; a Flex result compared bit for bit with Burn's composed
/// operations, which `KernelUse::Always` would replace by the kernels' references): tests
/// holding it run one at a time, and each leaves the default (`Auto`) behind.
#[cfg(test)]
pub(crate) struct KernelUseHeld(#[allow(dead_code)] std::sync::MutexGuard<'static, ()>);

#[cfg(test)]
impl Drop for KernelUseHeld {
    fn drop(&mut self) {
        flashover_kernels::set_kernel_use(flashover_kernels::KernelUse::Auto);
    }
}

/// Holds the kernel use for a test ([`KernelUseHeld`]), waiting for the test holding it, and
/// sets it to `policy`.
#[cfg(test)]
pub(crate) fn hold_kernel_use(policy: flashover_kernels::KernelUse) -> KernelUseHeld {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let held = KernelUseHeld(
        SERIAL
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()),
    );
    flashover_kernels::set_kernel_use(policy);
    held
}
