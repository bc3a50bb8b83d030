//! Collectives on Burn tensors: on the device where the engine and the tensor allow it, else
//! staged through host memory (`TensorData`).
//!
//! A CUDA tensor on a communicator with device collectives (NCCL, one GPU per rank) goes to
//! the engine as its device buffer (the private `cuda_memory` module, feature `cuda`): nothing passes
//! through host memory. Every other (device, engine) pair is staged, the one place that does:
//! a tensor is taken by value and its bytes are handed to the engine as they come out of
//! `into_data`: on Flex, whose tensors are host memory, a tensor no other value shares gives up
//! its own buffer, the engine works on it in place and the result is built on that same buffer,
//! so an all-reduce or broadcast copies nothing outside the engine (a shared tensor is copied
//! once). An engine that only reads a tensor (all-gather, reduce-scatter, all-to-all, send)
//! reads a contiguous Flex tensor where it lies, shared or a view into a larger buffer, with
//! no copy. These move values, not gradients: results are fresh tensors on the input's device,
//! outside any autodiff graph. Differentiable collectives (Megatron's conjugate operators) live
//! with the strategies that need them.

use crate::output_pool::output;
use crate::transfers::{self, Cause};
use burn::backend::Flex;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{Bytes, DType as BurnDType, Tensor, TensorData};
use flashover_comm::host_buffers::{self, Purpose};
use flashover_comm::{CommError, CommResult, Communicator, DType, OpKind, ReduceOp, Transfer};
use std::ops::Range;

/// The collective operations on whole tensors, for every [`Communicator`] (and so every
/// [`flashover_comm::Group`]).
pub trait TensorCollectives {
    /// Element-wise reduction over the group; every rank gets the result.
    fn all_reduce_tensor<const D: usize>(
        &self,
        tensor: Tensor<D>,
        op: ReduceOp,
    ) -> CommResult<Tensor<D>>;
    /// Every rank gets `root`'s tensor (all ranks pass a tensor of the same shape).
    fn broadcast_tensor<const D: usize>(
        &self,
        tensor: Tensor<D>,
        root: usize,
    ) -> CommResult<Tensor<D>>;
    /// Concatenation of every rank's tensor along `dim`, in rank order.
    fn all_gather_tensor<const D: usize>(
        &self,
        tensor: Tensor<D>,
        dim: usize,
    ) -> CommResult<Tensor<D>>;
    /// Rank `r` gets block `r` (of `size()` equal blocks along `dim`) of the reduction.
    /// `tensor.dims()[dim]` must divide by the group size.
    fn reduce_scatter_tensor<const D: usize>(
        &self,
        tensor: Tensor<D>,
        dim: usize,
        op: ReduceOp,
    ) -> CommResult<Tensor<D>>;
    /// Variable all-to-all along dim 0: the first `send_rows[j]` rows after those for ranks
    /// before `j` go to rank `j`; the result is the `recv_rows[j]` rows from each rank `j`, in
    /// rank order (a row being everything after dim 0). Counts must agree pairwise, as for
    /// [`Communicator::all_to_all_v_bytes`].
    fn all_to_all_tensor<const D: usize>(
        &self,
        tensor: Tensor<D>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> CommResult<Tensor<D>>;
    /// Sends `tensor` to group rank `dst` (point to point).
    fn send_tensor<const D: usize>(&self, tensor: &Tensor<D>, dst: usize) -> CommResult<()>;
    /// Receives a tensor of `shape` and `dtype` from group rank `src` onto `device`.
    fn recv_tensor<const D: usize>(
        &self,
        shape: [usize; D],
        dtype: BurnDType,
        src: usize,
        device: &burn::tensor::Device,
    ) -> CommResult<Tensor<D>>;
    /// Point to point, as one batch ([`Communicator::exchange_bytes`]): each of `sends` to its
    /// group rank, and for each of `incoming` a flat tensor received onto `device`, returned
    /// in order. Two ranks that send to each other at once put both sides in one batch, which
    /// an engine whose sends wait for their receives (NCCL) needs.
    fn exchange_flat(
        &self,
        sends: &[(Tensor<1>, usize)],
        incoming: &[Incoming],
        device: &burn::tensor::Device,
    ) -> CommResult<Vec<Tensor<1>>>;
}

/// A flat tensor [`TensorCollectives::exchange_flat`] receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Incoming {
    /// Its element count.
    pub numel: usize,
    /// Its dtype.
    pub dtype: BurnDType,
    /// The group rank that sends it.
    pub src: usize,
}

/// What a device collective does to a tensor's buffer (see `cuda_memory`); counts are
/// rows along dim 0.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum DeviceOp<'a> {
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

/// `op` on `tensor`'s device buffer where `comm` has device collectives and the tensor lives
/// on its GPU (only with the `cuda` feature); the tensor back, untouched, for the staged path
/// otherwise.
fn on_device<C: Communicator + ?Sized, const D: usize>(
    comm: &C,
    tensor: Tensor<D>,
    op: DeviceOp<'_>,
) -> Result<CommResult<Tensor<D>>, Box<Tensor<D>>> {
    #[cfg(feature = "cuda")]
    if let (Some(collectives), Some(dtype)) =
        (comm.device_collectives(), comm_dtype(tensor.dtype()))
    {
        return crate::cuda_memory::run(collectives, comm.size(), tensor, dtype, op);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (comm, op);
    Err(Box::new(tensor))
}

/// [`on_device`] for a send.
fn send_on_device<C: Communicator + ?Sized, const D: usize>(
    comm: &C,
    tensor: Tensor<D>,
    dst: usize,
) -> Result<CommResult<()>, Box<Tensor<D>>> {
    #[cfg(feature = "cuda")]
    if let (Some(collectives), Some(dtype)) =
        (comm.device_collectives(), comm_dtype(tensor.dtype()))
    {
        return crate::cuda_memory::send(collectives, tensor, dtype, dst);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (comm, dst);
    Err(Box::new(tensor))
}

/// [`on_device`] for a receive into fresh memory of `device`; `None` for the staged path.
fn recv_on_device<C: Communicator + ?Sized, const D: usize>(
    comm: &C,
    shape: [usize; D],
    burn_dtype: BurnDType,
    dtype: DType,
    src: usize,
    device: &burn::tensor::Device,
) -> Option<CommResult<Tensor<D>>> {
    #[cfg(feature = "cuda")]
    return crate::cuda_memory::recv(
        comm.device_collectives()?,
        shape,
        burn_dtype,
        dtype,
        src,
        device,
    );
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (comm, shape, burn_dtype, dtype, src, device);
        None
    }
}

/// [`on_device`] for a batch of sends and receives, when every tensor of it can go (sends on
/// the communicator's GPU, received onto it); `None` for the staged path.
fn exchange_on_device<C: Communicator + ?Sized>(
    comm: &C,
    sends: &[(Tensor<1>, usize)],
    incoming: &[Incoming],
    device: &burn::tensor::Device,
) -> Option<CommResult<Vec<Tensor<1>>>> {
    #[cfg(feature = "cuda")]
    {
        let collectives = comm.device_collectives()?;
        let sends = (sends.iter())
            .map(|(t, dst)| Some((t.clone(), comm_dtype(t.dtype())?, *dst)))
            .collect::<Option<Vec<_>>>()?;
        let incoming = (incoming.iter())
            .map(|i| Some((*i, comm_dtype(i.dtype)?)))
            .collect::<Option<Vec<_>>>()?;
        crate::cuda_memory::exchange(collectives, sends, &incoming, device)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (comm, sends, incoming, device);
        None
    }
}

/// The collective layer's tag for a Burn dtype, if it can move it.
fn comm_dtype(dtype: BurnDType) -> Option<DType> {
    Some(match dtype {
        BurnDType::F32 | BurnDType::Flex32 => DType::F32,
        BurnDType::F64 => DType::F64,
        BurnDType::F16 => DType::F16,
        BurnDType::BF16 => DType::BF16,
        BurnDType::I32 => DType::I32,
        BurnDType::I64 => DType::I64,
        BurnDType::U32 => DType::U32,
        BurnDType::U64 => DType::U64,
        BurnDType::U8 => DType::U8,
        _ => return None,
    })
}

/// [`comm_dtype`], or an error naming the op and group.
fn checked_dtype<C: Communicator + ?Sized>(
    comm: &C,
    op: OpKind,
    dtype: BurnDType,
) -> CommResult<DType> {
    comm_dtype(dtype).ok_or_else(|| CommError::InvalidArgument {
        op,
        group: comm.name().to_string(),
        detail: format!("tensors of dtype {dtype:?} cannot be communicated"),
    })
}

/// A tensor's host bytes, shape and dtypes.
struct Staged {
    bytes: Bytes,
    shape: Vec<usize>,
    burn_dtype: BurnDType,
    dtype: DType,
}

/// `tensor`'s values in host memory: its own buffer where the backend can give it up (Flex, a
/// contiguous tensor nothing else shares), one copy of a contiguous Flex tensor another value
/// still holds, else the backend's copy.
fn stage<C: Communicator + ?Sized, const D: usize>(
    comm: &C,
    op: OpKind,
    tensor: Tensor<D>,
) -> CommResult<Staged> {
    let dims = tensor.dims();
    let parts = |data: TensorData| {
        let (bytes, shape, burn_dtype) = data.into_parts();
        (bytes, shape.to_vec(), burn_dtype)
    };
    // From a clone, so the tensor is still at hand when it is not on Flex (dropped first, so a
    // tensor nothing else holds is this call's alone).
    let (bytes, shape, burn_dtype) = match tensor.clone().try_into_primitive::<Flex>() {
        Ok(flex) => {
            drop(tensor);
            match copy_of_shared(&flex) {
                Some(bytes) => (bytes, dims.to_vec(), flex.dtype()),
                None => parts(flex.into_data()),
            }
        }
        Err(_) => parts(tensor.into_data()),
    };
    transfers::to_host(Cause::Collective, bytes.len());
    let dtype = checked_dtype(comm, op, burn_dtype)?;
    Ok(Staged {
        bytes,
        shape,
        burn_dtype,
        dtype,
    })
}

/// The values of a contiguous Flex tensor whose buffer another tensor also holds, copied once
/// into a buffer of the element's width (the engine writes the result there); `None` for a
/// tensor whose buffer is its own (the engine can take it) or that is not contiguous. Flex's
/// own `into_data` of a shared buffer copies it into a `Vec<u8>`, which `Bytes` copies again to
/// align it.
fn copy_of_shared(flex: &FloatTensor<Flex>) -> Option<Bytes> {
    if flex.is_unique() {
        return None;
    }
    let (start, end) = flex.layout().contiguous_offsets()?;
    let size = flex.dtype().size();
    let range = start * size..end * size;
    let values = flex.bytes().get(range)?;
    let mut bytes = output(values.len(), size);
    bytes.copy_from_slice(values);
    Some(bytes)
}

/// Where an engine that only reads a tensor finds its values.
enum Values {
    /// A Flex tensor's buffer, and the bytes of the tensor's values in it.
    Flex(FloatTensor<Flex>, Range<usize>),
    /// The tensor's staged bytes.
    Staged(Bytes),
}

/// A tensor's values for an engine that only reads them, its shape and dtypes.
struct ReadOnly {
    values: Values,
    shape: Vec<usize>,
    burn_dtype: BurnDType,
    dtype: DType,
}

impl ReadOnly {
    fn bytes(&self) -> &[u8] {
        match &self.values {
            Values::Flex(tensor, range) => &tensor.bytes()[range.clone()],
            Values::Staged(bytes) => bytes,
        }
    }
}

/// `tensor`'s values for an engine that only reads them: a contiguous Flex tensor's own
/// buffer (shared with other tensors or not, a view or not), else its staged bytes.
fn read_only<C: Communicator + ?Sized, const D: usize>(
    comm: &C,
    op: OpKind,
    tensor: Tensor<D>,
) -> CommResult<ReadOnly> {
    // From a clone, so the tensor is still at hand when it is not on Flex (dropped before the
    // engine runs, so a tensor nothing else holds stays this call's alone).
    if let Ok(flex) = tensor.clone().try_into_primitive::<Flex>()
        && let Some((start, end)) = flex.layout().contiguous_offsets()
    {
        let burn_dtype = flex.dtype();
        let size = burn_dtype.size();
        let range = start * size..end * size;
        if range.end <= flex.bytes().len() {
            let dtype = checked_dtype(comm, op, burn_dtype)?;
            let shape = tensor.dims().to_vec();
            drop(tensor);
            transfers::to_host(Cause::Collective, range.len());
            return Ok(ReadOnly {
                values: Values::Flex(flex, range),
                shape,
                burn_dtype,
                dtype,
            });
        }
    }
    let s = stage(comm, op, tensor)?;
    Ok(ReadOnly {
        values: Values::Staged(s.bytes),
        shape: s.shape,
        burn_dtype: s.burn_dtype,
        dtype: s.dtype,
    })
}

/// A tensor of `dtype` on `device` built on `bytes` (on Flex, without a copy).
fn unstage<const D: usize>(
    bytes: Bytes,
    shape: Vec<usize>,
    dtype: BurnDType,
    device: &burn::tensor::Device,
) -> Tensor<D> {
    transfers::to_device(Cause::Collective, bytes.len());
    Tensor::<D>::from_data(TensorData::from_bytes(bytes, shape, dtype), (device, dtype))
}

/// Runs the engine call `f` on a tensor's staged bytes, marked as staging (the one place that
/// hands an engine a tensor's bytes: [`flashover_comm::host_buffers`]).
fn staged<R>(f: impl FnOnce() -> R) -> R {
    host_buffers::marked(Purpose::Staging, f)
}

impl<C: Communicator + ?Sized> TensorCollectives for C {
    fn all_reduce_tensor<const D: usize>(
        &self,
        tensor: Tensor<D>,
        op: ReduceOp,
    ) -> CommResult<Tensor<D>> {
        let tensor = match on_device(self, tensor, DeviceOp::AllReduce(op)) {
            Ok(done) => return done,
            Err(tensor) => *tensor,
        };
        let device = tensor.device();
        let mut s = stage(self, OpKind::AllReduce, tensor)?;
        staged(|| self.all_reduce_bytes(&mut s.bytes, s.dtype, op))?;
        Ok(unstage(s.bytes, s.shape, s.burn_dtype, &device))
    }

    fn broadcast_tensor<const D: usize>(
        &self,
        tensor: Tensor<D>,
        root: usize,
    ) -> CommResult<Tensor<D>> {
        let tensor = match on_device(self, tensor, DeviceOp::Broadcast(root)) {
            Ok(done) => return done,
            Err(tensor) => *tensor,
        };
        let device = tensor.device();
        let mut s = stage(self, OpKind::Broadcast, tensor)?;
        staged(|| self.broadcast_bytes(&mut s.bytes, s.dtype, root))?;
        Ok(unstage(s.bytes, s.shape, s.burn_dtype, &device))
    }

    fn all_gather_tensor<const D: usize>(
        &self,
        tensor: Tensor<D>,
        dim: usize,
    ) -> CommResult<Tensor<D>> {
        let n = self.size();
        // The ranks' tensors end to end: the concatenation along dim 0.
        let gathered = match on_device(self, tensor, DeviceOp::AllGather) {
            Ok(done) => done?,
            Err(tensor) => {
                let device = tensor.device();
                let s = read_only(self, OpKind::AllGather, *tensor)?;
                let mut recv = output(s.bytes().len() * n, s.dtype.size());
                staged(|| self.all_gather_bytes(s.bytes(), &mut recv, s.dtype))?;
                let mut stacked = s.shape.clone();
                stacked[0] *= n;
                unstage(recv, stacked, s.burn_dtype, &device)
            }
        };
        if dim == 0 || n == 1 {
            return Ok(gathered);
        }
        let mut shape = gathered.dims();
        if shape.contains(&0) {
            // Nothing to cut: the empty result, with `dim` scaled instead of dim 0.
            shape[0] /= n;
            shape[dim] *= n;
            return Ok(gathered.reshape(shape));
        }
        Ok(Tensor::cat(gathered.chunk(n, 0), dim))
    }

    fn reduce_scatter_tensor<const D: usize>(
        &self,
        tensor: Tensor<D>,
        dim: usize,
        op: ReduceOp,
    ) -> CommResult<Tensor<D>> {
        let n = self.size();
        let dims = tensor.dims();
        if !dims[dim].is_multiple_of(n) {
            return Err(CommError::InvalidArgument {
                op: OpKind::ReduceScatter,
                group: self.name().to_string(),
                detail: format!(
                    "dim {dim} of shape {dims:?} does not divide by the group size {n}"
                ),
            });
        }
        let device = tensor.device();
        // Blocks along `dim` laid end to end in rank order: the tensor itself along dim 0.
        let blocks = if dim == 0 {
            tensor
        } else {
            Tensor::cat(tensor.chunk(n, dim), 0)
        };
        let blocks = match on_device(self, blocks, DeviceOp::ReduceScatter(op)) {
            // The blocks' shape with dim 0 divided: `dims` with `dim` divided.
            Ok(done) => return done,
            Err(blocks) => *blocks,
        };
        let s = read_only(self, OpKind::ReduceScatter, blocks)?;
        let mut recv = output(s.bytes().len() / n, s.dtype.size());
        staged(|| self.reduce_scatter_bytes(s.bytes(), &mut recv, s.dtype, op))?;
        let mut shape = dims.to_vec();
        shape[dim] /= n;
        Ok(unstage(recv, shape, s.burn_dtype, &device))
    }

    fn all_to_all_tensor<const D: usize>(
        &self,
        tensor: Tensor<D>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> CommResult<Tensor<D>> {
        let n = self.size();
        let dims = tensor.dims();
        let sent: usize = send_rows.iter().sum();
        if send_rows.len() != n || recv_rows.len() != n || sent != dims[0] {
            return Err(CommError::InvalidArgument {
                op: OpKind::AllToAll,
                group: self.name().to_string(),
                detail: format!(
                    "{} send and {} receive counts for a group of {n}, sending {sent} of \
                     {} rows",
                    send_rows.len(),
                    recv_rows.len(),
                    dims[0]
                ),
            });
        }
        let tensor = match on_device(
            self,
            tensor,
            DeviceOp::AllToAll {
                send_rows,
                recv_rows,
            },
        ) {
            Ok(done) => return done,
            Err(tensor) => *tensor,
        };
        let device = tensor.device();
        let row: usize = dims[1..].iter().product();
        let s = read_only(self, OpKind::AllToAll, tensor)?;
        let elements = |rows: &[usize]| rows.iter().map(|r| r * row).collect::<Vec<_>>();
        let received: usize = recv_rows.iter().sum();
        let mut recv = output(received * row * s.dtype.size(), s.dtype.size());
        staged(|| {
            self.all_to_all_v_bytes(
                s.bytes(),
                &elements(send_rows),
                &mut recv,
                &elements(recv_rows),
                s.dtype,
            )
        })?;
        let mut shape = dims.to_vec();
        shape[0] = received;
        Ok(unstage(recv, shape, s.burn_dtype, &device))
    }

    fn send_tensor<const D: usize>(&self, tensor: &Tensor<D>, dst: usize) -> CommResult<()> {
        let tensor = match send_on_device(self, tensor.clone(), dst) {
            Ok(done) => return done,
            Err(tensor) => *tensor,
        };
        let s = read_only(self, OpKind::Send, tensor)?;
        staged(|| self.send_bytes(s.bytes(), s.dtype, dst))
    }

    fn recv_tensor<const D: usize>(
        &self,
        shape: [usize; D],
        dtype: BurnDType,
        src: usize,
        device: &burn::tensor::Device,
    ) -> CommResult<Tensor<D>> {
        let tag = checked_dtype(self, OpKind::Recv, dtype)?;
        if let Some(done) = recv_on_device(self, shape, dtype, tag, src, device) {
            return done;
        }
        let mut bytes = output(shape.iter().product::<usize>() * tag.size(), tag.size());
        staged(|| self.recv_bytes(&mut bytes, tag, src))?;
        Ok(unstage(bytes, shape.to_vec(), dtype, device))
    }

    fn exchange_flat(
        &self,
        sends: &[(Tensor<1>, usize)],
        incoming: &[Incoming],
        device: &burn::tensor::Device,
    ) -> CommResult<Vec<Tensor<1>>> {
        if let Some(done) = exchange_on_device(self, sends, incoming, device) {
            return done;
        }
        let sent = (sends.iter())
            .map(|(t, dst)| Ok((read_only(self, OpKind::Exchange, t.clone())?, *dst)))
            .collect::<CommResult<Vec<_>>>()?;
        let tags = (incoming.iter())
            .map(|i| checked_dtype(self, OpKind::Exchange, i.dtype))
            .collect::<CommResult<Vec<_>>>()?;
        let mut received: Vec<Bytes> = (incoming.iter().zip(&tags))
            .map(|(i, tag)| output(i.numel * tag.size(), tag.size()))
            .collect();
        let mut transfers: Vec<Transfer<'_>> = (sent.iter())
            .map(|(s, dst)| Transfer::Send {
                buf: s.bytes(),
                dtype: s.dtype,
                dst: *dst,
            })
            .collect();
        transfers.extend(
            (received.iter_mut().zip(incoming).zip(&tags)).map(|((buf, i), tag)| Transfer::Recv {
                buf,
                dtype: *tag,
                src: i.src,
            }),
        );
        staged(|| self.exchange_bytes(&mut transfers))?;
        drop(transfers);
        Ok((received.into_iter().zip(incoming))
            .map(|(bytes, i)| unstage(bytes, vec![i.numel], i.dtype, device))
            .collect())
    }
}
