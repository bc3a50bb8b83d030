//! Moving between a full (single-rank) tensor and its tensor-parallel parts.

use crate::error::ParallelError;
use burn::tensor::Tensor;
use flashover_comm::Group;
use flashover_runtime::TensorCollectives;

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
    Ok(Tensor::from_data(slice.into_data(), &full.device()))
}

/// Every rank's part concatenated along `dim` (collective; values only), cut to `len` along
/// `dim` when given (to drop vocabulary padding).
pub fn gather_parts<const D: usize>(
    part: Tensor<D>,
    dim: usize,
    group: &Group,
    len: Option<usize>,
) -> Result<Tensor<D>, ParallelError> {
    let device = part.device();
    let full = group.all_gather_tensor(part.detach(), dim)?;
    let full = match len {
        Some(len) => full.narrow(dim, 0, len),
        None => full,
    };
    // Through host data: a fresh leaf, ready to become a parameter.
    Ok(Tensor::from_data(full.into_data(), &device))
}
