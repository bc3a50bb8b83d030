//! Burn CUDA tensors straight into an engine's device collectives (NCCL): each collective reads
//! and writes the tensors' buffers on their GPU, with no copy through host memory.
//!
//! **Not in use: wrong on an H200.** Run there (`cuda_collectives`, world size 1), every
//! out-of-place operation (all-gather, reduce-scatter, all-to-all) read back values that were
//! neither NCCL's result nor the output's zero fill; at world size 1 the in-place all-reduce and
//! broadcast are identities, so their passing proves nothing. The likeliest cause is that the
//! address taken below is not where Burn reads the tensor from; not yet found. Unchecked leads
//! in cubecl-server 0.11.3: allocations are materialised lazily and outdated pools relocated,
//! and a handle's stream need not be the one `client.sync()` waits for. `nccl_check` now runs
//! the same pointer operations on memory it allocates itself, which tells the engine's side
//! from Burn's on the next GPU run. So
//! [`crate::TensorCollectives`] stages CUDA tensors through host memory, which is correct
//! (every layout matched one rank on that GPU), and this module is public only so that
//! `scripts/gpu_check.sh` keeps checking it on every GPU run until it is fixed.
//!
//! How it works: the tensor's primitive is burn-cubecl's `CubeTensor`; the buffer's
//! `CUdeviceptr` comes from `ComputeClient::get_resource` with the CUDA server's storage (the
//! resource keeps the buffer in place while NCCL runs). Burn's CUDA stream is private, so the
//! client is synchronised before NCCL reads or writes (a device-wide wait, not an event: Burn
//! 0.22.1 hands out no stream); the engine synchronises its own stream before returning.
//! Outputs are fresh zero-filled tensors; an in-place operation on a buffer shared with another
//! tensor (`can_mut` false) first copies it on the device, since Burn's tensors are values. Any
//! step that cannot be taken (not a CUDA tensor on the communicator's GPU, a buffer Burn will
//! not hand out) returns `None`.

use burn::backend::{Cube, TensorMetadata};
use burn::tensor::{DType as BurnDType, Device, Tensor};
use burn_cubecl::CubeDevice;
use burn_cubecl::tensor::CubeTensor;
use cubecl_cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use flashover_comm::{CommResult, DType, DeviceCollectives, ReduceOp};

/// What runs on the tensors' buffers; counts are elements of the tensor's dtype.
pub enum DeviceOp<'a> {
    /// In place: reduce over the group.
    AllReduce(ReduceOp),
    /// In place: take `root`'s values.
    Broadcast(usize),
    /// Every rank's tensor end to end along dim 0.
    AllGather,
    /// This rank's block (along dim 0) of the reduction.
    ReduceScatter(ReduceOp),
    /// Rows (dim 0) to and from every rank.
    AllToAll {
        /// Rows sent to each rank.
        send_rows: &'a [usize],
        /// Rows received from each rank.
        recv_rows: &'a [usize],
    },
}

/// The CUDA primitive of `tensor` if it lives on the communicator's GPU, contiguous.
fn on_gpu<const D: usize>(
    device: &dyn DeviceCollectives,
    tensor: &Tensor<D>,
) -> Option<CubeTensor> {
    let primitive: CubeTensor = tensor.clone().try_into_primitive::<Cube>().ok()?;
    match &primitive.device {
        CubeDevice::Cuda(cuda) if cuda.index == device.device_ordinal() => {}
        _ => return None,
    }
    Some(burn_cubecl::kernel::into_contiguous(primitive))
}

/// Runs `f` with the device address of each buffer, every one kept in place until it returns.
fn with_pointers<R>(buffers: &[&CubeTensor], f: impl FnOnce(&[u64]) -> R) -> Option<R> {
    let mut held = Vec::with_capacity(buffers.len());
    for b in buffers {
        let resource = b
            .client
            .get_resource::<<CudaRuntime as Runtime>::Server>(b.handle.clone())
            .ok()?;
        held.push(resource);
    }
    let pointers: Vec<u64> = held.iter().map(|r| r.resource().ptr).collect();
    let out = f(&pointers);
    drop(held);
    Some(out)
}

/// A fresh zero-filled tensor of `shape` and `dtype` on `device`, as a CUDA primitive.
fn fresh<const D: usize>(
    shape: [usize; D],
    dtype: BurnDType,
    device: &Device,
) -> Option<CubeTensor> {
    Tensor::<D>::zeros(shape, (device, dtype))
        .try_into_primitive::<Cube>()
        .ok()
}

/// `tensor` after `op` over the group (`size` ranks, this one `rank`), computed on its GPU by
/// the engine's device collectives; `None` when that cannot be done (see the module's docs).
pub fn run<const D: usize>(
    device: &dyn DeviceCollectives,
    size: usize,
    tensor: &Tensor<D>,
    dtype: DType,
    op: DeviceOp<'_>,
) -> Option<CommResult<Tensor<D>>> {
    let input = on_gpu(device, tensor)?;
    let burn_dtype = input.dtype();
    let shape = input.shape().to_vec();
    let count = shape.iter().product::<usize>();
    let row = shape[1..].iter().product::<usize>();
    let mut out_shape = shape.clone();
    match &op {
        DeviceOp::AllReduce(_) | DeviceOp::Broadcast(_) => {}
        DeviceOp::AllGather => out_shape[0] *= size,
        DeviceOp::ReduceScatter(_) => out_shape[0] /= size,
        DeviceOp::AllToAll { recv_rows, .. } => out_shape[0] = recv_rows.iter().sum(),
    }
    let in_place = matches!(op, DeviceOp::AllReduce(_) | DeviceOp::Broadcast(_));
    let (input, output) = if in_place {
        // NCCL writes every element in place: the buffer must be this tensor's alone.
        let own = if input.can_mut() { input } else { input.copy() };
        (own, None)
    } else {
        let out = fresh::<D>(out_shape.try_into().ok()?, burn_dtype, &tensor.device())?;
        (input, Some(out))
    };
    // Every kernel that wrote (or allocated) the buffers has finished before NCCL touches them.
    burn::tensor::read_sync(input.client.sync()).ok()?;
    let buffers: Vec<&CubeTensor> = std::iter::once(&input).chain(output.as_ref()).collect();
    let rows = |r: &[usize]| r.iter().map(|x| x * row).collect::<Vec<_>>();
    let result = with_pointers(&buffers, |ptr| {
        // SAFETY: each pointer is a contiguous buffer of the communicator's GPU (checked in
        // `on_gpu`) holding the element counts given here, in `dtype`; the output is fresh and
        // the in-place input is this call's own (`can_mut`, or a copy); Burn's writes are
        // complete (synchronised above), and `with_pointers` keeps every buffer in place until
        // the engine returns with its own stream synchronised.
        unsafe {
            match &op {
                DeviceOp::AllReduce(op) => device.all_reduce_device(ptr[0], count, dtype, *op),
                DeviceOp::Broadcast(root) => device.broadcast_device(ptr[0], count, dtype, *root),
                DeviceOp::AllGather => device.all_gather_device(ptr[0], ptr[1], count, dtype),
                DeviceOp::ReduceScatter(op) => {
                    device.reduce_scatter_device(ptr[0], ptr[1], count / size, dtype, *op)
                }
                DeviceOp::AllToAll {
                    send_rows,
                    recv_rows,
                } => device.all_to_all_v_device(
                    ptr[0],
                    &rows(send_rows),
                    ptr[1],
                    &rows(recv_rows),
                    dtype,
                ),
            }
        }
    })?;
    let done = output.unwrap_or(input);
    Some(result.map(|()| Tensor::from_primitive::<Cube>(done)))
}

/// Sends `tensor` to `dst` from its GPU memory; `None` when it is not on the communicator's GPU.
pub fn send<const D: usize>(
    device: &dyn DeviceCollectives,
    tensor: &Tensor<D>,
    dtype: DType,
    dst: usize,
) -> Option<CommResult<()>> {
    let input = on_gpu(device, tensor)?;
    let count = input.shape().num_elements();
    burn::tensor::read_sync(input.client.sync()).ok()?;
    // SAFETY: as in `run`: the communicator's GPU, `count` elements, writes complete, kept in
    // place until the engine returns.
    with_pointers(&[&input], |ptr| unsafe {
        device.send_device(ptr[0], count, dtype, dst)
    })
}

/// A tensor of `shape` received from `src` into fresh memory of `device`, when that is the
/// communicator's GPU; `None` otherwise.
pub fn recv<const D: usize>(
    device: &dyn DeviceCollectives,
    shape: [usize; D],
    burn_dtype: BurnDType,
    dtype: DType,
    src: usize,
    on: &Device,
) -> Option<CommResult<Tensor<D>>> {
    let out = fresh(shape, burn_dtype, on)?;
    match &out.device {
        CubeDevice::Cuda(cuda) if cuda.index == device.device_ordinal() => {}
        _ => return None,
    }
    let count = shape.iter().product::<usize>();
    burn::tensor::read_sync(out.client.sync()).ok()?;
    // SAFETY: a fresh buffer of `count` elements on the communicator's GPU, kept in place
    // until the engine returns.
    let result = with_pointers(&[&out], |ptr| unsafe {
        device.recv_device(ptr[0], count, dtype, src)
    })?;
    Some(result.map(|()| Tensor::from_primitive::<Cube>(out)))
}
