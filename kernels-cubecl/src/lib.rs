//! # flashover-kernels: fused operations for the parallel strategies
//!
//! Each operation is a Burn backend extension with two implementations: a plain Burn-tensor
//! reference (what Flex runs, and what the tests compare against) and a CubeCL kernel that
//! does the same in one launch on Burn's CubeCL backend (wgpu, CUDA; with the `wgpu` / `cuda`
//! features). They are forward-only (not differentiable).
//!
//! - [`attention_forward`] / [`attention_backward`]: attention without the score matrix
//!   (FlashAttention's tiled forward with the row log-sum-exp, and its backward recomputing
//!   the probabilities from it).
//! - [`merge_partials`]: the online-softmax merge of two partial attention results with their
//!   log-sum-exps (context parallelism's ring attention).
//! - [`adamw_step`]: AdamW on a flat shard: moments, bias correction, decoupled weight decay
//!   and the update in one pass (ZeRO's sharded optimizer).
//! - [`cross_entropy_pieces`]: per-row maximum, sum of exponentials and target logit over a
//!   vocabulary shard (tensor parallelism's vocabulary-parallel loss).
//! - [`pack_scaled`] / [`unpack_scaled`]: many tensors into one flat buffer and back, scaled on
//!   the way (gradient and parameter buckets: every strategy's host transfers go through them).
//! - [`permute_rows`] / [`unpermute_rows`]: tokens into per-expert order from the router's
//!   choices, and expert outputs back per token weighted by the routing weights (expert
//!   parallelism).
//!
//! ```
//! use burn::tensor::{Device, Tensor};
//! use flashover_kernels::merge_partials;
//!
//! let device = Device::flex();
//! let out_a = Tensor::<2>::from_floats([[1.0, 2.0]], &device);
//! let out_b = Tensor::<2>::from_floats([[3.0, 4.0]], &device);
//! let lse = Tensor::<1>::from_floats([0.0], &device); // equal weights
//! let (out, merged) = merge_partials(out_a, lse.clone(), out_b, lse);
//! assert_eq!(out.into_data().try_to_vec::<f32>().unwrap(), vec![2.0, 3.0]);
//! assert!((merged.into_scalar::<f32>() - 2f32.ln()).abs() < 1e-6);
//! ```
#![warn(missing_docs)]

mod adamw;
mod attention;
mod bucket;
mod cross_entropy;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube_attention;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub mod fusion_bridge;
mod merge;
mod moe;
mod policy;

use burn::backend::{Flex, tensor::FloatTensor};
use burn::tensor::Tensor;

/// Whether `device` (or the device under its autodiff) runs Burn's CubeCL backend, where the
/// kernels launch (always `false` without the `wgpu` / `cuda` features).
pub fn is_cube_device(device: &burn::tensor::Device) -> bool {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        matches!(
            device.clone().inner().as_dispatch(),
            burn::backend::DispatchDevice::Cube(_)
        )
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = device;
        false
    }
}

/// A Flex primitive as a tensor: the reference paths' way in.
fn from_flex<const D: usize>(x: FloatTensor<Flex>) -> Tensor<D> {
    Tensor::from_primitive::<Flex>(x)
}

/// A tensor computed on Flex back to its primitive: the reference paths' way out.
fn to_flex<const D: usize>(t: Tensor<D>) -> FloatTensor<Flex> {
    t.try_into_primitive::<Flex>()
        .expect("a reference path on Flex tensors stays on Flex")
}

pub use adamw::{AdamWScalars, adamw_kernel_launches, adamw_step, adamw_step_reference};
pub use attention::{
    AttentionMask, AttentionOps, KeyPadding, attention_backward, attention_backward_reference,
    attention_delta, attention_forward, attention_forward_reference, attention_kernel_launches,
};
pub use bucket::{
    PACK_GROUP, bucket_kernel_launches, pack_scaled, pack_scaled_reference, unpack_scaled,
    unpack_scaled_reference,
};
pub use cross_entropy::{cross_entropy_pieces, cross_entropy_pieces_reference};
pub use merge::{MergeOps, merge_partials, merge_partials_reference};
pub use moe::{
    MoePermuteOps, permute_rows, permute_rows_reference, unpermute_rows, unpermute_rows_reference,
};
pub use policy::{KernelUse, set_kernel_use, uses_kernels};
