//! The thread engine: every rank is a thread of one process.
//!
//! Peers read each other's buffers in place (no staging copies), each rank writes only its own
//! buffers, and every reduced element is computed by exactly one rank in rank order, so results
//! are bit-identical on all ranks and equal to a sequential reference. See `group.rs` for the
//! rendezvous protocol that makes this safe and hang-free.

mod group;
pub(crate) mod kernels;

use crate::args;
use crate::communicator::{Communicator, CommunicatorExt, Group};
use crate::dtype::DType;
use crate::error::{CommError, CommResult};
use crate::fault::FaultPlan;
use crate::op::{OpKind, ReduceOp};
use crate::stats::{CommStats, StatsRecorder};
use group::{GroupShared, Message, OpDesc, Published, WorldShared, lock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Default deadline for a rank to wait for its peers at a collective.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Builder of a thread-engine world: `size` communicators, one per rank thread.
///
/// ```
/// use flashover_comm::{Communicator, FaultPlan, ThreadWorld};
/// use std::time::Duration;
/// let comms = ThreadWorld::new(4).timeout(Duration::from_secs(5)).faults(FaultPlan::new()).build();
/// assert_eq!(comms.len(), 4);
/// assert_eq!(comms[2].rank(), 2);
/// ```
#[derive(Debug, Clone)]
pub struct ThreadWorld {
    size: usize,
    timeout: Duration,
    faults: FaultPlan,
}

impl ThreadWorld {
    /// A world of `size` ranks with the default timeout and no faults.
    pub fn new(size: usize) -> Self {
        ThreadWorld {
            size,
            timeout: DEFAULT_TIMEOUT,
            faults: FaultPlan::new(),
        }
    }

    /// How long a rank waits for its peers at any collective before failing.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Faults to inject.
    pub fn faults(mut self, faults: FaultPlan) -> Self {
        self.faults = faults;
        self
    }

    /// One world communicator per rank, in rank order. Hand each to its own thread.
    pub fn build(self) -> Vec<ThreadComm> {
        assert!(self.size > 0, "a world needs at least one rank");
        let world = Arc::new(WorldShared {
            timeout: self.timeout,
            faults: self.faults,
            registry: Mutex::new(HashMap::new()),
            groups: Mutex::new(vec![]),
            next_id: Mutex::new(0),
        });
        let group = world.new_group("world".into(), (0..self.size).collect());
        (0..self.size)
            .map(|rank| ThreadComm::new(group.clone(), rank))
            .collect()
    }
}

/// One rank's handle on a thread-engine group.
pub struct ThreadComm {
    shared: Arc<GroupShared>,
    rank: usize,
    splits: AtomicU64,
    stats: StatsRecorder,
}

impl ThreadComm {
    fn new(shared: Arc<GroupShared>, rank: usize) -> Self {
        ThreadComm {
            shared,
            rank,
            splits: AtomicU64::new(0),
            stats: StatsRecorder::default(),
        }
    }

    /// Declares that this rank's global rank has left the world (its work ended or failed):
    /// peers waiting for it in any group fail at once with `reason` instead of timing out.
    pub fn leave(&self, reason: &str) {
        self.shared.world.depart(self.global_rank(), reason);
    }

    fn global_rank(&self) -> usize {
        self.shared.members[self.rank]
    }

    fn invalid(&self, op: OpKind, detail: String) -> CommError {
        CommError::InvalidArgument {
            op,
            group: self.shared.name.clone(),
            detail,
        }
    }

    /// Runs one collective: fault hook, entry rendezvous, `phases` data phases each followed by
    /// a barrier, statistics. `work(phase, seq, peers)` must touch peers' memory only as the
    /// protocol allows (read published buffers, write own).
    fn collective(
        &self,
        desc: OpDesc,
        published: Published,
        phases: usize,
        work: impl Fn(usize, &[Published]),
    ) -> CommResult<()> {
        let kind = desc.kind;
        let bytes = desc.send_bytes.max(desc.recv_bytes);
        self.shared.world.faults.apply(self.global_rank(), kind);
        let t0 = Instant::now();
        let (seq, peers) = self.shared.enter(self.rank, desc, published)?;
        let t1 = Instant::now();
        let mut failed = false;
        for phase in 0..phases {
            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(phase, &peers)))
                .is_ok();
            if self.shared.phase_barrier(!ok) {
                failed = true;
                break;
            }
        }
        self.stats.record(kind, bytes, t1 - t0, t1.elapsed());
        if failed {
            let err = CommError::Engine {
                engine: "thread",
                detail: format!(
                    "{kind} #{seq} in group {} panicked during data movement",
                    self.shared.name
                ),
            };
            self.shared.poison(err.clone());
            return Err(err);
        }
        Ok(())
    }

    /// Checks a buffer length against the dtype; returns the element count.
    /// Solo groups skip the rendezvous but still apply faults and count the call.
    fn solo(&self, kind: OpKind, bytes: usize) -> CommResult<()> {
        self.shared.world.faults.apply(self.global_rank(), kind);
        self.shared.check_poison()?;
        self.stats
            .record(kind, bytes, Duration::ZERO, Duration::ZERO);
        Ok(())
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        let reason = if std::thread::panicking() {
            "panicked"
        } else {
            "dropped its communicator"
        };
        self.shared.depart(self.rank, reason);
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size()
    }

    fn name(&self) -> &str {
        &self.shared.name
    }

    fn members(&self) -> &[usize] {
        &self.shared.members
    }

    fn all_reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> CommResult<()> {
        let n = self.size();
        let mut desc = OpDesc::new(OpKind::AllReduce, dtype, buf.len(), buf.len());
        desc.reduce = Some(op);
        let elems = args::elements(buf.len(), dtype);
        if n == 1 {
            elems.map_err(|e| self.invalid(desc.kind, e))?;
            return self.solo(desc.kind, buf.len());
        }
        desc.invalid = elems.as_ref().err().cloned();
        let elems = elems.unwrap_or(0);
        let me = self.rank;
        let published = Published {
            recv: buf.as_mut_ptr() as usize,
            ..Default::default()
        };
        self.collective(desc, published, 2, |phase, peers| {
            let srcs: Vec<usize> = peers.iter().map(|p| p.recv).collect();
            // SAFETY: phase 0 reads chunk `me` of every buffer and writes chunk `me` of our own;
            // phase 1 reads peers' own chunks (final after phase 0) into our other chunks.
            unsafe {
                if phase == 0 {
                    kernels::reduce_chunk(
                        dtype,
                        op,
                        &srcs,
                        published.recv,
                        kernels::chunk(elems, n, me),
                    );
                } else {
                    let dsize = dtype.size();
                    for (j, &src) in srcs.iter().enumerate().filter(|&(j, _)| j != me) {
                        let c = kernels::chunk(elems, n, j);
                        let offset = c.start * dsize;
                        kernels::copy_elems(dtype, src + offset, published.recv + offset, c.len());
                    }
                }
            }
        })
    }

    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> CommResult<()> {
        let n = self.size();
        let mut desc = OpDesc::new(OpKind::ReduceScatter, dtype, send.len(), recv.len());
        desc.reduce = Some(op);
        let check = args::reduce_scatter(n, send.len(), recv.len(), dtype);
        if n == 1 {
            check.map_err(|e| self.invalid(desc.kind, e))?;
            recv.copy_from_slice(send); // Avg over one rank divides by one: exact.
            return self.solo(desc.kind, send.len());
        }
        desc.invalid = check.as_ref().err().cloned();
        let m = check.unwrap_or(0);
        let me = self.rank;
        let dsize = dtype.size();
        let published = Published {
            send: send.as_ptr() as usize,
            recv: recv.as_mut_ptr() as usize,
            ..Default::default()
        };
        self.collective(desc, published, 1, |_, peers| {
            let srcs: Vec<usize> = peers.iter().map(|p| p.send + me * m * dsize).collect();
            // SAFETY: reads block `me` of every send buffer (never written), writes our recv.
            unsafe { kernels::reduce_chunk(dtype, op, &srcs, published.recv, 0..m) }
        })
    }

    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> CommResult<()> {
        let n = self.size();
        let desc = OpDesc::new(OpKind::AllGather, dtype, send.len(), recv.len());
        let check = args::all_gather(n, send.len(), recv.len(), dtype);
        if n == 1 {
            check.map_err(|e| self.invalid(desc.kind, e))?;
            recv.copy_from_slice(send);
            return self.solo(desc.kind, recv.len());
        }
        let mut desc = desc;
        desc.invalid = check.as_ref().err().cloned();
        let m = check.unwrap_or(0);
        let published = Published {
            send: send.as_ptr() as usize,
            recv: recv.as_mut_ptr() as usize,
            ..Default::default()
        };
        self.collective(desc, published, 1, |_, peers| {
            for (j, p) in peers.iter().enumerate() {
                // SAFETY: send buffers are read-only; we write block `j` of our own recv.
                unsafe {
                    kernels::copy_elems(dtype, p.send, published.recv + j * m * dtype.size(), m)
                }
            }
        })
    }

    fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> CommResult<()> {
        let n = self.size();
        let mut desc = OpDesc::new(OpKind::Broadcast, dtype, buf.len(), buf.len());
        desc.root = root;
        let check = args::broadcast(n, buf.len(), dtype, root);
        if n == 1 {
            check.map_err(|e| self.invalid(desc.kind, e))?;
            return self.solo(desc.kind, buf.len());
        }
        desc.invalid = check.as_ref().err().cloned();
        let m = check.unwrap_or(0);
        let me = self.rank;
        let published = Published {
            recv: buf.as_mut_ptr() as usize,
            ..Default::default()
        };
        self.collective(desc, published, 1, |_, peers| {
            if me != root {
                // SAFETY: the root's buffer is not written during this op; we write our own.
                unsafe { kernels::copy_elems(dtype, peers[root].recv, published.recv, m) }
            }
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
        let n = self.size();
        let dsize = dtype.size();
        let desc = OpDesc::new(OpKind::AllToAll, dtype, send.len(), recv.len());
        let check = args::all_to_all(n, send.len(), send_counts, recv.len(), recv_counts, dtype);
        if n == 1 {
            check.map_err(|e| self.invalid(desc.kind, e))?;
            recv.copy_from_slice(send);
            return self.solo(desc.kind, send.len());
        }
        let mut desc = desc;
        let valid = check.is_ok();
        desc.invalid = check.err();
        // An invalid call publishes no counts: validation stops at the description mismatch.
        let published = Published {
            send: send.as_ptr() as usize,
            recv: recv.as_mut_ptr() as usize,
            send_counts: if valid {
                send_counts.as_ptr() as usize
            } else {
                0
            },
            recv_counts: if valid {
                recv_counts.as_ptr() as usize
            } else {
                0
            },
        };
        let me = self.rank;
        self.collective(desc, published, 1, |_, peers| {
            let mut dst_offset = 0;
            for (j, p) in peers.iter().enumerate() {
                // SAFETY: counts were validated pairwise at entry; each peer's send buffer is
                // read-only and we write our own recv at disjoint offsets.
                unsafe {
                    let their_counts = std::slice::from_raw_parts(p.send_counts as *const usize, n);
                    let src_offset: usize = their_counts[..me].iter().sum();
                    let len = recv_counts[j];
                    kernels::copy_elems(
                        dtype,
                        p.send + src_offset * dsize,
                        published.recv + dst_offset * dsize,
                        len,
                    );
                    dst_offset += len;
                }
            }
        })
    }

    fn send_bytes(&self, buf: &[u8], dtype: DType, dst: usize) -> CommResult<()> {
        let n = self.size();
        args::peer(n, self.rank, dst, "destination", false)
            .map_err(|e| self.invalid(OpKind::Send, e))?;
        self.shared
            .world
            .faults
            .apply(self.global_rank(), OpKind::Send);
        self.shared.check_poison()?;
        let t0 = Instant::now();
        let mailbox = &self.shared.mailboxes[self.rank * n + dst];
        lock(&mailbox.queue).push_back(Message {
            dtype,
            data: buf.to_vec(),
        });
        mailbox.ready.notify_all();
        self.stats
            .record(OpKind::Send, buf.len(), Duration::ZERO, t0.elapsed());
        Ok(())
    }

    fn recv_bytes(&self, buf: &mut [u8], dtype: DType, src: usize) -> CommResult<()> {
        let n = self.size();
        args::peer(n, self.rank, src, "source", false)
            .map_err(|e| self.invalid(OpKind::Recv, e))?;
        self.shared
            .world
            .faults
            .apply(self.global_rank(), OpKind::Recv);
        let t0 = Instant::now();
        let deadline = t0 + self.shared.world.timeout;
        let mailbox = &self.shared.mailboxes[src * n + self.rank];
        let mut queue = lock(&mailbox.queue);
        let message = loop {
            if let Some(m) = queue.pop_front() {
                break m;
            }
            self.shared.check_poison()?;
            if let Some(reason) = self.shared.departure(src) {
                return Err(CommError::PeerLeft {
                    op: OpKind::Recv,
                    group: self.shared.name.clone(),
                    rank: self.shared.members[src],
                    reason,
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    op: OpKind::Recv,
                    group: self.shared.name.clone(),
                    seq: 0,
                    missing: vec![self.shared.members[src]],
                    arrived: vec![self.global_rank()],
                    waited: now - t0,
                });
            }
            // Wake at least every 50 ms to notice a departed sender.
            let wait = (deadline - now).min(Duration::from_millis(50));
            queue = mailbox
                .ready
                .wait_timeout(queue, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        drop(queue);
        let t1 = Instant::now();
        if message.dtype != dtype || message.data.len() != buf.len() {
            return Err(CommError::Mismatch {
                group: self.shared.name.clone(),
                seq: 0,
                detail: format!(
                    "rank {} sent {} bytes of {} to rank {}, which expected {} bytes of {dtype}",
                    self.shared.members[src],
                    message.data.len(),
                    message.dtype,
                    self.global_rank(),
                    buf.len()
                ),
            });
        }
        buf.copy_from_slice(&message.data);
        self.stats
            .record(OpKind::Recv, buf.len(), t1 - t0, t1.elapsed());
        Ok(())
    }

    fn barrier(&self) -> CommResult<()> {
        if self.size() == 1 {
            return self.solo(OpKind::Barrier, 0);
        }
        let desc = OpDesc::new(OpKind::Barrier, DType::U8, 0, 0);
        self.collective(desc, Published::default(), 0, |_, _| {})
    }

    fn split(&self, color: usize, key: usize, label: &str) -> CommResult<Group> {
        let n = self.size();
        let index = self.splits.fetch_add(1, Ordering::Relaxed);
        let all = self.all_gather_vec(&[color as u64, key as u64])?;
        let mut mine: Vec<(u64, usize)> = (0..n)
            .filter(|&r| all[2 * r] == color as u64)
            .map(|r| (all[2 * r + 1], r))
            .collect();
        mine.sort();
        let local_ranks: Vec<usize> = mine.iter().map(|&(_, r)| r).collect();
        let members: Vec<usize> = local_ranks
            .iter()
            .map(|&r| self.shared.members[r])
            .collect();
        let my_rank = local_ranks
            .iter()
            .position(|&r| r == self.rank)
            .expect("own color");
        let world = &self.shared.world;
        let shared = lock(&world.registry)
            .entry((self.shared.id, index, color))
            .or_insert_with(|| {
                let list = members
                    .iter()
                    .map(|m| m.to_string())
                    .collect::<Vec<_>>()
                    .join(",");
                world.new_group(format!("{label}[{list}]"), members.clone())
            })
            .clone();
        Ok(Group::new(Arc::new(ThreadComm::new(shared, my_rank))))
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }
}
