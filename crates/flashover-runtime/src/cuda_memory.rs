//! Burn CUDA tensors straight into an engine's device collectives (NCCL): the tensor's buffer
//! is reduced or broadcast in place on its GPU, with no copy through host memory.
//!
//! The tensor's primitive is burn-cubecl's `CubeTensor`; the buffer's `CUdeviceptr` comes from
//! `ComputeClient::get_resource` with the CUDA server's storage (the resource must stay alive
//! while NCCL runs). Burn's CUDA stream is private, so the client is synchronised before NCCL
//! reads the buffer; the engine synchronises its own stream before returning, so Burn's next
//! kernel sees the result. A buffer shared with another tensor (`can_mut` false) is copied on
//! the device first: Burn's tensors are values, and writing in place must not change another.
//!
//! Written against Burn 0.22.1 (burn-cubecl) and cubecl-cuda 0.11.3. It is compiled only with
//! the `cuda` feature, which cannot build where it was written (cubecl-cuda's build script
//! downloads LLVM), so it has been neither compiled nor run; without the feature, CUDA tensors
//! take the host-staged path of [`crate::TensorCollectives`], which is tested.

use burn::backend::{Cube, TensorMetadata};
use burn::tensor::Tensor;
use burn_cubecl::CubeDevice;
use burn_cubecl::tensor::CubeTensor;
use cubecl_cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use flashover_comm::{CommResult, DType, DeviceCollectives, ReduceOp};

/// What to run on the buffer.
#[derive(Clone, Copy)]
pub(crate) enum InPlace {
    /// Reduce over the group.
    AllReduce(ReduceOp),
    /// Take `root`'s values.
    Broadcast(usize),
}

/// `tensor` after `op` over the group, computed in place on its GPU; `None` when the tensor is
/// not a (non-autodiff) CUDA tensor on the communicator's GPU, or its buffer cannot be reached:
/// the caller then stages it through host memory.
pub(crate) fn in_place<const D: usize>(
    device: &dyn DeviceCollectives,
    tensor: &Tensor<D>,
    dtype: DType,
    op: InPlace,
) -> Option<CommResult<Tensor<D>>> {
    let primitive: CubeTensor = tensor.clone().try_into_primitive::<Cube>().ok()?;
    match &primitive.device {
        CubeDevice::Cuda(cuda) if cuda.index == device.device_ordinal() => {}
        _ => return None,
    }
    // Contiguous and not shared with any other tensor: NCCL writes every element in place.
    let primitive = burn_cubecl::kernel::into_contiguous(primitive);
    let primitive = if primitive.can_mut() {
        primitive
    } else {
        primitive.copy()
    };
    // Every kernel that wrote the buffer has finished before NCCL reads it.
    burn::tensor::read_sync(primitive.client.sync()).ok()?;
    let resource = primitive
        .client
        .get_resource::<<CudaRuntime as Runtime>::Server>(primitive.handle.clone())
        .ok()?;
    let ptr = resource.resource().ptr;
    let count = primitive.shape().num_elements();
    // SAFETY: `ptr` is this tensor's contiguous buffer of `count` elements of `dtype` on the
    // communicator's GPU (checked above), nothing else holds it (`can_mut`, or a fresh copy),
    // Burn's writes to it are complete (synchronised), and `resource` keeps it alive until the
    // engine returns with its own stream synchronised.
    let result = unsafe {
        match op {
            InPlace::AllReduce(op) => device.all_reduce_device(ptr, count, dtype, op),
            InPlace::Broadcast(root) => device.broadcast_device(ptr, count, dtype, root),
        }
    };
    drop(resource);
    Some(result.map(|()| Tensor::from_primitive::<Cube>(primitive)))
}
