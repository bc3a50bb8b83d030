//! The `Communicator` trait every engine implements, its typed extension and the `Group` handle.

use crate::dtype::{DType, Element};
use crate::error::CommResult;
use crate::op::ReduceOp;
use crate::stats::CommStats;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

/// Collective communication over one process group.
///
/// Ranks are numbered `0..size()` within the group. Buffers are raw bytes tagged with a
/// [`DType`], so the trait is object-safe and maps one to one onto MPI and NCCL calls; use
/// [`CommunicatorExt`] for typed slices. Every call is collective over the group unless stated
/// otherwise: all ranks must make the same calls in the same order, and an engine reports a
/// mismatch or a missing rank as a [`crate::CommError`] instead of hanging.
pub trait Communicator: Send + Sync {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// The group's name, used in errors (e.g. `world`, `tp[2,3]`).
    fn name(&self) -> &str;
    /// The global (world) rank of each group rank, in group-rank order.
    fn members(&self) -> &[usize];

    /// In place: every rank's `buf` becomes the element-wise reduction of all ranks' `buf`.
    fn all_reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> CommResult<()>;
    /// `send` holds `size()` equal blocks; rank `r` receives into `recv` the reduction of every
    /// rank's block `r`. `send.len() == size() * recv.len()`.
    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> CommResult<()>;
    /// `recv` becomes the concatenation of every rank's `send`, in rank order.
    /// `recv.len() == size() * send.len()`.
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> CommResult<()>;
    /// Every rank's `buf` becomes `root`'s.
    fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> CommResult<()>;
    /// Variable all-to-all. `send` is split into `size()` consecutive segments of
    /// `send_counts[j]` elements, segment `j` going to rank `j`; `recv` receives from rank `j`
    /// a segment of `recv_counts[j]` elements, in rank order. Counts are in elements and must
    /// agree pairwise (`send_counts` of rank `i` at `j` == `recv_counts` of rank `j` at `i`).
    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
    ) -> CommResult<()>;
    /// Point to point (not collective): sends `buf` to group rank `dst`. Returns once the data
    /// is buffered or delivered; messages between a pair arrive in order.
    fn send_bytes(&self, buf: &[u8], dtype: DType, dst: usize) -> CommResult<()>;
    /// Point to point (not collective): receives the next message from group rank `src` into
    /// `buf`, whose length and dtype must match the message.
    fn recv_bytes(&self, buf: &mut [u8], dtype: DType, src: usize) -> CommResult<()>;
    /// Point to point (not collective): the sends and receives of `transfers`, progressing
    /// together, returning once all are done. Two ranks that send to each other at once put
    /// both transfers in one batch on each side, so the exchange cannot deadlock on an engine
    /// whose sends wait for their receives ([`Communicator::sends_are_buffered`] false; NCCL
    /// runs a batch as one group). Messages between a pair still arrive in order. The default
    /// sends, then receives, which is right wherever sends are buffered.
    fn exchange_bytes(&self, transfers: &mut [Transfer<'_>]) -> CommResult<()> {
        for t in transfers.iter() {
            if let Transfer::Send { buf, dtype, dst } = t {
                self.send_bytes(buf, *dtype, *dst)?;
            }
        }
        for t in transfers.iter_mut() {
            if let Transfer::Recv { buf, dtype, src } = t {
                self.recv_bytes(buf, *dtype, *src)?;
            }
        }
        Ok(())
    }
    /// Returns once every rank of the group has called `barrier`.
    fn barrier(&self) -> CommResult<()>;
    /// Collective: splits the group into sub-groups of the ranks that pass the same `color`,
    /// ordered by `key` (ties by rank). `label` names the new group in errors (`tp`, `dp`, ...).
    fn split(&self, color: usize, key: usize, label: &str) -> CommResult<Group>;
    /// A snapshot of this communicator's counters.
    fn stats(&self) -> CommStats;
    /// The engine's collectives on device memory, in place and without host copies, where it
    /// has them (NCCL); `None` (the default) where buffers pass through host memory.
    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        None
    }
    /// This process's rank failed (`why`) and will not call the group's collectives again:
    /// end the job for its peers in other processes now (MPI aborts the job), rather than
    /// leave them waiting until their deadlines. In-process peers learn it from the launcher;
    /// the default does nothing.
    fn abandon(&self, why: &str) {
        let _ = why;
    }
    /// Whether [`Communicator::send_bytes`] can return before the receiver calls
    /// [`Communicator::recv_bytes`] (the engine buffers the message). NCCL's sends wait for
    /// their receives: two ranks that send to each other at once must then do it in one
    /// [`Communicator::exchange_bytes`] batch, as pipelines do.
    fn sends_are_buffered(&self) -> bool {
        true
    }
    /// The calling thread waited `waited` for collectives it had handed to a communication
    /// thread on this group (a stream's result). Recorded where the group is flight-recorded
    /// ([`crate::FlightRecorder::traffic`]), so exposed communication can be told from
    /// overlapped; the engines themselves ignore it.
    fn record_wait(&self, waited: std::time::Duration) {
        let _ = waited;
    }
}

/// One transfer of a batch ([`Communicator::exchange_bytes`]).
pub enum Transfer<'a> {
    /// `buf` to group rank `dst`.
    Send {
        /// The bytes sent.
        buf: &'a [u8],
        /// Their element type.
        dtype: DType,
        /// Group rank they go to.
        dst: usize,
    },
    /// The next message from group rank `src` into `buf` (length and dtype must match it).
    Recv {
        /// Where the message goes.
        buf: &'a mut [u8],
        /// Its element type.
        dtype: DType,
        /// Group rank it comes from.
        src: usize,
    },
}

impl Transfer<'_> {
    /// The bytes this transfer moves.
    pub fn len(&self) -> usize {
        match self {
            Transfer::Send { buf, .. } => buf.len(),
            Transfer::Recv { buf, .. } => buf.len(),
        }
    }

    /// Whether it moves no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One transfer of a batch on device memory ([`DeviceCollectives::exchange_device`]): `count`
/// elements of `dtype` at `ptr`, sent to or received from group rank `peer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceTransfer {
    /// Device address of the elements.
    pub ptr: u64,
    /// How many elements.
    pub count: usize,
    /// Their type.
    pub dtype: DType,
    /// The group rank at the other end.
    pub peer: usize,
    /// Whether this rank sends them (else it receives into `ptr`).
    pub send: bool,
}

/// Collectives on memory of the communicator's GPU, addressed by raw device pointer (what a
/// tensor library hands out for its buffers): every operation of [`Communicator`], with no
/// host copy. Each call is collective like its byte-level counterpart, checks its arguments as
/// that one does, and returns once the result is in place on the device.
pub trait DeviceCollectives {
    /// The ordinal of the GPU whose memory the pointers must address.
    fn device_ordinal(&self) -> usize;

    /// In place: the `count` elements of `dtype` at `ptr` become their reduction over the group.
    ///
    /// # Safety
    /// `ptr` must address at least `count` elements of `dtype` in this communicator's GPU's
    /// memory, every earlier write to them must be complete (synchronise the stream that wrote
    /// them), and nothing may read or write them until this returns.
    unsafe fn all_reduce_device(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> CommResult<()>;

    /// In place: every rank's `count` elements at `ptr` become `root`'s.
    ///
    /// # Safety
    /// As [`DeviceCollectives::all_reduce_device`].
    unsafe fn broadcast_device(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        root: usize,
    ) -> CommResult<()>;

    /// Every rank's `count` elements at `send`, end to end in rank order, into the
    /// `count * size()` elements at `recv`.
    ///
    /// # Safety
    /// As [`DeviceCollectives::all_reduce_device`], for both buffers; they must not overlap.
    unsafe fn all_gather_device(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
    ) -> CommResult<()>;

    /// This rank's block (`count` elements at `recv`) of the reduction over the group of the
    /// `count * size()` elements at `send`.
    ///
    /// # Safety
    /// As [`DeviceCollectives::all_gather_device`].
    unsafe fn reduce_scatter_device(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> CommResult<()>;

    /// Variable all-to-all, counts in elements, as [`Communicator::all_to_all_v_bytes`]: the
    /// `send_counts[j]` elements after those for ranks before `j` go to rank `j`; `recv` gets
    /// the `recv_counts[j]` elements from each rank `j`, in rank order.
    ///
    /// # Safety
    /// As [`DeviceCollectives::all_gather_device`], with `send` and `recv` holding the sums of
    /// their counts.
    unsafe fn all_to_all_v_device(
        &self,
        send: u64,
        send_counts: &[usize],
        recv: u64,
        recv_counts: &[usize],
        dtype: DType,
    ) -> CommResult<()>;

    /// Sends the `count` elements at `ptr` to group rank `dst`.
    ///
    /// # Safety
    /// As [`DeviceCollectives::all_reduce_device`].
    unsafe fn send_device(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        dst: usize,
    ) -> CommResult<()>;

    /// Receives `count` elements from group rank `src` into `ptr`.
    ///
    /// # Safety
    /// As [`DeviceCollectives::all_reduce_device`].
    unsafe fn recv_device(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        src: usize,
    ) -> CommResult<()>;

    /// The sends and receives of `transfers` as one batch, as
    /// [`Communicator::exchange_bytes`].
    ///
    /// # Safety
    /// As [`DeviceCollectives::all_reduce_device`], for every transfer's buffer; no buffer may
    /// overlap a receive's.
    unsafe fn exchange_device(&self, transfers: &[DeviceTransfer]) -> CommResult<()>;
}

/// Typed convenience methods for every [`Communicator`].
pub trait CommunicatorExt: Communicator {
    /// [`Communicator::all_reduce_bytes`] on a typed slice.
    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> CommResult<()> {
        self.all_reduce_bytes(bytemuck::cast_slice_mut(buf), T::DTYPE, op)
    }
    /// [`Communicator::reduce_scatter_bytes`] on typed slices.
    fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> CommResult<()> {
        self.reduce_scatter_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
            op,
        )
    }
    /// [`Communicator::all_gather_bytes`] on typed slices.
    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> CommResult<()> {
        self.all_gather_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
        )
    }
    /// [`Communicator::all_gather_bytes`] into a new vector of `size() * send.len()` elements.
    fn all_gather_vec<T: Element>(&self, send: &[T]) -> CommResult<Vec<T>> {
        let mut recv = vec![T::zeroed(); send.len() * self.size()];
        self.all_gather(send, &mut recv)?;
        Ok(recv)
    }
    /// [`Communicator::broadcast_bytes`] on a typed slice.
    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> CommResult<()> {
        self.broadcast_bytes(bytemuck::cast_slice_mut(buf), T::DTYPE, root)
    }
    /// [`Communicator::all_to_all_v_bytes`] on typed slices.
    fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> CommResult<()> {
        self.all_to_all_v_bytes(
            bytemuck::cast_slice(send),
            send_counts,
            bytemuck::cast_slice_mut(recv),
            recv_counts,
            T::DTYPE,
        )
    }
    /// Variable all-to-all when only the send side is known: exchanges the counts first (one
    /// small all-to-all), then the data. Returns the received elements and the per-source counts.
    fn all_to_all_v_exchange<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
    ) -> CommResult<(Vec<T>, Vec<usize>)> {
        let n = self.size();
        let counts: Vec<u64> = send_counts.iter().map(|&c| c as u64).collect();
        let mut recv_counts = vec![0u64; n];
        self.all_to_all_v(&counts, &vec![1; n], &mut recv_counts, &vec![1; n])?;
        let recv_counts: Vec<usize> = recv_counts.iter().map(|&c| c as usize).collect();
        let mut recv = vec![T::zeroed(); recv_counts.iter().sum()];
        self.all_to_all_v(send, send_counts, &mut recv, &recv_counts)?;
        Ok((recv, recv_counts))
    }
    /// [`Communicator::send_bytes`] on a typed slice.
    fn send<T: Element>(&self, buf: &[T], dst: usize) -> CommResult<()> {
        self.send_bytes(bytemuck::cast_slice(buf), T::DTYPE, dst)
    }
    /// [`Communicator::recv_bytes`] on a typed slice.
    fn recv<T: Element>(&self, buf: &mut [T], src: usize) -> CommResult<()> {
        self.recv_bytes(bytemuck::cast_slice_mut(buf), T::DTYPE, src)
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}

/// A process group: a cheap, clonable handle to a [`Communicator`].
///
/// Groups are values: the launcher builds one per mesh axis and hands them to whatever
/// communicates. Dereferences to the communicator, so `group.all_reduce(..)` works directly.
#[derive(Clone)]
pub struct Group(Arc<dyn Communicator>);

impl Group {
    /// Wraps a communicator.
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Group(comm)
    }

    /// The shared communicator.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.0
    }
}

impl Deref for Group {
    type Target = dyn Communicator;
    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}

impl fmt::Debug for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Group({} rank {}/{})",
            self.name(),
            self.rank(),
            self.size()
        )
    }
}
