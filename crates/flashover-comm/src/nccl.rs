//! The NCCL engine (feature `nccl`): collectives on CUDA device memory through cudarc, one rank
//! per process and GPU.
//!
//! cudarc loads CUDA and NCCL at run time, so this compiles where neither is installed;
//! [`NcclWorld::available`] says clearly which library is missing. A `cudarc` communicator is
//! not `Send`, so each group's communicator lives on its own thread (an actor) that owns the
//! CUDA context, the stream and the NCCL communicator; calls are sent to it and their replies
//! awaited with the group's deadline, so a peer that never arrives is a timeout naming the op
//! and the group, not a hang (after one, the group is unusable, as NCCL's would be).
//!
//! The byte-level [`Communicator`] API stages host buffers through device memory (copy in, NCCL,
//! copy out). Reductions use NCCL's own order, so results match the thread and MPI engines to
//! rounding, not bit for bit. Variable all-to-all is grouped send/recv; sub-groups get their own
//! NCCL communicator, whose unique id the group leader shares over the parent group. NCCL's
//! `send` completes only with the matching `recv` (no buffering), so schedules that send
//! before receiving in both directions (pipelines) need the thread or MPI engine for now.
//!
//! [`DeviceCollectives`] (through [`Communicator::device_collectives`]) runs every operation on
//! memory another library owns, addressed by raw device pointer: the path Burn's CUDA tensors
//! take (flashover-runtime's `cuda_memory`, not in use yet: see there), with no host round
//! trip. `nccl_check` (in `scripts/gpu_check.sh`) runs every operation but send/recv both ways
//! on one GPU. On an H200 the byte-level ones and the in-place device ones passed; the
//! out-of-place device ones were added after that run and have not run yet.

use crate::args;
use crate::communicator::{Communicator, CommunicatorExt, DeviceCollectives, Group};
use crate::dtype::DType;
use crate::error::{CommError, CommResult};
use crate::op::{OpKind, ReduceOp};
use crate::stats::{CommStats, StatsRecorder};
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use cudarc::nccl::{Comm, Id};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

fn engine(detail: impl std::fmt::Display) -> CommError {
    CommError::Engine {
        engine: "nccl",
        detail: detail.to_string(),
    }
}

/// Entry points of the NCCL engine.
pub struct NcclWorld;

impl NcclWorld {
    /// Whether the CUDA driver and NCCL libraries can be loaded; the error says which is
    /// missing and what to install.
    pub fn available() -> CommResult<()> {
        if !crate::cuda::driver_present() {
            return Err(engine(crate::cuda::CudaUnavailable::NoDriver));
        }
        // SAFETY: as above.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(engine(
                "the NCCL library cannot be loaded: install NCCL (cudarc looks for libnccl.so, libnccl.so.2 is not enough: add a libnccl.so symlink)",
            ));
        }
        Ok(())
    }

    /// The world group for `rank` of `world` processes on GPU `device`. Rank 0 creates NCCL's
    /// unique id; `exchange` must hand every rank every rank's blob (rank 0's is the id; e.g.
    /// [`crate::Rendezvous`] or an MPI all-gather). Calls time out after `timeout`.
    pub fn group(
        rank: usize,
        world: usize,
        device: usize,
        timeout: Duration,
        exchange: impl FnOnce(&[u8]) -> Result<Vec<Vec<u8>>, String>,
    ) -> CommResult<Group> {
        Self::available()?;
        let mine = if rank == 0 {
            id_bytes(&Id::new().map_err(|e| engine(format!("creating the unique id: {e:?}")))?)
        } else {
            vec![]
        };
        let blobs =
            exchange(&mine).map_err(|e| engine(format!("exchanging the unique id: {e}")))?;
        let id = id_from(
            blobs
                .first()
                .ok_or_else(|| engine("no unique id from rank 0"))?,
        )?;
        let members = (0..world).collect();
        NcclComm::start("world".into(), members, rank, device, id, timeout)
    }
}

fn id_bytes(id: &Id) -> Vec<u8> {
    id.internal().iter().map(|&c| c as u8).collect()
}

fn id_from(bytes: &[u8]) -> CommResult<Id> {
    let bytes: [u8; 128] = bytes.try_into().map_err(|_| {
        engine(format!(
            "a unique id of {} bytes (128 expected)",
            bytes.len()
        ))
    })?;
    Ok(Id::uninit(bytes.map(|b| b as std::ffi::c_char)))
}

/// Work for a communicator's thread; the reply carries the output bytes.
enum Job {
    AllReduce(Vec<u8>, DType, ReduceOp),
    ReduceScatter(Vec<u8>, DType, ReduceOp),
    AllGather(Vec<u8>),
    Broadcast(Vec<u8>, usize),
    AllToAll(Vec<u8>, Vec<usize>, Vec<usize>),
    Send(Vec<u8>, usize),
    Recv(usize, usize),
    /// On memory another library owns ([`DeviceCollectives`]).
    Device(DeviceJob),
}

/// A [`Job`] on device memory addressed by raw pointer: counts are elements of the dtype.
enum DeviceJob {
    AllReduce(u64, usize, DType, ReduceOp),
    Broadcast(u64, usize, DType, usize),
    /// Send pointer, receive pointer, elements per rank.
    AllGather(u64, u64, usize, DType),
    /// Send pointer, receive pointer, elements received.
    ReduceScatter(u64, u64, usize, DType, ReduceOp),
    AllToAll {
        send: u64,
        send_counts: Vec<usize>,
        recv: u64,
        recv_counts: Vec<usize>,
        dtype: DType,
    },
    Send(u64, usize, DType, usize),
    Recv(u64, usize, DType, usize),
}

type Reply = mpsc::Sender<CommResult<Vec<u8>>>;

/// One group's communicator on the NCCL engine (a handle to its thread).
pub struct NcclComm {
    name: String,
    members: Vec<usize>,
    rank: usize,
    device: usize,
    timeout: Duration,
    jobs: Mutex<mpsc::Sender<(Job, Reply)>>,
    seq: AtomicU64,
    stats: StatsRecorder,
    failed: Mutex<Option<CommError>>,
}

impl NcclComm {
    /// Starts the thread owning group rank `rank`'s NCCL communicator on GPU `device`.
    fn start(
        name: String,
        members: Vec<usize>,
        rank: usize,
        device: usize,
        id: Id,
        timeout: Duration,
    ) -> CommResult<Group> {
        let (tx, rx) = mpsc::channel::<(Job, Reply)>();
        let (ready_tx, ready_rx) = mpsc::channel::<CommResult<()>>();
        let world = members.len();
        std::thread::Builder::new()
            .name(format!("nccl-{name}-{rank}"))
            .spawn(move || {
                let setup = || -> Result<(Arc<CudaStream>, Comm), String> {
                    let ctx =
                        CudaContext::new(device).map_err(|e| format!("GPU {device}: {e:?}"))?;
                    let stream = ctx.default_stream();
                    let comm = Comm::from_rank(stream.clone(), rank, world, id)
                        .map_err(|e| format!("ncclCommInitRank: {e:?}"))?;
                    Ok((stream, comm))
                };
                let (stream, comm) = match setup() {
                    Ok(v) => {
                        let _ = ready_tx.send(Ok(()));
                        v
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(engine(e)));
                        return;
                    }
                };
                for (job, reply) in rx {
                    let _ = reply.send(run(&stream, &comm, world, job).map_err(engine));
                }
            })
            .map_err(|e| engine(format!("starting the NCCL thread: {e}")))?;
        ready_rx
            .recv_timeout(timeout)
            .map_err(|_| engine("the NCCL communicator did not initialise in time"))??;
        Ok(Group::new(Arc::new(NcclComm {
            name,
            members,
            rank,
            device,
            timeout,
            jobs: Mutex::new(tx),
            seq: AtomicU64::new(0),
            stats: StatsRecorder::default(),
            failed: Mutex::new(None),
        })))
    }

    /// Runs `job` on the communicator's thread, waiting at most the group's timeout.
    fn call(&self, op: OpKind, bytes: usize, job: Job) -> CommResult<Vec<u8>> {
        if let Some(cause) = self
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Err(CommError::Poisoned {
                group: self.name.clone(),
                cause: Box::new(cause),
            });
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let (reply_tx, reply_rx) = mpsc::channel();
        self.jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send((job, reply_tx))
            .map_err(|_| engine("the NCCL thread has stopped"))?;
        let out = match reply_rx.recv_timeout(self.timeout) {
            Ok(r) => r,
            Err(_) => {
                let err = CommError::Timeout {
                    op,
                    group: self.name.clone(),
                    seq,
                    missing: vec![],
                    arrived: vec![self.members[self.rank]],
                    waited: started.elapsed(),
                };
                *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(err.clone());
                return Err(err);
            }
        };
        self.stats
            .record(op, bytes, Duration::ZERO, started.elapsed());
        out
    }

    fn invalid(&self, op: OpKind, detail: String) -> CommError {
        CommError::InvalidArgument {
            op,
            group: self.name.clone(),
            detail,
        }
    }
}

fn nccl_op(op: ReduceOp) -> cudarc::nccl::ReduceOp {
    match op {
        ReduceOp::Sum => cudarc::nccl::ReduceOp::Sum,
        ReduceOp::Avg => cudarc::nccl::ReduceOp::Avg,
        ReduceOp::Max => cudarc::nccl::ReduceOp::Max,
        ReduceOp::Min => cudarc::nccl::ReduceOp::Min,
    }
}

/// A reduction of `data` as elements of `T`: `scatter` keeps this rank's block only.
fn reduce<T>(
    stream: &Arc<CudaStream>,
    comm: &Comm,
    data: &[u8],
    op: ReduceOp,
    scatter: Option<usize>,
) -> Result<Vec<u8>, String>
where
    T: bytemuck::Pod
        + cudarc::driver::DeviceRepr
        + cudarc::driver::ValidAsZeroBits
        + cudarc::nccl::NcclType,
{
    let host: Vec<T> = data
        .chunks_exact(std::mem::size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect();
    let send = stream.clone_htod(&host).map_err(|e| format!("{e:?}"))?;
    let out_len = scatter.map_or(host.len(), |n| host.len() / n);
    let mut recv: CudaSlice<T> = stream.alloc_zeros(out_len).map_err(|e| format!("{e:?}"))?;
    let status = match scatter {
        None => comm.all_reduce(&send, &mut recv, &nccl_op(op)),
        Some(_) => comm.reduce_scatter(&send, &mut recv, &nccl_op(op)),
    };
    status.map_err(|e| format!("{e:?}"))?;
    let out = stream.clone_dtoh(&recv).map_err(|e| format!("{e:?}"))?;
    Ok(bytemuck::cast_slice(&out).to_vec())
}

/// One job on the communicator's thread.
fn run(stream: &Arc<CudaStream>, comm: &Comm, world: usize, job: Job) -> Result<Vec<u8>, String> {
    let err = |e: &dyn std::fmt::Debug| format!("{e:?}");
    let upload = |bytes: &[u8]| stream.clone_htod(bytes).map_err(|e| err(&e));
    let download = |slice: &CudaSlice<u8>| stream.clone_dtoh(slice).map_err(|e| err(&e));
    match job {
        Job::AllReduce(data, dtype, op) => reduce_as(stream, comm, &data, dtype, op, None),
        Job::ReduceScatter(data, dtype, op) => {
            reduce_as(stream, comm, &data, dtype, op, Some(world))
        }
        Job::AllGather(data) => {
            let send = upload(&data)?;
            let mut recv: CudaSlice<u8> = stream
                .alloc_zeros(data.len() * world)
                .map_err(|e| err(&e))?;
            comm.all_gather(&send, &mut recv).map_err(|e| err(&e))?;
            download(&recv)
        }
        Job::Broadcast(data, root) => {
            let mut buf = upload(&data)?;
            comm.broadcast_in_place(&mut buf, root as i32)
                .map_err(|e| err(&e))?;
            download(&buf)
        }
        Job::AllToAll(data, send_bytes, recv_bytes) => {
            let send = upload(&data)?;
            // One receive buffer per peer: the grouped calls need disjoint mutable views.
            let mut recvs: Vec<CudaSlice<u8>> = recv_bytes
                .iter()
                .map(|&r| stream.alloc_zeros(r.max(1)))
                .collect::<Result<_, _>>()
                .map_err(|e| err(&e))?;
            {
                let mut group = comm.group();
                let mut s_at = 0;
                for (peer, recv) in recvs.iter_mut().enumerate() {
                    let (s, r) = (send_bytes[peer], recv_bytes[peer]);
                    if s > 0 {
                        group
                            .send(send.slice(s_at..s_at + s), peer as i32)
                            .map_err(|e| err(&e))?;
                    }
                    if r > 0 {
                        group
                            .recv(recv.slice_mut(0..r), peer as i32)
                            .map_err(|e| err(&e))?;
                    }
                    s_at += s;
                }
            }
            let mut out = Vec::with_capacity(recv_bytes.iter().sum());
            for (recv, &r) in recvs.iter().zip(&recv_bytes) {
                out.extend_from_slice(&download(recv)?[..r]);
            }
            Ok(out)
        }
        Job::Send(data, dst) => {
            let send = upload(&data)?;
            comm.send(&send, dst as i32).map_err(|e| err(&e))?;
            stream.synchronize().map_err(|e| err(&e))?;
            Ok(vec![])
        }
        Job::Device(job) => {
            on_device(stream, comm, job)?;
            stream.synchronize().map_err(|e| err(&e))?;
            Ok(vec![])
        }
        Job::Recv(len, src) => {
            let mut recv: CudaSlice<u8> = stream.alloc_zeros(len.max(1)).map_err(|e| err(&e))?;
            comm.recv(&mut recv, src as i32).map_err(|e| err(&e))?;
            let mut out = download(&recv)?;
            out.truncate(len);
            Ok(out)
        }
    }
}

/// Device memory this engine does not own (a tensor library's buffer), as cudarc's slice
/// traits want it. The caller of [`DeviceCollectives`] vouches for the pointer; the engine's
/// stream is the one NCCL runs on, and it is synchronised before the job replies.
struct ForeignBuffer<'s, T> {
    ptr: u64,
    len: usize,
    stream: &'s Arc<CudaStream>,
    _element: std::marker::PhantomData<T>,
}

impl<T> DeviceSlice<T> for ForeignBuffer<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtr<T> for ForeignBuffer<'_, T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::sync_stream(stream))
    }
}

impl<T> DevicePtrMut<T> for ForeignBuffer<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::sync_stream(stream))
    }
}

/// `len` elements of `T` at `ptr` (a byte offset into memory another library owns).
fn foreign<T>(stream: &Arc<CudaStream>, ptr: u64, len: usize) -> ForeignBuffer<'_, T> {
    ForeignBuffer {
        ptr,
        len,
        stream,
        _element: std::marker::PhantomData,
    }
}

/// The reductions of `job` on elements of `T` (the data-moving jobs go as bytes).
fn reduce_on_device<T: cudarc::nccl::NcclType>(
    stream: &Arc<CudaStream>,
    comm: &Comm,
    job: &DeviceJob,
) -> Result<(), String> {
    let status = match *job {
        DeviceJob::AllReduce(ptr, count, _, op) => {
            comm.all_reduce_in_place(&mut foreign::<T>(stream, ptr, count), &nccl_op(op))
        }
        DeviceJob::ReduceScatter(send, recv, count, _, op) => comm.reduce_scatter(
            &foreign::<T>(stream, send, count * comm.world_size()),
            &mut foreign::<T>(stream, recv, count),
            &nccl_op(op),
        ),
        _ => unreachable!("only reductions are typed"),
    };
    status.map(drop).map_err(|e| format!("{e:?}"))
}

/// `job` on the communicator's stream (the caller synchronises it).
fn on_device(stream: &Arc<CudaStream>, comm: &Comm, job: DeviceJob) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Debug| format!("{e:?}");
    let bytes =
        |ptr: u64, count: usize, dtype: DType| foreign::<u8>(stream, ptr, count * dtype.size());
    match job {
        DeviceJob::AllReduce(_, _, dtype, _) | DeviceJob::ReduceScatter(_, _, _, dtype, _) => {
            match dtype {
                DType::F32 => reduce_on_device::<f32>(stream, comm, &job),
                DType::F64 => reduce_on_device::<f64>(stream, comm, &job),
                DType::F16 => reduce_on_device::<half::f16>(stream, comm, &job),
                DType::BF16 => reduce_on_device::<half::bf16>(stream, comm, &job),
                DType::I32 => reduce_on_device::<i32>(stream, comm, &job),
                DType::I64 => reduce_on_device::<i64>(stream, comm, &job),
                DType::U32 => reduce_on_device::<u32>(stream, comm, &job),
                DType::U64 => reduce_on_device::<u64>(stream, comm, &job),
                DType::U8 => reduce_on_device::<u8>(stream, comm, &job),
            }
        }
        DeviceJob::Broadcast(ptr, count, dtype, root) => comm
            .broadcast_in_place(&mut bytes(ptr, count, dtype), root as i32)
            .map(drop)
            .map_err(|e| err(&e)),
        DeviceJob::AllGather(send, recv, count, dtype) => comm
            .all_gather(
                &bytes(send, count, dtype),
                &mut bytes(recv, count * comm.world_size(), dtype),
            )
            .map(drop)
            .map_err(|e| err(&e)),
        DeviceJob::AllToAll {
            send,
            send_counts,
            recv,
            recv_counts,
            dtype,
        } => {
            // One NCCL group of sends and receives, so no pair waits on another.
            let size = dtype.size() as u64;
            cudarc::nccl::group_start().map_err(|e| err(&e))?;
            let (mut s_at, mut r_at) = (send, recv);
            let mut posted = Ok(());
            for (peer, (&s, &r)) in send_counts.iter().zip(&recv_counts).enumerate() {
                if s > 0 && posted.is_ok() {
                    posted = comm.send(&bytes(s_at, s, dtype), peer as i32).map(drop);
                }
                if r > 0 && posted.is_ok() {
                    posted = comm.recv(&mut bytes(r_at, r, dtype), peer as i32).map(drop);
                }
                s_at += s as u64 * size;
                r_at += r as u64 * size;
            }
            let ended = cudarc::nccl::group_end();
            posted.map_err(|e| err(&e))?;
            ended.map(drop).map_err(|e| err(&e))
        }
        DeviceJob::Send(ptr, count, dtype, dst) => comm
            .send(&bytes(ptr, count, dtype), dst as i32)
            .map_err(|e| err(&e)),
        DeviceJob::Recv(ptr, count, dtype, src) => comm
            .recv(&mut bytes(ptr, count, dtype), src as i32)
            .map(drop)
            .map_err(|e| err(&e)),
    }
}

impl NcclComm {
    /// Runs `job` on device memory after checking the call as the byte-level one is checked
    /// (`check` gets the byte counts of what it is given).
    fn device_call(
        &self,
        op: OpKind,
        bytes: usize,
        check: Result<(), String>,
        job: DeviceJob,
    ) -> CommResult<()> {
        check.map_err(|e| self.invalid(op, e))?;
        self.call(op, bytes, Job::Device(job)).map(drop)
    }
}

impl DeviceCollectives for NcclComm {
    fn device_ordinal(&self) -> usize {
        self.device
    }

    unsafe fn all_reduce_device(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> CommResult<()> {
        let job = DeviceJob::AllReduce(ptr, count, dtype, op);
        self.device_call(OpKind::AllReduce, count * dtype.size(), Ok(()), job)
    }

    unsafe fn broadcast_device(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        root: usize,
    ) -> CommResult<()> {
        let bytes = count * dtype.size();
        let check = args::broadcast(self.size(), bytes, dtype, root).map(drop);
        let job = DeviceJob::Broadcast(ptr, count, dtype, root);
        self.device_call(OpKind::Broadcast, bytes, check, job)
    }

    unsafe fn all_gather_device(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
    ) -> CommResult<()> {
        let bytes = count * dtype.size() * self.size();
        let job = DeviceJob::AllGather(send, recv, count, dtype);
        self.device_call(OpKind::AllGather, bytes, Ok(()), job)
    }

    unsafe fn reduce_scatter_device(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> CommResult<()> {
        let bytes = count * dtype.size() * self.size();
        let job = DeviceJob::ReduceScatter(send, recv, count, dtype, op);
        self.device_call(OpKind::ReduceScatter, bytes, Ok(()), job)
    }

    unsafe fn all_to_all_v_device(
        &self,
        send: u64,
        send_counts: &[usize],
        recv: u64,
        recv_counts: &[usize],
        dtype: DType,
    ) -> CommResult<()> {
        let total = |c: &[usize]| c.iter().sum::<usize>() * dtype.size();
        let (sent, received) = (total(send_counts), total(recv_counts));
        let check = args::all_to_all(self.size(), sent, send_counts, received, recv_counts, dtype);
        let job = DeviceJob::AllToAll {
            send,
            send_counts: send_counts.to_vec(),
            recv,
            recv_counts: recv_counts.to_vec(),
            dtype,
        };
        self.device_call(OpKind::AllToAll, sent, check, job)
    }

    unsafe fn send_device(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        dst: usize,
    ) -> CommResult<()> {
        let check = args::peer(self.size(), self.rank, dst, "destination", true);
        let job = DeviceJob::Send(ptr, count, dtype, dst);
        self.device_call(OpKind::Send, count * dtype.size(), check, job)
    }

    unsafe fn recv_device(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        src: usize,
    ) -> CommResult<()> {
        let check = args::peer(self.size(), self.rank, src, "source", true);
        let job = DeviceJob::Recv(ptr, count, dtype, src);
        self.device_call(OpKind::Recv, count * dtype.size(), check, job)
    }
}

/// [`reduce`] for the element type `dtype` names.
fn reduce_as(
    stream: &Arc<CudaStream>,
    comm: &Comm,
    data: &[u8],
    dtype: DType,
    op: ReduceOp,
    scatter: Option<usize>,
) -> Result<Vec<u8>, String> {
    match dtype {
        DType::F32 => reduce::<f32>(stream, comm, data, op, scatter),
        DType::F64 => reduce::<f64>(stream, comm, data, op, scatter),
        DType::I32 => reduce::<i32>(stream, comm, data, op, scatter),
        DType::I64 => reduce::<i64>(stream, comm, data, op, scatter),
        DType::U32 => reduce::<u32>(stream, comm, data, op, scatter),
        DType::U64 => reduce::<u64>(stream, comm, data, op, scatter),
        DType::U8 => reduce::<u8>(stream, comm, data, op, scatter),
        DType::F16 => reduce::<half::f16>(stream, comm, data, op, scatter),
        DType::BF16 => reduce::<half::bf16>(stream, comm, data, op, scatter),
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn members(&self) -> &[usize] {
        &self.members
    }

    fn all_reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> CommResult<()> {
        args::elements(buf.len(), dtype).map_err(|e| self.invalid(OpKind::AllReduce, e))?;
        let out = self.call(
            OpKind::AllReduce,
            buf.len(),
            Job::AllReduce(buf.to_vec(), dtype, op),
        )?;
        buf.copy_from_slice(&out);
        Ok(())
    }

    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> CommResult<()> {
        args::reduce_scatter(self.size(), send.len(), recv.len(), dtype)
            .map_err(|e| self.invalid(OpKind::ReduceScatter, e))?;
        let out = self.call(
            OpKind::ReduceScatter,
            send.len(),
            Job::ReduceScatter(send.to_vec(), dtype, op),
        )?;
        recv.copy_from_slice(&out);
        Ok(())
    }

    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> CommResult<()> {
        args::all_gather(self.size(), send.len(), recv.len(), dtype)
            .map_err(|e| self.invalid(OpKind::AllGather, e))?;
        let out = self.call(OpKind::AllGather, recv.len(), Job::AllGather(send.to_vec()))?;
        recv.copy_from_slice(&out);
        Ok(())
    }

    fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> CommResult<()> {
        args::broadcast(self.size(), buf.len(), dtype, root)
            .map_err(|e| self.invalid(OpKind::Broadcast, e))?;
        let out = self.call(
            OpKind::Broadcast,
            buf.len(),
            Job::Broadcast(buf.to_vec(), root),
        )?;
        buf.copy_from_slice(&out);
        Ok(())
    }

    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
    ) -> CommResult<()> {
        args::all_to_all(
            self.size(),
            send.len(),
            send_counts,
            recv.len(),
            recv_counts,
            dtype,
        )
        .map_err(|e| self.invalid(OpKind::AllToAll, e))?;
        let bytes = |c: &[usize]| c.iter().map(|x| x * dtype.size()).collect::<Vec<_>>();
        let (sb, rb) = (bytes(send_counts), bytes(recv_counts));
        let out = self.call(
            OpKind::AllToAll,
            send.len(),
            Job::AllToAll(send.to_vec(), sb, rb),
        )?;
        recv.copy_from_slice(&out);
        Ok(())
    }

    fn send_bytes(&self, buf: &[u8], _dtype: DType, dst: usize) -> CommResult<()> {
        args::peer(self.size(), self.rank, dst, "destination", true)
            .map_err(|e| self.invalid(OpKind::Send, e))?;
        self.call(OpKind::Send, buf.len(), Job::Send(buf.to_vec(), dst))
            .map(|_| ())
    }

    fn recv_bytes(&self, buf: &mut [u8], _dtype: DType, src: usize) -> CommResult<()> {
        args::peer(self.size(), self.rank, src, "source", true)
            .map_err(|e| self.invalid(OpKind::Recv, e))?;
        let out = self.call(OpKind::Recv, buf.len(), Job::Recv(buf.len(), src))?;
        buf.copy_from_slice(&out);
        Ok(())
    }

    fn barrier(&self) -> CommResult<()> {
        // NCCL has no barrier: a one-element all-reduce, waited for, is one.
        let mut one = [0u8; 4];
        self.all_reduce_bytes(&mut one, DType::F32, ReduceOp::Sum)
    }

    fn split(&self, color: usize, key: usize, label: &str) -> CommResult<Group> {
        // Every rank learns every rank's (color, key); each color's first rank by (key, rank)
        // creates a unique id, shared over this group.
        let mine = [color as u64, key as u64];
        let all = self.all_gather_vec(&mine)?;
        let mut same: Vec<(u64, usize)> = (0..self.size())
            .filter(|&r| all[2 * r] == color as u64)
            .map(|r| (all[2 * r + 1], r))
            .collect();
        same.sort();
        let sub_rank = same
            .iter()
            .position(|&(_, r)| r == self.rank)
            .expect("this rank has its own color");
        let leader = same[0].1 == self.rank;
        let id = if leader {
            id_bytes(&Id::new().map_err(|e| engine(format!("creating a unique id: {e:?}")))?)
        } else {
            vec![0u8; 128]
        };
        let ids = self.all_gather_vec(&id)?;
        let leader_id = &ids[same[0].1 * 128..same[0].1 * 128 + 128];
        let members: Vec<usize> = same.iter().map(|&(_, r)| self.members[r]).collect();
        let name = format!("{label}{members:?}");
        NcclComm::start(
            name,
            members,
            sub_rank,
            self.device,
            id_from(leader_id)?,
            self.timeout,
        )
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        Some(self)
    }
}
