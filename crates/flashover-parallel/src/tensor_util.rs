//! Small tensor constructors the mechanisms share.

use burn::tensor::{Device, Int, Tensor, TensorData};

/// Row indices as an `Int` tensor on `device` (for `select` and `gather`), shaped `shape`.
pub fn index_tensor<const D: usize>(
    v: &[usize],
    shape: [usize; D],
    device: &Device,
) -> Tensor<D, Int> {
    let data = v.iter().map(|&i| i as i64).collect::<Vec<_>>();
    Tensor::from_data(TensorData::new(data, shape), device)
}
