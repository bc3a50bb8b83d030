//! The MPI engine (feature `mpi`): one rank per process, over the system's MPI through rsmpi.
//!
//! Results are the thread engine's, bit for bit: reductions are not left to MPI's algorithms
//! (whose summation order depends on the library, the message size and the world size) but
//! done the thread engine's way, with MPI moving the bytes: each rank receives its chunk of
//! every rank's buffer (`Alltoallv`), folds the chunks in rank order with the same kernel, and
//! the reduced chunks are gathered back (`Allgatherv`). Sends are non-blocking and buffered by
//! us, so point-to-point messages never wait for their receive (as the thread engine's).
//!
//! MPI calls cannot be interrupted, so deadlines are kept by a watchdog: a collective that has
//! not completed within the communicator's timeout prints an error naming the operation, the
//! group and its sequence number, and aborts the whole MPI job (`MPI_Abort`), so every process
//! exits non-zero instead of hanging. MPI does not tell which ranks did not arrive.

use crate::args;
use crate::communicator::{Communicator, Group};
use crate::dtype::DType;
use crate::error::{CommError, CommResult};
use crate::op::{OpKind, ReduceOp};
use crate::stats::{CommStats, StatsRecorder};
use crate::thread::kernels::{chunk, reduce_chunk};
use mpi::datatype::{Partition, PartitionMut};
use mpi::request::StaticScope;
use mpi::topology::{Color, Communicator as _, SimpleCommunicator};
use mpi::traits::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// The process's MPI environment: initialised once (with `MPI_THREAD_MULTIPLE`, which the
/// strategies' communication threads need) and finalised when the last handle (every
/// communicator holds one) is dropped. MPI cannot be initialised again after that.
pub struct MpiWorld {
    // Fields drop in order: MPI handles before the universe, whose drop finalises MPI.
    world: SimpleCommunicator,
    watchdog: Arc<Watchdog>,
    _universe: mpi::environment::Universe,
}

// SAFETY: MPI was initialised with MPI_THREAD_MULTIPLE (checked in `MpiWorld::init`), so its
// handles may be used from any thread.
unsafe impl Send for MpiWorld {}
unsafe impl Sync for MpiWorld {}

/// The live environment, if any, and whether MPI was ever initialised in this process.
static LIVE: Mutex<(Weak<MpiWorld>, bool)> = Mutex::new((Weak::new(), false));

impl MpiWorld {
    /// Initialises MPI (once per process; later calls return the same world). Fails when the
    /// library cannot provide `MPI_THREAD_MULTIPLE`.
    pub fn init() -> CommResult<Arc<MpiWorld>> {
        let fail = |detail: String| CommError::Engine {
            engine: "mpi",
            detail,
        };
        let mut live = LIVE.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(env) = live.0.upgrade() {
            return Ok(env);
        }
        if live.1 {
            return Err(fail(
                "MPI was finalised when its last communicator was dropped; it cannot be initialised twice in one process".into(),
            ));
        }
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or_else(|| fail("MPI was already initialised by someone else".into()))?;
        live.1 = true;
        if threading != mpi::Threading::Multiple {
            return Err(fail(format!(
                "the MPI library provides {threading:?} threading; Flashover needs Multiple"
            )));
        }
        let env = Arc::new(MpiWorld {
            world: universe.world(),
            watchdog: Watchdog::start(),
            _universe: universe,
        });
        live.0 = Arc::downgrade(&env);
        Ok(env)
    }

    /// This process's rank in the MPI world.
    pub fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    /// Number of processes in the MPI world.
    pub fn size(&self) -> usize {
        self.world.size() as usize
    }

    /// The world as a [`Group`] whose collectives time out (abort the job) after `timeout`.
    pub fn group(self: &Arc<Self>, timeout: Duration) -> Group {
        let size = self.size();
        Group::new(Arc::new(MpiComm {
            env: self.clone(),
            comm: self.world.duplicate(),
            name: "world".into(),
            members: (0..size).collect(),
            rank: self.rank(),
            timeout,
            seq: AtomicU64::new(0),
            stats: StatsRecorder::default(),
            sends: Mutex::new(vec![]),
            scratch: Mutex::new(vec![]),
        }))
    }
}

/// Watches every collective in flight and aborts the job when one outlives its deadline. It
/// holds no MPI handle (it may outlive the environment by one tick).
struct Watchdog {
    in_flight: Mutex<Vec<(u64, String, Instant)>>,
    next: AtomicU64,
}

impl Watchdog {
    fn start() -> Arc<Watchdog> {
        let dog = Arc::new(Watchdog {
            in_flight: Mutex::new(vec![]),
            next: AtomicU64::new(0),
        });
        let watcher = Arc::downgrade(&dog);
        std::thread::Builder::new()
            .name("mpi-watchdog".into())
            .spawn(move || {
                while let Some(dog) = watcher.upgrade() {
                    let expired = {
                        let list = dog.in_flight.lock().unwrap_or_else(|p| p.into_inner());
                        list.iter()
                            .find(|(_, _, deadline)| Instant::now() > *deadline)
                            .map(|(_, what, _)| what.clone())
                    };
                    if let Some(what) = expired {
                        eprintln!(
                            "flashover: {what}; MPI cannot name the ranks that did not arrive \
                             (see the other ranks' errors); aborting the MPI job"
                        );
                        SimpleCommunicator::world().abort(3);
                    }
                    drop(dog);
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
            .expect("spawning the MPI watchdog");
        dog
    }

    /// Registers an operation that must end before `deadline`; returns its ticket.
    fn enter(&self, what: String, deadline: Instant) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((id, what, deadline));
        id
    }

    fn leave(&self, id: u64) {
        self.in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(i, _, _)| *i != id);
    }
}

/// A send in flight: MPI owns `buf` (leaked for `'static`) until the request completes.
struct PendingSend {
    request: mpi::request::Request<'static, [u64], StaticScope>,
    buf: *mut [u64],
}

// SAFETY: the request and the buffer it reads are only touched under the communicator's lock.
unsafe impl Send for PendingSend {}

impl PendingSend {
    /// Waits for the send and frees its buffer.
    fn finish(self) {
        self.request.wait();
        // SAFETY: `buf` came from `Box::leak` and MPI no longer reads it.
        drop(unsafe { Box::from_raw(self.buf) });
    }
}

/// One group's communicator on the MPI engine.
pub struct MpiComm {
    // Dropped before `env`, whose last handle finalises MPI.
    comm: SimpleCommunicator,
    env: Arc<MpiWorld>,
    name: String,
    members: Vec<usize>,
    rank: usize,
    timeout: Duration,
    seq: AtomicU64,
    stats: StatsRecorder,
    sends: Mutex<Vec<PendingSend>>,
    /// Reused receive buffer of reductions (8-byte words: aligned for every element type).
    scratch: Mutex<Vec<u64>>,
}

// SAFETY: see `MpiWorld` (MPI_THREAD_MULTIPLE); pending sends sit behind a mutex.
unsafe impl Send for MpiComm {}
unsafe impl Sync for MpiComm {}

impl Drop for MpiComm {
    fn drop(&mut self) {
        for send in self.sends.get_mut().map(std::mem::take).unwrap_or_default() {
            send.finish();
        }
    }
}

/// `len` bytes in an 8-byte-aligned buffer (so reductions can read any element type in place).
fn aligned(len: usize) -> Vec<u64> {
    vec![0u64; len.div_ceil(8)]
}

fn bytes_of(v: &[u64], len: usize) -> &[u8] {
    &bytemuck::cast_slice(v)[..len]
}

fn bytes_of_mut(v: &mut [u64], len: usize) -> &mut [u8] {
    &mut bytemuck::cast_slice_mut(v)[..len]
}

fn counts_displs(lens: &[usize]) -> CommResult<(Vec<i32>, Vec<i32>)> {
    let too_big = || CommError::InvalidArgument {
        op: OpKind::AllToAll,
        group: String::new(),
        detail: "a message over 2 GiB (MPI counts are 32-bit)".into(),
    };
    let counts = lens
        .iter()
        .map(|&l| i32::try_from(l).map_err(|_| too_big()))
        .collect::<CommResult<Vec<i32>>>()?;
    let mut displs = Vec::with_capacity(lens.len());
    let mut at = 0i32;
    for &c in &counts {
        displs.push(at);
        at = at.checked_add(c).ok_or_else(too_big)?;
    }
    Ok((counts, displs))
}

impl MpiComm {
    /// Runs `f` as operation `op` under the watchdog, recording its statistics.
    fn run<T>(&self, op: OpKind, bytes: usize, f: impl FnOnce() -> CommResult<T>) -> CommResult<T> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let what = format!(
            "{op} #{seq} in group {} (rank {} of {}) timed out after {:?}",
            self.name,
            self.members[self.rank],
            self.members.len(),
            self.timeout
        );
        let ticket = self.env.watchdog.enter(what, started + self.timeout);
        let out = f();
        self.env.watchdog.leave(ticket);
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

    /// Reduces every rank's `buf` element-wise in rank order and calls `with` on this rank's
    /// chunk (`chunk_of(rank)`) of the result (see the module docs). The received chunks and
    /// the result live in the communicator's scratch buffer, reused from call to call.
    fn reduce_my_chunk<T>(
        &self,
        buf: &[u8],
        dtype: DType,
        op: ReduceOp,
        chunk_of: impl Fn(usize) -> std::ops::Range<usize>,
        with: impl FnOnce(&[u8]) -> CommResult<T>,
    ) -> CommResult<T> {
        let n = self.size();
        let es = dtype.size();
        let send_lens: Vec<usize> = (0..n).map(|r| chunk_of(r).len() * es).collect();
        let mine = chunk_of(self.rank).len() * es;
        let (sc, sd) = counts_displs(&send_lens)?;
        let (rc, rd) = counts_displs(&vec![mine; n])?;
        let mut gathered = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let words = (mine * n).div_ceil(8);
        if gathered.len() < words {
            gathered.resize(words, 0);
        }
        {
            let send = Partition::new(buf, &sc[..], &sd[..]);
            let recv_bytes = bytes_of_mut(&mut gathered, mine * n);
            let mut recv = PartitionMut::new(recv_bytes, &rc[..], &rd[..]);
            self.comm.all_to_all_varcount_into(&send, &mut recv);
        }
        let base = gathered.as_mut_ptr() as usize;
        let srcs: Vec<usize> = (0..n).map(|r| base + r * mine).collect();
        // SAFETY: every source is `mine` bytes inside `gathered`, whose chunks start at
        // multiples of `mine` (a multiple of the element size) from an 8-byte-aligned base, so
        // every element is aligned; the result goes into the first chunk, which the kernel
        // allows; the lock keeps everyone else out.
        unsafe {
            reduce_chunk(dtype, op, &srcs, base, 0..mine / es.max(1));
        }
        with(bytes_of(&gathered, mine))
    }
}

impl Communicator for MpiComm {
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
        let (n, es) = (self.size(), dtype.size());
        let count =
            args::elements(buf.len(), dtype).map_err(|e| self.invalid(OpKind::AllReduce, e))?;
        self.run(OpKind::AllReduce, buf.len(), || {
            let lens: Vec<usize> = (0..n).map(|r| chunk(count, n, r).len() * es).collect();
            let (c, d) = counts_displs(&lens)?;
            // The reduced chunk is copied out of the scratch so `buf` can be the destination.
            let mine =
                self.reduce_my_chunk(buf, dtype, op, |r| chunk(count, n, r), |m| Ok(m.to_vec()))?;
            let mut recv = PartitionMut::new(&mut buf[..], &c[..], &d[..]);
            self.comm.all_gather_varcount_into(&mine[..], &mut recv);
            Ok(())
        })
    }

    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> CommResult<()> {
        let block = args::reduce_scatter(self.size(), send.len(), recv.len(), dtype)
            .map_err(|e| self.invalid(OpKind::ReduceScatter, e))?;
        self.run(OpKind::ReduceScatter, send.len(), || {
            self.reduce_my_chunk(
                send,
                dtype,
                op,
                |r| r * block..(r + 1) * block,
                |m| {
                    recv.copy_from_slice(m);
                    Ok(())
                },
            )
        })
    }

    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> CommResult<()> {
        args::all_gather(self.size(), send.len(), recv.len(), dtype)
            .map_err(|e| self.invalid(OpKind::AllGather, e))?;
        self.run(OpKind::AllGather, recv.len(), || {
            self.comm.all_gather_into(send, recv);
            Ok(())
        })
    }

    fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> CommResult<()> {
        args::broadcast(self.size(), buf.len(), dtype, root)
            .map_err(|e| self.invalid(OpKind::Broadcast, e))?;
        self.run(OpKind::Broadcast, buf.len(), || {
            self.comm
                .process_at_rank(root as i32)
                .broadcast_into(&mut buf[..]);
            Ok(())
        })
    }

    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
    ) -> CommResult<()> {
        let es = dtype.size();
        args::all_to_all(
            self.size(),
            send.len(),
            send_counts,
            recv.len(),
            recv_counts,
            dtype,
        )
        .map_err(|e| self.invalid(OpKind::AllToAll, e))?;
        let bytes = |c: &[usize]| c.iter().map(|x| x * es).collect::<Vec<_>>();
        let (sc, sd) = counts_displs(&bytes(send_counts))?;
        let (rc, rd) = counts_displs(&bytes(recv_counts))?;
        self.run(OpKind::AllToAll, send.len(), || {
            let s = Partition::new(send, &sc[..], &sd[..]);
            let mut r = PartitionMut::new(&mut recv[..], &rc[..], &rd[..]);
            self.comm.all_to_all_varcount_into(&s, &mut r);
            Ok(())
        })
    }

    fn send_bytes(&self, buf: &[u8], _dtype: DType, dst: usize) -> CommResult<()> {
        args::peer(self.size(), self.rank, dst, "destination", true)
            .map_err(|e| self.invalid(OpKind::Send, e))?;
        self.run(OpKind::Send, buf.len(), || {
            let mut sends = self.sends.lock().unwrap_or_else(|p| p.into_inner());
            // Free the buffers of sends that have completed.
            let mut still = Vec::with_capacity(sends.len());
            for s in sends.drain(..) {
                match s.request.test() {
                    // SAFETY: the send completed; `buf` came from `Box::leak`.
                    Ok(_) => drop(unsafe { Box::from_raw(s.buf) }),
                    Err(request) => still.push(PendingSend {
                        request,
                        buf: s.buf,
                    }),
                }
            }
            *sends = still;
            // The message is a length word followed by the bytes (padded to 8): the receiver
            // checks the length, so a mismatch is an error rather than a truncation.
            let mut owned = aligned(buf.len() + 8);
            owned[0] = buf.len() as u64;
            bytes_of_mut(&mut owned[1..], buf.len()).copy_from_slice(buf);
            let leaked: &'static mut [u64] = Box::leak(owned.into_boxed_slice());
            let ptr: *mut [u64] = leaked;
            // SAFETY: MPI only reads the buffer until the request completes; we free it after.
            let request = self
                .comm
                .process_at_rank(dst as i32)
                .immediate_send(StaticScope, unsafe { &*ptr });
            sends.push(PendingSend { request, buf: ptr });
            Ok(())
        })
    }

    fn recv_bytes(&self, buf: &mut [u8], _dtype: DType, src: usize) -> CommResult<()> {
        args::peer(self.size(), self.rank, src, "source", true)
            .map_err(|e| self.invalid(OpKind::Recv, e))?;
        self.run(OpKind::Recv, buf.len(), || {
            let (msg, _status) = self.comm.process_at_rank(src as i32).receive_vec::<u64>();
            let len = msg.first().copied().unwrap_or(u64::MAX) as usize;
            if len != buf.len() || (msg.len() - 1) * 8 < len {
                return Err(CommError::InvalidArgument {
                    op: OpKind::Recv,
                    group: self.name.clone(),
                    detail: format!(
                        "a message of {len} bytes from rank {src} where {} were expected",
                        buf.len()
                    ),
                });
            }
            buf.copy_from_slice(bytes_of(&msg[1..], len));
            Ok(())
        })
    }

    fn barrier(&self) -> CommResult<()> {
        self.run(OpKind::Barrier, 0, || {
            self.comm.barrier();
            Ok(())
        })
    }

    fn split(&self, color: usize, key: usize, label: &str) -> CommResult<Group> {
        let color_i = i32::try_from(color)
            .map_err(|_| self.invalid(OpKind::Split, format!("color {color}")))?;
        let key_i =
            i32::try_from(key).map_err(|_| self.invalid(OpKind::Split, format!("key {key}")))?;
        self.run(OpKind::Split, 0, || {
            let sub = self
                .comm
                .split_by_color_with_key(Color::with_value(color_i), key_i)
                .ok_or_else(|| self.invalid(OpKind::Split, "split gave no communicator".into()))?;
            // The members' world ranks, in the new group's order.
            let me = self.members[self.rank] as u64;
            let mut members = vec![0u64; sub.size() as usize];
            sub.all_gather_into(&me, &mut members[..]);
            let members: Vec<usize> = members.into_iter().map(|m| m as usize).collect();
            let name = format!("{label}{members:?}");
            Ok(Group::new(Arc::new(MpiComm {
                env: self.env.clone(),
                rank: sub.rank() as usize,
                comm: sub,
                name,
                members,
                timeout: self.timeout,
                seq: AtomicU64::new(0),
                stats: StatsRecorder::default(),
                sends: Mutex::new(vec![]),
                scratch: Mutex::new(vec![]),
            })))
        })
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    fn abandon(&self, why: &str) {
        // One write: mpirun tags every write it forwards, so pieces would split the line.
        let line = format!(
            "flashover: rank {} failed ({why}); aborting the MPI job so its peers stop now\n",
            self.env.rank()
        );
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        SimpleCommunicator::world().abort(4);
    }
}
