//! Host access to tensor primitives on any backend: the custom ops (tensor-parallel operators,
//! gradient hooks, recomputation, ZeRO-3 gathers, deferred weight gradients) read a tensor's
//! values, run host code (a collective) and write the result back on the same device. Written
//! against Burn's backend traits, so one implementation serves Flex and the CubeCL backend
//! (wgpu, CUDA). On a GPU the values pass through host memory: correct everywhere, not the
//! zero-copy path NCCL on device pointers would give.

use burn::backend::{Backend, tensor::FloatTensor};
use burn::tensor::TensorData;
use flashover_runtime::transfers::{self, Cause};

/// The values of `x`, waiting for the device (counted as a transfer for `cause`).
pub(crate) fn read<B: Backend>(x: FloatTensor<B>, cause: Cause) -> TensorData {
    let data =
        burn::tensor::read_sync(B::float_into_data(x)).expect("reading a tensor to the host");
    transfers::to_host(cause, data.as_bytes().len());
    data
}

/// `data` as a tensor on `device` (counted as a transfer for `cause`).
pub(crate) fn write<B: Backend>(
    data: TensorData,
    device: &B::Device,
    cause: Cause,
) -> FloatTensor<B> {
    transfers::to_device(cause, data.as_bytes().len());
    B::float_from_data(data, device)
}
