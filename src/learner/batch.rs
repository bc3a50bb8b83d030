//! Cutting a data loader's global batch into the data-parallel ranks' shares.

use burn::tensor::Tensor;
use burn::tensor::kind::Basic;

/// A batch that a data-parallel rank can take its share of: the samples `start..start + len`
/// of it, in order. Implement it for the type your `Batcher` produces (usually a
/// [`Tensor::narrow`] of each field along the batch dimension, [`sample_rows`] below):
///
/// ```
/// use burn::tensor::{Int, Tensor};
/// use flashover::learner::{BatchSlice, sample_rows};
///
/// #[derive(Clone, Debug)]
/// struct ImageBatch {
///     images: Tensor<3>,
///     targets: Tensor<1, Int>,
/// }
///
/// impl BatchSlice for ImageBatch {
///     fn samples(&self) -> usize {
///         self.targets.dims()[0]
///     }
///     fn slice(self, start: usize, len: usize) -> Self {
///         ImageBatch {
///             images: sample_rows(self.images, start, len),
///             targets: sample_rows(self.targets, start, len),
///         }
///     }
/// }
/// ```
pub trait BatchSlice: Sized {
    /// How many samples the batch holds.
    fn samples(&self) -> usize;
    /// Samples `start..start + len` of the batch, as a batch of `len` samples.
    fn slice(self, start: usize, len: usize) -> Self;
}

/// Rows `start..start + len` of `tensor`'s first (batch) dimension.
pub fn sample_rows<const D: usize, K: Basic>(
    tensor: Tensor<D, K>,
    start: usize,
    len: usize,
) -> Tensor<D, K> {
    tensor.narrow(0, start, len)
}
