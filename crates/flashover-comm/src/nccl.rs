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
//! `send` completes only with the matching `recv` (no buffering): this engine says so
//! (`sends_are_buffered` is false), and runs [`Communicator::exchange_bytes`] (and its device
//! form) as one NCCL group, so two ranks that send to each other in one batch do not deadlock.
//! Pipelines batch each run of sends and receives (placing interleaved 1F1B's steady-state
//! transfers as Megatron does where that is needed), and refuse only a schedule that would
//! still deadlock with unbuffered sends.
//!
//! [`DeviceCollectives`] (through [`Communicator::device_collectives`]) runs every operation on
//! memory another library owns, addressed by raw device pointer: the path Burn's CUDA tensors
//! take (flashover-runtime's `cuda_memory`), with no host round trip. `nccl_check` (in
//! `scripts/gpu_check.sh`) runs every operation on one GPU, byte-level and on device pointers
//! (all but the send/receive batch passed on an H200; that batch is newer), and on a machine
//! with several GPUs every operation at world size = their number (not yet run).

use crate::args;
use crate::communicator::{
    Communicator, CommunicatorExt, DeviceCollectives, DeviceTransfer, Group, Transfer,
};
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
    /// unique id; `exchange` must hand every rank every rank's blob (each names its GPU, rank
    /// 0's also carries the id; e.g. [`crate::Rendezvous`] or an MPI all-gather). Ranks that
    /// share a GPU are refused: NCCL needs one GPU per rank. Calls time out after `timeout`.
    pub fn group(
        rank: usize,
        world: usize,
        device: usize,
        timeout: Duration,
        exchange: impl FnOnce(&[u8]) -> Result<Vec<Vec<u8>>, String>,
    ) -> CommResult<Group> {
        Self::available()?;
        let gpu = CudaContext::new(device)
            .and_then(|ctx| ctx.uuid())
            .map_err(|e| engine(format!("GPU {device}: {e:?}")))?;
        let mut mine = gpu.bytes.iter().map(|&b| b as u8).collect::<Vec<u8>>();
        if rank == 0 {
            let id = Id::new().map_err(|e| engine(format!("creating the unique id: {e:?}")))?;
            mine.extend(id_bytes(&id));
        }
        let blobs =
            exchange(&mine).map_err(|e| engine(format!("exchanging the unique id: {e}")))?;
        let id = world_id(&blobs, world)?;
        let members = (0..world).collect();
        NcclComm::start("world".into(), members, rank, device, id, timeout)
    }
}

/// Bytes of a GPU's UUID at the start of every rank's blob.
const UUID_BYTES: usize = 16;

/// NCCL's unique id from every rank's blob (its GPU's UUID, then on rank 0 the id), after
/// checking that no two ranks name the same GPU.
fn world_id(blobs: &[Vec<u8>], world: usize) -> CommResult<Id> {
    if blobs.len() != world || blobs.iter().any(|b| b.len() < UUID_BYTES) {
        return Err(engine(format!(
            "the exchange gave {} blobs for {world} ranks, or one without its GPU",
            blobs.len()
        )));
    }
    let gpu = |r: usize| &blobs[r][..UUID_BYTES];
    for b in 1..world {
        if let Some(a) = (0..b).find(|&a| gpu(a) == gpu(b)) {
            let uuid: String = gpu(b).iter().map(|x| format!("{x:02x}")).collect();
            return Err(engine(format!(
                "ranks {a} and {b} are on the same GPU (UUID {uuid}); NCCL needs one GPU per rank: \
                 start at most as many ranks on a machine as it has GPUs, each on its own \
                 (LOCAL_RANK picks it)"
            )));
        }
    }
    id_from(&blobs[0][UUID_BYTES..])
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
    /// A byte-level call on host memory, staged through the thread's device scratch.
    Staged(Staged),
    /// On memory another library owns ([`DeviceCollectives`]).
    Device(DeviceJob),
}

/// A byte-level call: `input` is copied into the device scratch, `job` runs there (given the
/// input's address and the output's: the same for an in-place operation), and `output` bytes
/// are copied back. So the byte-level API is the device one plus two copies.
struct Staged {
    input: Vec<u8>,
    output: usize,
    in_place: bool,
    job: Box<dyn FnOnce(u64, u64) -> DeviceJob + Send>,
}

impl Staged {
    /// An in-place call on `data` (all-reduce, broadcast).
    fn in_place(data: &[u8], job: impl FnOnce(u64) -> DeviceJob + Send + 'static) -> Job {
        Job::Staged(Staged {
            input: data.to_vec(),
            output: data.len(),
            in_place: true,
            job: Box::new(move |at, _| job(at)),
        })
    }

    /// A call from `send` into `output` fresh bytes.
    fn out_of_place(
        send: &[u8],
        output: usize,
        job: impl FnOnce(u64, u64) -> DeviceJob + Send + 'static,
    ) -> Job {
        Job::Staged(Staged {
            input: send.to_vec(),
            output,
            in_place: false,
            job: Box::new(job),
        })
    }
}

/// Device memory the byte-level calls are staged through: allocated at the largest size asked
/// for so far and kept, so a call costs two copies rather than an allocation and a free.
#[derive(Default)]
struct Scratch {
    buf: Option<CudaSlice<u8>>,
}

impl Scratch {
    /// The address of at least `len` bytes of it.
    fn at_least(&mut self, stream: &Arc<CudaStream>, len: usize) -> Result<u64, String> {
        if self.buf.as_ref().is_none_or(|b| b.len() < len) {
            // The old buffer goes first, so growing never holds both.
            self.buf = None;
            let grown = stream
                .alloc_zeros::<u8>(len.max(1))
                .map_err(|e| format!("staging buffer of {len} bytes: {e:?}"))?;
            self.buf = Some(grown);
        }
        let buf = self.buf.as_ref().expect("allocated above");
        let (ptr, _synced) = buf.device_ptr(stream);
        Ok(ptr)
    }
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
    /// Sends and receives as one NCCL group.
    Exchange(Vec<DeviceTransfer>),
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
                let mut scratch = Scratch::default();
                for (job, reply) in rx {
                    let _ = reply.send(run(&stream, &comm, &mut scratch, job).map_err(engine));
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

/// One job on the communicator's thread; its stream is synchronised before the reply.
fn run(
    stream: &Arc<CudaStream>,
    comm: &Comm,
    scratch: &mut Scratch,
    job: Job,
) -> Result<Vec<u8>, String> {
    let err = |e: &dyn std::fmt::Debug| format!("{e:?}");
    match job {
        Job::Device(job) => {
            on_device(stream, comm, job)?;
            stream.synchronize().map_err(|e| err(&e))?;
            Ok(vec![])
        }
        Job::Staged(staged) => {
            // The output after the input, on an alignment NCCL is happy with.
            let output_at = if staged.in_place {
                0
            } else {
                staged.input.len().next_multiple_of(256)
            };
            let base = scratch.at_least(stream, output_at + staged.output)?;
            let output = base + output_at as u64;
            if !staged.input.is_empty() {
                let mut input = foreign::<u8>(stream, base, staged.input.len());
                stream
                    .memcpy_htod(staged.input.as_slice(), &mut input)
                    .map_err(|e| err(&e))?;
            }
            on_device(stream, comm, (staged.job)(base, output))?;
            let mut out = vec![0u8; staged.output];
            if !out.is_empty() {
                let result = foreign::<u8>(stream, output, out.len());
                stream
                    .memcpy_dtoh(&result, out.as_mut_slice())
                    .map_err(|e| err(&e))?;
            }
            stream.synchronize().map_err(|e| err(&e))?;
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

/// An all-to-all on the communicator's stream: `send_counts[peer]` elements of `dtype` from
/// `send` (end to end, in peer order) to each peer, `recv_counts[peer]` from each into `recv`.
/// One NCCL group of sends and receives, so no pair waits on another.
fn all_to_all_on_device(
    stream: &Arc<CudaStream>,
    comm: &Comm,
    (send, send_counts): (u64, &[usize]),
    (recv, recv_counts): (u64, &[usize]),
    dtype: DType,
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Debug| format!("{e:?}");
    let bytes =
        |ptr: u64, count: usize, dtype: DType| foreign::<u8>(stream, ptr, count * dtype.size());
    let size = dtype.size() as u64;
    cudarc::nccl::group_start().map_err(|e| err(&e))?;
    let (mut s_at, mut r_at) = (send, recv);
    let mut posted = Ok(());
    for (peer, (&s, &r)) in send_counts.iter().zip(recv_counts).enumerate() {
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
        } => all_to_all_on_device(
            stream,
            comm,
            (send, &send_counts),
            (recv, &recv_counts),
            dtype,
        ),
        DeviceJob::Send(ptr, count, dtype, dst) => comm
            .send(&bytes(ptr, count, dtype), dst as i32)
            .map_err(|e| err(&e)),
        DeviceJob::Recv(ptr, count, dtype, src) => comm
            .recv(&mut bytes(ptr, count, dtype), src as i32)
            .map(drop)
            .map_err(|e| err(&e)),
        DeviceJob::Exchange(transfers) => {
            // One NCCL group, so a pair that sends to each other does not wait on itself.
            cudarc::nccl::group_start().map_err(|e| err(&e))?;
            let mut posted = Ok(());
            for t in transfers.iter().filter(|t| t.count > 0) {
                if posted.is_err() {
                    break;
                }
                let mut at = bytes(t.ptr, t.count, t.dtype);
                posted = if t.send {
                    comm.send(&at, t.peer as i32)
                } else {
                    comm.recv(&mut at, t.peer as i32).map(drop)
                };
            }
            let ended = cudarc::nccl::group_end();
            posted.map_err(|e| err(&e))?;
            ended.map(drop).map_err(|e| err(&e))
        }
    }
}

impl NcclComm {
    /// Every transfer's peer is a rank of the group (oneself included: NCCL completes a
    /// transfer to oneself inside a group).
    fn check_peers(&self, transfers: &[DeviceTransfer]) -> Result<(), String> {
        transfers.iter().try_for_each(|t| {
            let what = if t.send { "destination" } else { "source" };
            args::peer(self.size(), self.rank, t.peer, what, true)
        })
    }

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

    unsafe fn exchange_device(&self, transfers: &[DeviceTransfer]) -> CommResult<()> {
        let check = self.check_peers(transfers);
        let bytes = transfers.iter().map(|t| t.count * t.dtype.size()).sum();
        let job = DeviceJob::Exchange(transfers.to_vec());
        self.device_call(OpKind::Exchange, bytes, check, job)
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
        let count = buf.len() / dtype.size();
        let job = Staged::in_place(buf, move |at| DeviceJob::AllReduce(at, count, dtype, op));
        let out = self.call(OpKind::AllReduce, buf.len(), job)?;
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
        let count = recv.len() / dtype.size();
        let job = Staged::out_of_place(send, recv.len(), move |s, r| {
            DeviceJob::ReduceScatter(s, r, count, dtype, op)
        });
        let out = self.call(OpKind::ReduceScatter, send.len(), job)?;
        recv.copy_from_slice(&out);
        Ok(())
    }

    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> CommResult<()> {
        args::all_gather(self.size(), send.len(), recv.len(), dtype)
            .map_err(|e| self.invalid(OpKind::AllGather, e))?;
        let count = send.len() / dtype.size();
        let job = Staged::out_of_place(send, recv.len(), move |s, r| {
            DeviceJob::AllGather(s, r, count, dtype)
        });
        let out = self.call(OpKind::AllGather, recv.len(), job)?;
        recv.copy_from_slice(&out);
        Ok(())
    }

    fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> CommResult<()> {
        args::broadcast(self.size(), buf.len(), dtype, root)
            .map_err(|e| self.invalid(OpKind::Broadcast, e))?;
        let count = buf.len() / dtype.size();
        let job = Staged::in_place(buf, move |at| DeviceJob::Broadcast(at, count, dtype, root));
        let out = self.call(OpKind::Broadcast, buf.len(), job)?;
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
        let (send_counts, recv_counts) = (send_counts.to_vec(), recv_counts.to_vec());
        let job = Staged::out_of_place(send, recv.len(), move |s, r| DeviceJob::AllToAll {
            send: s,
            send_counts,
            recv: r,
            recv_counts,
            dtype,
        });
        let out = self.call(OpKind::AllToAll, send.len(), job)?;
        recv.copy_from_slice(&out);
        Ok(())
    }

    fn send_bytes(&self, buf: &[u8], _dtype: DType, dst: usize) -> CommResult<()> {
        args::peer(self.size(), self.rank, dst, "destination", true)
            .map_err(|e| self.invalid(OpKind::Send, e))?;
        // As bytes: the message's length need not be whole elements of its tag.
        let count = buf.len();
        let job = Staged::out_of_place(buf, 0, move |s, _| {
            DeviceJob::Send(s, count, DType::U8, dst)
        });
        self.call(OpKind::Send, buf.len(), job).map(|_| ())
    }

    fn recv_bytes(&self, buf: &mut [u8], _dtype: DType, src: usize) -> CommResult<()> {
        args::peer(self.size(), self.rank, src, "source", true)
            .map_err(|e| self.invalid(OpKind::Recv, e))?;
        let count = buf.len();
        let job = Staged::out_of_place(&[], count, move |_, r| {
            DeviceJob::Recv(r, count, DType::U8, src)
        });
        let out = self.call(OpKind::Recv, buf.len(), job)?;
        buf.copy_from_slice(&out);
        Ok(())
    }

    fn exchange_bytes(&self, transfers: &mut [Transfer<'_>]) -> CommResult<()> {
        // Sends laid end to end in the scratch's input, receives in its output, each at an
        // offset NCCL is happy with (`ptr` holds the offset until the scratch's address is
        // known); one group runs them all.
        let mut input = vec![];
        let mut output = 0usize;
        let placed: Vec<DeviceTransfer> = (transfers.iter())
            .map(|t| {
                let (peer, send, start) = match t {
                    Transfer::Send { buf, dst, .. } => {
                        let start = input.len();
                        input.extend_from_slice(buf);
                        input.resize((start + buf.len()).next_multiple_of(256), 0);
                        (*dst, true, start)
                    }
                    Transfer::Recv { buf, src, .. } => {
                        let start = output;
                        output = (start + buf.len()).next_multiple_of(256);
                        (*src, false, start)
                    }
                };
                DeviceTransfer {
                    ptr: start as u64,
                    count: t.len(),
                    dtype: DType::U8,
                    peer,
                    send,
                }
            })
            .collect();
        self.check_peers(&placed)
            .map_err(|e| self.invalid(OpKind::Exchange, e))?;
        let bytes = transfers.iter().map(Transfer::len).sum();
        let offsets = placed.clone();
        let job = Job::Staged(Staged {
            input,
            output,
            in_place: false,
            job: Box::new(move |s, r| {
                let at = |t: DeviceTransfer| DeviceTransfer {
                    ptr: t.ptr + if t.send { s } else { r },
                    ..t
                };
                DeviceJob::Exchange(placed.into_iter().map(at).collect())
            }),
        });
        let out = self.call(OpKind::Exchange, bytes, job)?;
        for (t, place) in transfers.iter_mut().zip(offsets) {
            if let Transfer::Recv { buf, .. } = t {
                let offset = place.ptr as usize;
                buf.copy_from_slice(&out[offset..offset + buf.len()]);
            }
        }
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

    fn sends_are_buffered(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A blob as rank `r` would send it: its GPU's UUID (`gpu` repeated), then on rank 0 an id.
    fn blob(r: usize, gpu: u8) -> Vec<u8> {
        let mut b = vec![gpu; UUID_BYTES];
        if r == 0 {
            b.extend(vec![7u8; 128]);
        }
        b
    }

    #[test]
    fn ranks_on_distinct_gpus_join() {
        let blobs = vec![blob(0, 1), blob(1, 2), blob(2, 3)];
        assert!(world_id(&blobs, 3).is_ok());
    }

    #[test]
    fn ranks_sharing_a_gpu_are_refused_by_name() {
        let blobs = vec![blob(0, 1), blob(1, 2), blob(2, 1)];
        let err = world_id(&blobs, 3).unwrap_err().to_string();
        assert!(err.contains("ranks 0 and 2 are on the same GPU"), "{err}");
        assert!(err.contains("one GPU per rank"), "{err}");
    }

    #[test]
    fn a_short_exchange_is_refused() {
        let err = world_id(&[blob(0, 1)], 2).unwrap_err().to_string();
        assert!(err.contains("1 blobs for 2 ranks"), "{err}");
        let err = world_id(&[blob(0, 1), vec![]], 2).unwrap_err().to_string();
        assert!(err.contains("without its GPU"), "{err}");
    }
}
