//! The online-softmax merge: two partial attention results over disjoint key blocks, each
//! with the log of its softmax denominator, combined into the result over the union.

use burn::backend::{Backend, Dispatch, Flex, backend_extension, tensor::FloatTensor};
use burn::tensor::Tensor;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn_cubecl::CubeBackend;

/// The online-softmax merge on a backend's primitives (Flex: the reference; CubeCL: the
/// kernel); the entry point is [`merge_partials`].
#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Fusion: cfg(any(feature = "wgpu", feature = "cuda"))
)]
pub trait MergeOps: Backend {
    /// `out_*: [rows, width]`, `lse_*: [rows]` -> the merged `(out, lse)`.
    #[fusion(meta = |out_a, lse_a, _out_b, _lse_b| (out_a.clone(), lse_a.clone()))]
    fn merge_partials(
        out_a: FloatTensor<Self>,
        lse_a: FloatTensor<Self>,
        out_b: FloatTensor<Self>,
        lse_b: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// The merge in plain Burn tensor operations (on any device).
pub fn merge_partials_reference(
    out_a: Tensor<2>,
    lse_a: Tensor<1>,
    out_b: Tensor<2>,
    lse_b: Tensor<1>,
) -> (Tensor<2>, Tensor<1>) {
    let rows = lse_a.dims()[0];
    let max = lse_a.clone().max_pair(lse_b.clone());
    let wa = (lse_a - max.clone()).exp();
    let wb = (lse_b - max.clone()).exp();
    let sum = wa.clone() + wb.clone();
    let col = |w: Tensor<1>| (w / sum.clone()).reshape([rows, 1]);
    let out = out_a * col(wa) + out_b * col(wb);
    (out, max + sum.log())
}

impl MergeOps for Flex {
    fn merge_partials(
        out_a: FloatTensor<Self>,
        lse_a: FloatTensor<Self>,
        out_b: FloatTensor<Self>,
        lse_b: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (out, lse) = merge_partials_reference(
            crate::from_flex(out_a),
            crate::from_flex(lse_a),
            crate::from_flex(out_b),
            crate::from_flex(lse_b),
        );
        (crate::to_flex(out), crate::to_flex(lse))
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl MergeOps for CubeBackend {
    fn merge_partials(
        out_a: FloatTensor<Self>,
        lse_a: FloatTensor<Self>,
        out_b: FloatTensor<Self>,
        lse_b: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        crate::cube::merge_partials(out_a, lse_a, out_b, lse_b)
    }
}

/// Merges `(out_a, lse_a)` and `(out_b, lse_b)`: `out = out_a exp(lse_a - lse) + out_b
/// exp(lse_b - lse)` with `lse = log(exp(lse_a) + exp(lse_b))`, row by row. One kernel launch
/// on CubeCL devices; [`merge_partials_reference`] on Flex.
pub fn merge_partials(
    out_a: Tensor<2>,
    lse_a: Tensor<1>,
    out_b: Tensor<2>,
    lse_b: Tensor<1>,
) -> (Tensor<2>, Tensor<1>) {
    let (out, lse) = <Dispatch as MergeOps>::merge_partials(
        out_a.into_dispatch(),
        lse_a.into_dispatch(),
        out_b.into_dispatch(),
        lse_b.into_dispatch(),
    );
    (Tensor::from_dispatch(out), Tensor::from_dispatch(lse))
}
