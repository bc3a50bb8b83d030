//! Burn CUDA tensors straight into an engine's device collectives (NCCL): each collective reads
//! and writes the tensors' buffers on their GPU, with no copy through host memory.
//! [`crate::TensorCollectives`] takes this path first for every CUDA tensor on a communicator
//! with device collectives, and stages through host memory only where it returns the tensor.
//!
//! **Buffers are flattened first.** CubeCL's CUDA runtime pads the rows of every tensor of rank
//! 2 or more it allocates ("pitched" memory: each last-dimension row starts on an aligned
//! address), so the buffer of a `[6, 5]` f32 tensor is 6 rows of 8, not 30 values end to end.
//! NCCL counts elements end to end, so every operation here runs on the tensor reshaped to one
//! dimension, which CubeCL always stores densely (for a padded tensor that reshape is one copy
//! on the GPU); results are built one-dimensional and reshaped back. An earlier version handed
//! NCCL the padded buffers and read back wrong values on an H200.
//!
//! How it works: the tensor's primitive is a fused tensor (Burn's operation fusion is on), resolved
//! to burn-cubecl's `CubeTensor` (`flashover_kernels::fusion_bridge`), and results are registered
//! back as fused tensors; the buffer's
//! `CUdeviceptr` comes from `ComputeClient::get_resource` with the CUDA server's storage (the
//! resource keeps the buffer in place while NCCL runs). Taking the resource makes the client's
//! stream wait for the streams that wrote the buffer; the client is then synchronised before
//! NCCL reads or writes: CubeCL records a fence (a CUDA event) on that stream and the host waits
//! for it. NCCL's stream cannot wait for the event on the device instead, because CubeCL 0.11.3
//! hands out neither its streams nor its fences. The engine synchronises its own stream before
//! returning.
//! Outputs are fresh buffers NCCL writes whole; an in-place operation on a buffer shared with
//! another tensor (`can_mut` false) first copies it on the device, since Burn's tensors are
//! values.

use burn::backend::{Cube, TensorMetadata};
use burn::tensor::{DType as BurnDType, Device, Tensor};
use burn_cubecl::tensor::CubeTensor;
use cubecl_cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use flashover_comm::{CommResult, DType, DeviceCollectives, DeviceTransfer};
use flashover_kernels::fusion_bridge::{register, resolve};

use crate::tensor::{DeviceOp, Incoming};

/// Whether `device` is the communicator's GPU as a Burn CUDA device (not autodiff: collectives
/// move values).
fn is_communicator_gpu(collectives: &dyn DeviceCollectives, device: &Device) -> bool {
    *device == Device::cuda(collectives.device_ordinal())
}

/// `tensor` as one dense dimension on its GPU, or the tensor back where it is not a CUDA tensor
/// of the communicator's GPU.
fn flat_on_gpu<const D: usize>(
    collectives: &dyn DeviceCollectives,
    tensor: Tensor<D>,
) -> Result<CubeTensor, Box<Tensor<D>>> {
    if !is_communicator_gpu(collectives, &tensor.device()) {
        return Err(Box::new(tensor));
    }
    let shape = tensor.dims();
    let count = shape.iter().product::<usize>();
    // Reshaped from a clone so the tensor can still be given back; dropped once the flat view
    // is in hand, so a buffer nothing else shares stays this call's alone (`can_mut`).
    let flat = match tensor.clone().reshape([count]).try_into_primitive::<Cube>() {
        Ok(flat) => resolve(flat),
        Err(_) => return Err(Box::new(tensor)),
    };
    drop(tensor);
    if flat.meta.strides()[..] != [1] {
        // Not reached with CubeCL 0.11.3 (one dimension is never padded); kept as a refusal
        // rather than a wrong count.
        return Err(Box::new(shaped(flat, shape)));
    }
    Ok(flat)
}

/// A one-dimensional buffer as a tensor of `shape` (same element count).
fn shaped<const D: usize>(flat: CubeTensor, shape: [usize; D]) -> Tensor<D> {
    Tensor::<1>::from_primitive::<Cube>(register(flat)).reshape(shape)
}

/// A fresh one-dimensional buffer of `count` elements of `dtype` on `device` (every element is
/// written by the collective that fills it).
fn fresh(count: usize, dtype: BurnDType, device: &Device) -> Option<CubeTensor> {
    Tensor::<1>::empty([count], (device, dtype))
        .try_into_primitive::<Cube>()
        .ok()
        .map(resolve)
}

/// Runs `f` with the device address of each buffer, every one kept in place until it returns,
/// after the work queued on the client's stream, and on the streams that wrote the buffers, has
/// finished.
fn with_pointers<R>(buffers: &[&CubeTensor], f: impl FnOnce(&[u64]) -> R) -> Option<R> {
    let mut held = Vec::with_capacity(buffers.len());
    for b in buffers {
        let resource = b
            .client
            .get_resource::<<CudaRuntime as Runtime>::Server>(b.handle.clone())
            .ok()?;
        held.push(resource);
    }
    // Synchronised after the resources are taken, so that whatever taking them queued on the
    // GPU has finished too.
    burn::tensor::read_sync(buffers[0].client.sync()).ok()?;
    crate::transfers::to_host(crate::transfers::Cause::Fence, 0);
    let pointers: Vec<u64> = held.iter().map(|r| r.resource().ptr).collect();
    let out = f(&pointers);
    drop(held);
    Some(out)
}

/// `tensor` after `op` over the group of `size` ranks, computed on its GPU by
/// the engine's device collectives. The tensor comes back untouched (`Err`) where it is not a
/// CUDA tensor of the communicator's GPU or Burn does not hand out its buffer (boxed: a
/// tensor is large to move, and most calls decline).
pub(crate) fn run<const D: usize>(
    collectives: &dyn DeviceCollectives,
    size: usize,
    tensor: Tensor<D>,
    dtype: DType,
    op: DeviceOp<'_>,
) -> Result<CommResult<Tensor<D>>, Box<Tensor<D>>> {
    let device = tensor.device();
    let shape = tensor.dims();
    let input = flat_on_gpu(collectives, tensor)?;
    let back = |flat: CubeTensor| Box::new(shaped(flat, shape));
    let burn_dtype = input.dtype();
    let count = shape.iter().product::<usize>();
    let row = shape[1..].iter().product::<usize>();
    let mut out_shape = shape;
    match &op {
        DeviceOp::AllReduce(_) | DeviceOp::Broadcast(_) => {}
        DeviceOp::AllGather => out_shape[0] *= size,
        DeviceOp::ReduceScatter(_) => out_shape[0] /= size,
        DeviceOp::AllToAll { recv_rows, .. } => out_shape[0] = recv_rows.iter().sum(),
    }
    let in_place = matches!(op, DeviceOp::AllReduce(_) | DeviceOp::Broadcast(_));
    let (input, output) = if in_place {
        // NCCL writes every element in place: the buffer must be this call's alone.
        let own = if input.can_mut() { input } else { input.copy() };
        (own, None)
    } else {
        let out_count = out_shape.iter().product::<usize>();
        match fresh(out_count, burn_dtype, &device) {
            Some(out) => (input, Some(out)),
            None => return Err(back(input)),
        }
    };
    let buffers: Vec<&CubeTensor> = std::iter::once(&input).chain(output.as_ref()).collect();
    let rows = |r: &[usize]| r.iter().map(|x| x * row).collect::<Vec<_>>();
    let result = with_pointers(&buffers, |ptr| {
        // SAFETY: each pointer is a dense one-dimensional buffer (`flat_on_gpu`, `fresh`) of
        // the communicator's GPU holding the element counts given here, in `dtype`; the output
        // is fresh and the in-place input is this call's own (`can_mut`, or a copy); Burn's
        // writes are complete (`with_pointers` synchronises), and every buffer stays in place
        // until the engine returns with its own stream synchronised.
        unsafe {
            match &op {
                DeviceOp::AllReduce(op) => collectives.all_reduce_device(ptr[0], count, dtype, *op),
                DeviceOp::Broadcast(root) => {
                    collectives.broadcast_device(ptr[0], count, dtype, *root)
                }
                DeviceOp::AllGather => collectives.all_gather_device(ptr[0], ptr[1], count, dtype),
                DeviceOp::ReduceScatter(op) => {
                    collectives.reduce_scatter_device(ptr[0], ptr[1], count / size, dtype, *op)
                }
                DeviceOp::AllToAll {
                    send_rows,
                    recv_rows,
                } => collectives.all_to_all_v_device(
                    ptr[0],
                    &rows(send_rows),
                    ptr[1],
                    &rows(recv_rows),
                    dtype,
                ),
            }
        }
    });
    let Some(result) = result else {
        return Err(back(input));
    };
    let done = output.unwrap_or(input);
    Ok(result.map(|()| shaped(done, out_shape)))
}

/// Sends `tensor` to `dst` from its GPU memory; the tensor back (`Err`) where it is not a CUDA
/// tensor of the communicator's GPU.
pub(crate) fn send<const D: usize>(
    collectives: &dyn DeviceCollectives,
    tensor: Tensor<D>,
    dtype: DType,
    dst: usize,
) -> Result<CommResult<()>, Box<Tensor<D>>> {
    let shape = tensor.dims();
    let input = flat_on_gpu(collectives, tensor)?;
    let count = input.shape().num_elements();
    // SAFETY: as in `run`: a dense buffer of `count` elements on the communicator's GPU,
    // writes complete, kept in place until the engine returns.
    with_pointers(&[&input], |ptr| unsafe {
        collectives.send_device(ptr[0], count, dtype, dst)
    })
    .ok_or_else(|| Box::new(shaped(input, shape)))
}

/// A tensor of `shape` received from `src` into fresh memory of `on`, when that is the
/// communicator's GPU; `None` otherwise.
pub(crate) fn recv<const D: usize>(
    collectives: &dyn DeviceCollectives,
    shape: [usize; D],
    burn_dtype: BurnDType,
    dtype: DType,
    src: usize,
    on: &Device,
) -> Option<CommResult<Tensor<D>>> {
    if !is_communicator_gpu(collectives, on) {
        return None;
    }
    let count = shape.iter().product::<usize>();
    let out = fresh(count, burn_dtype, on)?;
    // SAFETY: a fresh dense buffer of `count` elements on the communicator's GPU, kept in
    // place until the engine returns.
    let result = with_pointers(&[&out], |ptr| unsafe {
        collectives.recv_device(ptr[0], count, dtype, src)
    })?;
    Some(result.map(|()| shaped(out, shape)))
}

/// `sends` (each with its dtype and destination) and tensors received from `incoming` into
/// fresh memory of `on`, as one batch, when every send is a CUDA tensor of the communicator's
/// GPU and `on` is that GPU; `None` otherwise.
pub(crate) fn exchange(
    collectives: &dyn DeviceCollectives,
    sends: Vec<(Tensor<1>, DType, usize)>,
    incoming: &[(Incoming, DType)],
    on: &Device,
) -> Option<CommResult<Vec<Tensor<1>>>> {
    if !is_communicator_gpu(collectives, on) {
        return None;
    }
    let mut sent = Vec::with_capacity(sends.len());
    for (tensor, dtype, dst) in sends {
        sent.push((flat_on_gpu(collectives, tensor).ok()?, dtype, dst));
    }
    let outs = (incoming.iter())
        .map(|(i, _)| fresh(i.numel, i.dtype, on))
        .collect::<Option<Vec<CubeTensor>>>()?;
    if sent.is_empty() && outs.is_empty() {
        return Some(Ok(vec![]));
    }
    let buffers: Vec<&CubeTensor> = (sent.iter().map(|(flat, ..)| flat)).chain(&outs).collect();
    let result = with_pointers(&buffers, |ptr| {
        let sends = sent
            .iter()
            .zip(ptr)
            .map(|((flat, dtype, dst), &ptr)| DeviceTransfer {
                ptr,
                count: flat.shape().num_elements(),
                dtype: *dtype,
                peer: *dst,
                send: true,
            });
        let receives =
            (incoming.iter().zip(&ptr[sent.len()..])).map(|((i, dtype), &ptr)| DeviceTransfer {
                ptr,
                count: i.numel,
                dtype: *dtype,
                peer: i.src,
                send: false,
            });
        let transfers: Vec<DeviceTransfer> = sends.chain(receives).collect();
        // SAFETY: as in `run`: dense buffers of these element counts on the communicator's
        // GPU, the receives' fresh and apart from every other, writes complete, kept in place
        // until the engine returns.
        unsafe { collectives.exchange_device(&transfers) }
    })?;
    Some(result.map(|()| {
        (outs.into_iter())
            .map(|out| Tensor::<1>::from_primitive::<Cube>(register(out)))
            .collect()
    }))
}
