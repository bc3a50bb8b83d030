//! CubeCL buffers under Burn's operation fusion, which the `wgpu` and `cuda` builds have on as
//! Burn's own defaults do: there a CubeCL-backend tensor is a fused tensor, a handle to the
//! result of operations queued on its stream. Code that works on the buffers themselves (a
//! kernel that is not a backend extension, such as packing, whose inputs are a list; NCCL on
//! device pointers) resolves its inputs (the stream's queued operations run first: a flush of
//! launches, not a wait for the device) and registers its outputs as fused tensors that later
//! operations read.

use burn::backend::Cube;
use burn::backend::fusion::{NoOp, get_client, stream::StreamId};
use burn::backend::ir::{BackendIr, InitOperationIr, OperationIr};
use burn::backend::{TensorMetadata, tensor::FloatTensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

/// The CubeCL tensor a fused tensor's queued operations produce.
pub fn resolve(tensor: FloatTensor<Cube>) -> CubeTensor {
    let client = tensor.client.clone();
    client.resolve_tensor_float::<CubeBackend>(tensor)
}

/// A kernel's output as a fused tensor on its device's fusion stream.
pub fn register(tensor: CubeTensor) -> FloatTensor<Cube> {
    let client = get_client::<CubeBackend>(&tensor.device);
    let (shape, dtype) = (tensor.shape(), tensor.dtype());
    let handle = CubeBackend::float_tensor_handle(tensor);
    let init = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(
            StreamId::current(),
            OperationIr::Init(init),
            NoOp::<CubeBackend>::new(),
        )
        .pop()
        .expect("an init operation has one output")
}
