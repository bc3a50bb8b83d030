//! Attention without the score matrix: FlashAttention's tiled forward (online softmax, the
//! row log-sum-exp kept for backward) and its backward, which recomputes each block of
//! probabilities from that log-sum-exp. Neither holds a `queries x keys` tensor in device
//! memory on the CubeCL backend; the references on Flex are the plain tensor operations.
//!
//! Shapes: `q: [heads, n_q, d]`, `k`, `v: [heads, n_k, d]` (batch and heads flattened), f32.
//! Causal attention aligns the last query with the last key (query `i` sees keys
//! `j <= i + n_k - n_q`), so it needs `n_q <= n_k`. Padding keys ([`KeyPadding`], one row per
//! sample) keep a fixed score, as Burn's `MultiHeadAttention` fills its padding mask.
//!
//! The backward is deterministic: one pass computes the query gradients row by row, another
//! the key and value gradients row by row, each summing over the other side in a fixed order
//! (no atomics), so the same inputs give the same bits run to run.

use burn::backend::{Backend, Dispatch, Flex, backend_extension, tensor::FloatTensor};
use burn::tensor::{Bool, FloatDType, Tensor, TensorData};
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn_cubecl::CubeBackend;

static CUBE_LAUNCHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many attention kernels (forward and backward passes) this process has launched on the
/// CubeCL backend (for tests that check an attention took the fused path).
pub fn attention_kernel_launches() -> usize {
    CUBE_LAUNCHES.load(std::sync::atomic::Ordering::Relaxed)
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) fn count_launch() {
    CUBE_LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Which keys a query attends to, and which are padding.
#[derive(Debug, Clone)]
pub struct AttentionMask {
    /// Causal (see the module docs); `false`: every key.
    pub causal: bool,
    /// Keys that are padding, if any.
    pub padding: Option<KeyPadding>,
}

/// Padding keys: a query's score for them is `score` rather than its scaled dot product (Burn's
/// `MultiHeadAttention` fills its padding mask with its `min_float`, -1e4 by default). So a
/// padding key weighs `exp(score - max)`, zero in f32 beside any real score, and a query whose
/// keys are all padding averages every value, as Burn's does. A padding key's score has no
/// gradient.
#[derive(Debug, Clone)]
pub struct KeyPadding {
    /// `[rows, n_k]`, true where a key is padding. The heads are `rows` samples' heads, sample
    /// by sample (`heads = rows * h`, as `[batch, h, ..]` flattens), so a row masks its
    /// sample's heads.
    pub keys: Tensor<2, Bool>,
    /// The score a padding key takes.
    pub score: f32,
}

impl AttentionMask {
    /// Causal (`true`) or over every key, with no padding.
    pub fn new(causal: bool) -> Self {
        AttentionMask {
            causal,
            padding: None,
        }
    }

    /// The same mask with `keys` (`[rows, n_k]`, see [`KeyPadding`]) as padding that scores
    /// `score`.
    pub fn with_padding(self, keys: Tensor<2, Bool>, score: f32) -> Self {
        AttentionMask {
            padding: Some(KeyPadding { keys, score }),
            ..self
        }
    }

    /// The padding as the backends take it (`AttentionOps`' `padding` and `pad_score`):
    /// `[rows, n_k]` f32, 1 where a key is padding (one row of zeros without padding), and
    /// the score.
    pub fn padding_values(&self, n_k: usize, device: &burn::tensor::Device) -> (Tensor<2>, f32) {
        match &self.padding {
            Some(p) => (p.keys.clone().float().cast(FloatDType::F32), p.score),
            None => (Tensor::zeros([1, n_k], device), 0.0),
        }
    }

    /// The mask a backend's padding values (from [`Self::padding_values`]) stand for.
    pub fn from_values(causal: bool, padding: Tensor<2>, score: f32) -> Self {
        AttentionMask::new(causal).with_padding(padding.greater_elem(0.0), score)
    }
}

/// Attention's forward and backward on a backend's primitives (Flex: the references; CubeCL:
/// the kernels); the entry points are [`attention_forward`] and [`attention_backward`].
#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Fusion: cfg(any(feature = "wgpu", feature = "cuda"))
)]
pub trait AttentionOps: Backend {
    /// `softmax(q k^T scale) v` and each query's log-sum-exp of its scaled scores
    /// (`[heads, n_q]`); `padding` (`[rows, n_k]`, 1 where a key is padding) and `pad_score`
    /// as [`AttentionMask::padding_values`] gives them.
    #[fusion(meta = |q, _k, _v, _padding, _causal, _pad_score, _scale| (
        q.clone(),
        burn::backend::fusion::custom::TensorSpec::new(
            burn::tensor::Shape::new([q.shape[0], q.shape[1]]),
            q.dtype,
        ),
    ))]
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        padding: FloatTensor<Self>,
        causal: bool,
        pad_score: f32,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// The gradients of `q`, `k` and `v` from the forward's `lse`, the output's gradient
    /// `d_out` and each query's `delta` (`[heads, n_q, 1]`, see [`attention_delta`]).
    #[allow(clippy::too_many_arguments)]
    #[fusion(meta = |q, k, v, _padding, _lse, _delta, _d_out, _causal, _pad_score, _scale| (q.clone(), k.clone(), v.clone()))]
    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        padding: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        delta: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        causal: bool,
        pad_score: f32,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// Fails naming the shapes when `q`, `k`, `v` and the mask do not fit together.
fn check_shapes(q: [usize; 3], k: [usize; 3], v: [usize; 3], mask: &AttentionMask) {
    let causal = mask.causal;
    assert!(
        q[0] == k[0] && k == v && q[2] == k[2],
        "attention: q {q:?}, k {k:?} and v {v:?} must be [heads, n, d] with the same heads and \
         d, and k and v of one shape"
    );
    assert!(
        !causal || q[1] <= k[1],
        "attention: causal attention aligns the last query with the last key, so it needs no \
         more queries ({}) than keys ({})",
        q[1],
        k[1]
    );
    if let Some(padding) = &mask.padding {
        let [rows, n_k] = padding.keys.dims();
        assert!(
            n_k == k[1] && rows > 0 && q[0].is_multiple_of(rows),
            "attention: the key padding [{rows}, {n_k}] must have a row per sample whose heads \
             the {} heads are, and a column per key ({})",
            q[0],
            k[1]
        );
    }
}

/// `true` where query `i` may not see key `j`, `[n_q, n_k]`.
fn hidden_keys(
    n_q: usize,
    n_k: usize,
    causal: bool,
    device: &burn::tensor::Device,
) -> Tensor<2, Bool> {
    let offset = n_k - n_q.min(n_k);
    let hidden: Vec<bool> = (0..n_q * n_k)
        .map(|x| causal && x % n_k > x / n_k + offset)
        .collect();
    Tensor::from_data(TensorData::new(hidden, [n_q, n_k]), device)
}

/// The scaled scores, padding keys at their score and hidden keys at a large negative value,
/// `[heads, n_q, n_k]`.
fn scores(q: Tensor<3>, k: Tensor<3>, mask: &AttentionMask, scale: f32) -> Tensor<3> {
    let [heads, n_q, _] = q.dims();
    let n_k = k.dims()[1];
    let mut s = q.matmul(k.swap_dims(1, 2)).mul_scalar(scale);
    if let Some(padding) = &mask.padding {
        let rows = padding.keys.dims()[0];
        let keys = padding.keys.clone().reshape([rows, 1, 1, n_k]);
        s = (s.reshape([rows, heads / rows, n_q, n_k]))
            .mask_fill(keys, padding.score)
            .reshape([heads, n_q, n_k]);
    }
    let hidden = hidden_keys(n_q, n_k, mask.causal, &s.device()).unsqueeze::<3>();
    s.mask_fill(hidden, -1.0e30)
}

/// The forward in plain Burn tensor operations (on any device): `(out, lse)`.
pub fn attention_forward_reference(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    mask: &AttentionMask,
    scale: f32,
) -> (Tensor<3>, Tensor<2>) {
    check_shapes(q.dims(), k.dims(), v.dims(), mask);
    let s = scores(q, k, mask, scale);
    let max = s.clone().max_dim(2);
    let e = (s - max.clone()).exp();
    let sum = e.clone().sum_dim(2);
    // Normalised by the sum, not by `exp(s - lse)`: at a padding score of -1e4, f32 holds lse
    // to 1e-3, which would show in a query whose keys are all padding.
    let p = e / sum.clone();
    let lse = sum.log() + max;
    let [heads, n_q, _] = lse.dims();
    (p.matmul(v), lse.reshape([heads, n_q]))
}

/// Each query's `sum(d_out * out) - d_lse` (`[heads, n_q, 1]`): what the backward subtracts
/// from a probability's gradient before the softmax's, the log-sum-exp's gradient `d_lse`
/// (`[heads, n_q]`, where the caller uses the log-sum-exp) folded in, as `d lse_i / d s_ij =
/// p_ij`.
pub fn attention_delta(out: Tensor<3>, d_out: Tensor<3>, d_lse: Option<Tensor<2>>) -> Tensor<3> {
    let delta = (d_out * out).sum_dim(2);
    match d_lse {
        Some(d_lse) => delta - d_lse.unsqueeze_dim(2),
        None => delta,
    }
}

/// The backward in plain Burn tensor operations (on any device): `(d_q, d_k, d_v)`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_reference(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    lse: Tensor<2>,
    delta: Tensor<3>,
    d_out: Tensor<3>,
    mask: &AttentionMask,
    scale: f32,
) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
    check_shapes(q.dims(), k.dims(), v.dims(), mask);
    let p = (scores(q.clone(), k.clone(), mask, scale) - lse.unsqueeze_dim(2)).exp();
    let d_v = p.clone().swap_dims(1, 2).matmul(d_out.clone());
    let d_p = d_out.matmul(v.swap_dims(1, 2));
    let mut d_s = p * (d_p - delta);
    if let Some(padding) = &mask.padding {
        // A padding key's score is a constant: no gradient flows to its q and k.
        let [heads, n_q, n_k] = d_s.dims();
        let rows = padding.keys.dims()[0];
        let keys = padding.keys.clone().reshape([rows, 1, 1, n_k]);
        d_s = (d_s.reshape([rows, heads / rows, n_q, n_k]))
            .mask_fill(keys, 0.0)
            .reshape([heads, n_q, n_k]);
    }
    let d_q = d_s.clone().matmul(k).mul_scalar(scale);
    let d_k = d_s.swap_dims(1, 2).matmul(q).mul_scalar(scale);
    (d_q, d_k, d_v)
}

impl AttentionOps for Flex {
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        padding: FloatTensor<Self>,
        causal: bool,
        pad_score: f32,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (out, lse) = attention_forward_reference(
            crate::from_flex(q),
            crate::from_flex(k),
            crate::from_flex(v),
            &AttentionMask::from_values(causal, crate::from_flex(padding), pad_score),
            scale,
        );
        (crate::to_flex(out), crate::to_flex(lse))
    }

    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        padding: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        delta: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        causal: bool,
        pad_score: f32,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (d_q, d_k, d_v) = attention_backward_reference(
            crate::from_flex(q),
            crate::from_flex(k),
            crate::from_flex(v),
            crate::from_flex(lse),
            crate::from_flex(delta),
            crate::from_flex(d_out),
            &AttentionMask::from_values(causal, crate::from_flex(padding), pad_score),
            scale,
        );
        (
            crate::to_flex(d_q),
            crate::to_flex(d_k),
            crate::to_flex(d_v),
        )
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl AttentionOps for CubeBackend {
    fn attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        padding: FloatTensor<Self>,
        causal: bool,
        pad_score: f32,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let mask = crate::cube_attention::Mask {
            padding,
            causal,
            pad_score,
        };
        crate::cube_attention::forward(q, k, v, mask, scale)
    }

    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        padding: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        delta: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        causal: bool,
        pad_score: f32,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let mask = crate::cube_attention::Mask {
            padding,
            causal,
            pad_score,
        };
        crate::cube_attention::backward(q, k, v, lse, delta, d_out, mask, scale)
    }
}

/// `softmax(q k^T scale) v` under `mask`, and each query's log-sum-exp (`[heads, n_q]`): the
/// kernel on CubeCL devices (no score matrix), [`attention_forward_reference`] on Flex.
pub fn attention_forward(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    mask: &AttentionMask,
    scale: f32,
) -> (Tensor<3>, Tensor<2>) {
    check_shapes(q.dims(), k.dims(), v.dims(), mask);
    let (padding, pad_score) = mask.padding_values(k.dims()[1], &k.device());
    let (out, lse) = <Dispatch as AttentionOps>::attention_forward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        padding.into_dispatch(),
        mask.causal,
        pad_score,
        scale,
    );
    (Tensor::from_dispatch(out), Tensor::from_dispatch(lse))
}

/// The gradients `(d_q, d_k, d_v)` of [`attention_forward`] from its `lse`, the output's
/// gradient `d_out` and [`attention_delta`]: the kernels on CubeCL devices,
/// [`attention_backward_reference`] on Flex.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    lse: Tensor<2>,
    delta: Tensor<3>,
    d_out: Tensor<3>,
    mask: &AttentionMask,
    scale: f32,
) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
    check_shapes(q.dims(), k.dims(), v.dims(), mask);
    let (padding, pad_score) = mask.padding_values(k.dims()[1], &k.device());
    let (d_q, d_k, d_v) = <Dispatch as AttentionOps>::attention_backward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        padding.into_dispatch(),
        lse.into_dispatch(),
        delta.into_dispatch(),
        d_out.into_dispatch(),
        mask.causal,
        pad_score,
        scale,
    );
    (
        Tensor::from_dispatch(d_q),
        Tensor::from_dispatch(d_k),
        Tensor::from_dispatch(d_v),
    )
}
