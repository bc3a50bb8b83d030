//! Mixture-of-experts permutation: tokens gathered into per-expert contiguous order from the
//! router's choices, and expert outputs gathered back per token, weighted by the routing
//! weights (a gather on both sides, so no atomics).

use burn::backend::{Backend, Dispatch, Flex, backend_extension, tensor::FloatTensor};
use burn::tensor::{Int, Tensor};
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn_cubecl::CubeBackend;

/// The MoE permutations on a backend's primitives (Flex: the references; CubeCL: the kernels);
/// the entry points are [`permute_rows`] and [`unpermute_rows`].
#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Fusion: cfg(any(feature = "wgpu", feature = "cuda"))
)]
pub trait MoePermuteOps: Backend {
    /// `tokens: [rows, d]`, `order: [n]` (source row as f32) -> `[n, d]`.
    #[fusion(dtype = tokens, shape = burn::tensor::Shape::new([order[0], tokens[1]]))]
    fn permute_rows(tokens: FloatTensor<Self>, order: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `outputs: [n, d]`, `positions: [tokens, k]` (row of `outputs` as f32, negative for a
    /// dropped choice), `weights: [tokens, k]` -> `[tokens, d]`.
    #[fusion(dtype = outputs, shape = burn::tensor::Shape::new([positions[0], outputs[1]]))]
    fn unpermute_rows(
        outputs: FloatTensor<Self>,
        positions: FloatTensor<Self>,
        weights: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

fn index(rows: Tensor<1>) -> Tensor<1, Int> {
    rows.clamp_min(0.0).int()
}

/// [`permute_rows`] in plain Burn tensor operations.
pub fn permute_rows_reference(tokens: Tensor<2>, order: Tensor<1>) -> Tensor<2> {
    tokens.select(0, index(order))
}

/// [`unpermute_rows`] in plain Burn tensor operations.
pub fn unpermute_rows_reference(
    outputs: Tensor<2>,
    positions: Tensor<2>,
    weights: Tensor<2>,
) -> Tensor<2> {
    let [tokens, k] = positions.dims();
    let d = outputs.dims()[1];
    let flat = positions.clone().reshape([tokens * k]);
    let rows = outputs.select(0, index(flat)).reshape([tokens, k, d]);
    let kept = positions.greater_equal_elem(0.0).float();
    let w = (weights * kept).reshape([tokens, k, 1]);
    (rows * w).sum_dim(1).reshape([tokens, d])
}

impl MoePermuteOps for Flex {
    fn permute_rows(tokens: FloatTensor<Self>, order: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::to_flex(permute_rows_reference(
            crate::from_flex(tokens),
            crate::from_flex(order),
        ))
    }

    fn unpermute_rows(
        outputs: FloatTensor<Self>,
        positions: FloatTensor<Self>,
        weights: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        crate::to_flex(unpermute_rows_reference(
            crate::from_flex(outputs),
            crate::from_flex(positions),
            crate::from_flex(weights),
        ))
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl MoePermuteOps for CubeBackend {
    fn permute_rows(tokens: FloatTensor<Self>, order: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::cube::permute_rows(tokens, order)
    }

    fn unpermute_rows(
        outputs: FloatTensor<Self>,
        positions: FloatTensor<Self>,
        weights: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        crate::cube::unpermute_rows(outputs, positions, weights)
    }
}

/// Rows of `tokens: [rows, d]` in the order `order` (source row of each output row, as f32):
/// tokens grouped by expert for dispatch. One kernel launch on CubeCL devices.
pub fn permute_rows(tokens: Tensor<2>, order: Tensor<1>) -> Tensor<2> {
    Tensor::from_dispatch(<Dispatch as MoePermuteOps>::permute_rows(
        tokens.into_dispatch(),
        order.into_dispatch(),
    ))
}

/// Each token's combined expert output: `out[t] = sum_k weights[t, k] * outputs[positions[t,
/// k]]`, skipping dropped choices (negative positions). One kernel launch on CubeCL devices.
pub fn unpermute_rows(outputs: Tensor<2>, positions: Tensor<2>, weights: Tensor<2>) -> Tensor<2> {
    Tensor::from_dispatch(<Dispatch as MoePermuteOps>::unpermute_rows(
        outputs.into_dispatch(),
        positions.into_dispatch(),
        weights.into_dispatch(),
    ))
}
