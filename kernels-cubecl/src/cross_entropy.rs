//! The per-row pieces of a vocabulary-parallel cross-entropy over one rank's vocabulary shard:
//! the maximum logit, the sum of exponentials shifted by it, and the target's logit.

use burn::backend::{Backend, Dispatch, Flex, backend_extension, tensor::FloatTensor};
use burn::tensor::{Int, Tensor};
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn_cubecl::CubeBackend;

#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Fusion: cfg(any(feature = "wgpu", feature = "cuda"))
)]
pub trait CrossEntropyOps: Backend {
    /// `logits: [rows, v]`, `targets: [rows]` (local column as f32, negative where the target
    /// is on another rank) -> `(max, sum_exp, target_logit)`, each `[rows]`.
    #[fusion(meta = |_logits, targets| (targets.clone(), targets.clone(), targets.clone()))]
    fn cross_entropy_pieces(
        logits: FloatTensor<Self>,
        targets: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// The pieces in plain Burn tensor operations (on any device).
pub fn cross_entropy_pieces_reference(
    logits: Tensor<2>,
    targets: Tensor<1>,
) -> (Tensor<1>, Tensor<1>, Tensor<1>) {
    let [rows, _] = logits.dims();
    let max = logits.clone().max_dim(1); // [rows, 1]
    let sum = (logits.clone() - max.clone()).exp().sum_dim(1);
    let held = targets.clone().greater_equal_elem(0.0);
    let index: Tensor<2, Int> = targets.clamp_min(0.0).int().reshape([rows, 1]);
    let picked = logits.gather(1, index).reshape([rows]);
    let target = picked.mask_fill(held.bool_not(), 0.0);
    (max.reshape([rows]), sum.reshape([rows]), target)
}

impl CrossEntropyOps for Flex {
    fn cross_entropy_pieces(
        logits: FloatTensor<Self>,
        targets: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (max, sum, target) =
            cross_entropy_pieces_reference(crate::from_flex(logits), crate::from_flex(targets));
        (
            crate::to_flex(max),
            crate::to_flex(sum),
            crate::to_flex(target),
        )
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl CrossEntropyOps for CubeBackend {
    fn cross_entropy_pieces(
        logits: FloatTensor<Self>,
        targets: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        crate::cube::cross_entropy_pieces(logits, targets)
    }
}

/// Per row of `logits: [rows, v]` (this rank's vocabulary columns): the maximum, the sum of
/// `exp(logit - max)`, and the logit at `targets` (local column as f32; 0 where negative, the
/// target being another rank's). One pass over the logits on CubeCL devices;
/// [`cross_entropy_pieces_reference`] on Flex.
pub fn cross_entropy_pieces(
    logits: Tensor<2>,
    targets: Tensor<1>,
) -> (Tensor<1>, Tensor<1>, Tensor<1>) {
    let (max, sum, target) = <Dispatch as CrossEntropyOps>::cross_entropy_pieces(
        logits.into_dispatch(),
        targets.into_dispatch(),
    );
    (
        Tensor::from_dispatch(max),
        Tensor::from_dispatch(sum),
        Tensor::from_dispatch(target),
    )
}
