//! Moving between a full (single-rank) tensor and its tensor-parallel parts.

use crate::error::ParallelError;
use burn::tensor::Tensor;
use flashover_runtime::transfers::{Cause, read};

/// Part `rank` of `n` equal parts of `full` along `dim` (outside any graph); fails with the
/// shape when `dim` does not divide.
pub fn split_dim<const D: usize>(
    full: &Tensor<D>,
    dim: usize,
    rank: usize,
    n: usize,
) -> Result<Tensor<D>, ParallelError> {
    let dims = full.dims();
    if !dims[dim].is_multiple_of(n) {
        return Err(ParallelError::Invalid(format!(
            "a tensor of shape {dims:?} cannot be split into {n} tensor-parallel parts along \
             dim {dim}: {} does not divide by {n}",
            dims[dim]
        )));
    }
    let part = dims[dim] / n;
    // Through host data: a fresh leaf, ready to become a parameter.
    let slice = full.clone().detach().narrow(dim, rank * part, part);
    Ok(Tensor::from_data(read(slice, Cause::SetUp), &full.device()))
}
