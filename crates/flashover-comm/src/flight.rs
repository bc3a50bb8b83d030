//! The flight recorder: each rank remembers its last collectives (which group, which op, its
//! number in that group, sizes, when it started and ended, and how), so that when a job fails
//! or hangs, the survivors' records say who stopped where and who was waiting for them.
//!
//! [`Group::recorded`] wraps any engine's communicator (and every group split from it); the
//! record is a fixed-size ring, so it costs a lock and a few words per call and can stay on.
//! [`FlightRecorder::dump`] writes it as JSON; [`diagnose`] reads every rank's dump and names,
//! per group, the ranks that stopped early and the ranks left waiting on them.

use crate::communicator::{Communicator, DeviceCollectives, DeviceTransfer, Group, Transfer};
use crate::dtype::DType;
use crate::error::{CommError, CommResult};
use crate::host_buffers::HostBuffers;
use crate::op::{OpKind, ReduceOp};
use crate::stats::CommStats;
use crate::traffic::{GroupTraffic, TrafficTable};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a recorded call ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlightState {
    /// Still running when the record was read (the rank is waiting in it).
    Running,
    /// Returned successfully.
    Done,
    /// Returned this error.
    Failed(String),
}

/// One recorded call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlightEntry {
    /// The group's name.
    pub group: String,
    /// Its members' world ranks.
    pub members: Vec<usize>,
    /// The call's number among this rank's calls on the group (from 0): equal numbers on two
    /// ranks are the same collective.
    pub seq: u64,
    /// The operation.
    pub op: OpKind,
    /// Bytes of this rank's largest buffer.
    pub bytes: usize,
    /// Microseconds since the recorder started, at the call's start.
    pub start_us: u64,
    /// And at its end (`None` while running).
    pub end_us: Option<u64>,
    /// How it ended.
    pub state: FlightState,
}

/// One rank's ring of its last calls.
pub struct FlightRecorder {
    rank: usize,
    capacity: usize,
    origin: Instant,
    /// Every recorded group's name and members, registered once (a call stores the index,
    /// so recording allocates nothing).
    groups: Mutex<Vec<(String, Vec<usize>)>>,
    /// Each registered group's collective time, indexed like `groups`.
    traffic: TrafficTable,
    entries: Mutex<VecDeque<Slot>>,
    next_id: AtomicU64,
    /// Every byte-level call on a host buffer, by purpose (not a ring: all of them).
    host_buffers: Mutex<HostBuffers>,
    /// Whether a host buffer that is neither the tensor adapter's staging nor control values
    /// fails its call ([`FlightRecorder::refuse_unmarked`]).
    refuse_unmarked: AtomicBool,
}

/// A recorded call as kept in the ring.
struct Slot {
    id: u64,
    group: usize,
    seq: u64,
    op: OpKind,
    bytes: usize,
    start_us: u64,
    end_us: Option<u64>,
    state: FlightState,
}

/// What a rank's dump holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FlightDump {
    /// World rank.
    pub rank: usize,
    /// Its last calls, oldest first.
    pub entries: Vec<FlightEntry>,
}

impl FlightRecorder {
    /// A recorder for world rank `rank` keeping the last `capacity` calls.
    pub fn new(rank: usize, capacity: usize) -> Arc<Self> {
        Arc::new(FlightRecorder {
            rank,
            capacity: capacity.max(1),
            origin: Instant::now(),
            groups: Mutex::new(vec![]),
            traffic: TrafficTable::default(),
            entries: Mutex::new(VecDeque::with_capacity(capacity.max(1))),
            next_id: AtomicU64::new(0),
            host_buffers: Mutex::new(HostBuffers::default()),
            refuse_unmarked: AtomicBool::new(false),
        })
    }

    /// From now on, the recorded groups take only what an engine of device memory would: a
    /// tensor's bytes through the tensor adapter (which stages them where the engine takes
    /// host memory) and control values. Any other host buffer fails its call, on the caller's
    /// rank only, naming the call (see [`crate::host_buffers`]).
    pub fn refuse_unmarked(&self) {
        self.refuse_unmarked.store(true, Ordering::Relaxed);
    }

    /// This rank's byte-level calls on host buffers so far, by purpose: staged by the tensor
    /// adapter, control values, or neither (see [`crate::host_buffers`]).
    pub fn host_buffers(&self) -> HostBuffers {
        self.host_buffers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn now_us(&self) -> u64 {
        self.origin.elapsed().as_micros() as u64
    }

    fn register(&self, group: &dyn Communicator) -> usize {
        let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        groups.push((group.name().to_string(), group.members().to_vec()));
        // Under the same lock, so the two tables keep one numbering.
        self.traffic.register(group.name());
        groups.len() - 1
    }

    fn start(&self, group: usize, seq: u64, op: OpKind, bytes: usize) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let slot = Slot {
            id,
            group,
            seq,
            op,
            bytes,
            start_us: self.now_us(),
            end_us: None,
            state: FlightState::Running,
        };
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if entries.len() == self.capacity {
            entries.pop_front();
        }
        entries.push_back(slot);
        id
    }

    fn finish<T>(&self, id: u64, result: &CommResult<T>) {
        let end = self.now_us();
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        // The call is among the newest unless the ring wrapped past it (other threads of this
        // rank kept calling): then it is simply gone.
        if let Some(slot) = entries.iter_mut().rev().find(|s| s.id == id) {
            slot.end_us = Some(end);
            slot.state = match result {
                Ok(_) => FlightState::Done,
                Err(err) => FlightState::Failed(err.to_string()),
            };
        }
    }

    /// The recorded calls, oldest first.
    pub fn dump_data(&self) -> FlightDump {
        let groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let entries = entries
            .iter()
            .map(|s| FlightEntry {
                group: groups[s.group].0.clone(),
                members: groups[s.group].1.clone(),
                seq: s.seq,
                op: s.op,
                bytes: s.bytes,
                start_us: s.start_us,
                end_us: s.end_us,
                state: s.state.clone(),
            })
            .collect();
        FlightDump {
            rank: self.rank,
            entries,
        }
    }

    /// Every recorded group's collective traffic so far (one entry per group, in the order
    /// they were recorded; groups split alike share a label).
    pub fn traffic(&self) -> Vec<GroupTraffic> {
        self.traffic.snapshot()
    }

    /// Writes the record to `dir/flight-rank{rank}.json` (the directory is created).
    pub fn dump(&self, dir: &Path) -> std::io::Result<PathBuf> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(dump_file(self.rank));
        let text =
            serde_json::to_string_pretty(&self.dump_data()).map_err(std::io::Error::other)?;
        std::fs::write(&path, text)?;
        Ok(path)
    }
}

/// A communicator whose calls the flight recorder sees.
struct Recorded {
    inner: Group,
    recorder: Arc<FlightRecorder>,
    /// This group's index in the recorder's table.
    index: usize,
    seq: AtomicU64,
}

impl Recorded {
    fn record<T>(
        &self,
        op: OpKind,
        bytes: usize,
        call: impl FnOnce() -> CommResult<T>,
    ) -> CommResult<T> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let id = self.recorder.start(self.index, seq, op, bytes);
        let started = Instant::now();
        let result = call();
        self.recorder
            .traffic
            .call(self.index, bytes, started.elapsed());
        self.recorder.finish(id, &result);
        result
    }

    /// [`Self::record`] of a call on a host buffer of `dtype`, tallied by its purpose.
    fn record_host<T>(
        &self,
        op: OpKind,
        bytes: usize,
        dtype: DType,
        call: impl FnOnce() -> CommResult<T>,
    ) -> CommResult<T> {
        let unmarked = (self.recorder.host_buffers.lock())
            .unwrap_or_else(|p| p.into_inner())
            .note(op, self.inner.name(), dtype, bytes);
        if unmarked && self.recorder.refuse_unmarked.load(Ordering::Relaxed) {
            return Err(CommError::Engine {
                engine: "flight recorder",
                detail: format!(
                    "{op:?} of {bytes} B {dtype:?} on {}: a host buffer outside the tensor \
                     adapter, refused (an engine of device memory could not take it)",
                    self.inner.name()
                ),
            });
        }
        self.record(op, bytes, call)
    }
}

impl Group {
    /// This group with every call (its own and its sub-groups') recorded by `recorder`.
    pub fn recorded(self, recorder: Arc<FlightRecorder>) -> Group {
        let index = recorder.register(&*self);
        Group::new(Arc::new(Recorded {
            inner: self,
            recorder,
            index,
            seq: AtomicU64::new(0),
        }))
    }
}

impl Communicator for Recorded {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn members(&self) -> &[usize] {
        self.inner.members()
    }
    fn all_reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> CommResult<()> {
        let n = buf.len();
        self.record_host(OpKind::AllReduce, n, dtype, || {
            self.inner.all_reduce_bytes(buf, dtype, op)
        })
    }
    fn reduce_scatter_bytes(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> CommResult<()> {
        self.record_host(OpKind::ReduceScatter, send.len(), dtype, || {
            self.inner.reduce_scatter_bytes(send, recv, dtype, op)
        })
    }
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> CommResult<()> {
        let n = recv.len();
        self.record_host(OpKind::AllGather, n, dtype, || {
            self.inner.all_gather_bytes(send, recv, dtype)
        })
    }
    fn broadcast_bytes(&self, buf: &mut [u8], dtype: DType, root: usize) -> CommResult<()> {
        let n = buf.len();
        self.record_host(OpKind::Broadcast, n, dtype, || {
            self.inner.broadcast_bytes(buf, dtype, root)
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
        let n = send.len().max(recv.len());
        self.record_host(OpKind::AllToAll, n, dtype, || {
            self.inner
                .all_to_all_v_bytes(send, send_counts, recv, recv_counts, dtype)
        })
    }
    fn send_bytes(&self, buf: &[u8], dtype: DType, dst: usize) -> CommResult<()> {
        self.record_host(OpKind::Send, buf.len(), dtype, || {
            self.inner.send_bytes(buf, dtype, dst)
        })
    }
    fn recv_bytes(&self, buf: &mut [u8], dtype: DType, src: usize) -> CommResult<()> {
        let n = buf.len();
        self.record_host(OpKind::Recv, n, dtype, || {
            self.inner.recv_bytes(buf, dtype, src)
        })
    }
    fn exchange_bytes(&self, transfers: &mut [Transfer<'_>]) -> CommResult<()> {
        // One entry for the batch: the engine runs it as one call.
        let n = transfers.iter().map(Transfer::len).sum();
        let dtype = match transfers.first() {
            Some(Transfer::Send { dtype, .. } | Transfer::Recv { dtype, .. }) => *dtype,
            None => DType::U8,
        };
        self.record_host(OpKind::Exchange, n, dtype, || {
            self.inner.exchange_bytes(transfers)
        })
    }
    fn barrier(&self) -> CommResult<()> {
        self.record(OpKind::Barrier, 0, || self.inner.barrier())
    }
    fn split(&self, color: usize, key: usize, label: &str) -> CommResult<Group> {
        let group = self.record(OpKind::Split, 0, || self.inner.split(color, key, label))?;
        Ok(group.recorded(self.recorder.clone()))
    }
    fn stats(&self) -> CommStats {
        self.inner.stats()
    }
    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        self.inner
            .device_collectives()
            .map(|_| self as &dyn DeviceCollectives)
    }
    fn abandon(&self, why: &str) {
        self.inner.abandon(why)
    }
    fn record_wait(&self, waited: Duration) {
        self.recorder.traffic.wait(self.index, waited);
    }
    fn sends_are_buffered(&self) -> bool {
        self.inner.sends_are_buffered()
    }
}

/// The engine's device collectives, each with its flight entry, like the host ones.
impl DeviceCollectives for Recorded {
    fn device_ordinal(&self) -> usize {
        self.device().device_ordinal()
    }
    unsafe fn all_reduce_device(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> CommResult<()> {
        self.record(OpKind::AllReduce, count * dtype.size(), || unsafe {
            self.device().all_reduce_device(ptr, count, dtype, op)
        })
    }
    unsafe fn broadcast_device(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        root: usize,
    ) -> CommResult<()> {
        self.record(OpKind::Broadcast, count * dtype.size(), || unsafe {
            self.device().broadcast_device(ptr, count, dtype, root)
        })
    }
    unsafe fn all_gather_device(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
    ) -> CommResult<()> {
        let bytes = count * dtype.size() * self.size();
        self.record(OpKind::AllGather, bytes, || unsafe {
            self.device().all_gather_device(send, recv, count, dtype)
        })
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
        self.record(OpKind::ReduceScatter, bytes, || unsafe {
            self.device()
                .reduce_scatter_device(send, recv, count, dtype, op)
        })
    }
    unsafe fn all_to_all_v_device(
        &self,
        send: u64,
        send_counts: &[usize],
        recv: u64,
        recv_counts: &[usize],
        dtype: DType,
    ) -> CommResult<()> {
        let bytes = send_counts.iter().sum::<usize>() * dtype.size();
        self.record(OpKind::AllToAll, bytes, || unsafe {
            self.device()
                .all_to_all_v_device(send, send_counts, recv, recv_counts, dtype)
        })
    }
    unsafe fn send_device(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        dst: usize,
    ) -> CommResult<()> {
        self.record(OpKind::Send, count * dtype.size(), || unsafe {
            self.device().send_device(ptr, count, dtype, dst)
        })
    }
    unsafe fn recv_device(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        src: usize,
    ) -> CommResult<()> {
        self.record(OpKind::Recv, count * dtype.size(), || unsafe {
            self.device().recv_device(ptr, count, dtype, src)
        })
    }
    unsafe fn exchange_device(&self, transfers: &[DeviceTransfer]) -> CommResult<()> {
        let bytes = transfers.iter().map(|t| t.count * t.dtype.size()).sum();
        self.record(OpKind::Exchange, bytes, || unsafe {
            self.device().exchange_device(transfers)
        })
    }
}

impl Recorded {
    /// The wrapped engine's device collectives (present: this is only reached through
    /// [`Communicator::device_collectives`], which checks).
    fn device(&self) -> &dyn DeviceCollectives {
        self.inner
            .device_collectives()
            .expect("device collectives are offered only where the engine has them")
    }
}

/// The file a rank's record is written to.
fn dump_file(rank: usize) -> String {
    format!("flight-rank{rank}.json")
}

/// Whether `file` is a rank's record ([`dump_file`] of some rank).
fn is_dump_file(file: &str) -> bool {
    file.strip_prefix("flight-rank")
        .and_then(|rest| rest.strip_suffix(".json"))
        .is_some_and(|rank| rank.parse::<usize>().is_ok())
}

/// Reads every rank's record in `dir`.
pub fn read_dumps(dir: &Path) -> std::io::Result<Vec<FlightDump>> {
    let mut dumps = vec![];
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if is_dump_file(name) {
            let text = std::fs::read_to_string(&path)?;
            let dump: FlightDump = serde_json::from_str(&text).map_err(|e| {
                std::io::Error::other(format!("{}: not a flight record: {e}", path.display()))
            })?;
            dumps.push(dump);
        }
    }
    dumps.sort_by_key(|d| d.rank);
    Ok(dumps)
}

/// Per group, what every rank that wrote a record last did in it, and who stopped early:
/// one line per finding, most telling first.
pub fn diagnose(dumps: &[FlightDump]) -> Vec<String> {
    // (group, members) -> world rank -> its last entry in that group.
    let mut last: BTreeMap<(String, Vec<usize>), BTreeMap<usize, &FlightEntry>> = BTreeMap::new();
    for dump in dumps {
        for e in &dump.entries {
            last.entry((e.group.clone(), e.members.clone()))
                .or_default()
                .insert(dump.rank, e);
        }
    }
    let written: Vec<usize> = dumps.iter().map(|d| d.rank).collect();
    let mut findings = vec![];
    for ((group, members), by_rank) in &last {
        let waiting: Vec<(&usize, &&FlightEntry)> = by_rank
            .iter()
            .filter(|(_, e)| e.state != FlightState::Done)
            .collect();
        if waiting.is_empty() {
            continue;
        }
        let furthest = by_rank.values().map(|e| e.seq).max().unwrap_or(0);
        for (rank, e) in &waiting {
            // Members that never reached this call: behind it in the group, or silent.
            let behind: Vec<String> = members
                .iter()
                .filter(|m| *m != *rank)
                .filter_map(|m| match by_rank.get(m) {
                    Some(o) if o.seq < e.seq => Some(format!(
                        "rank {m} (last at #{} {}, {})",
                        o.seq,
                        o.op.name(),
                        state_word(&o.state)
                    )),
                    None if written.contains(m) => {
                        Some(format!("rank {m} (no call in this group recorded)"))
                    }
                    None => Some(format!("rank {m} (wrote no record: lost)")),
                    _ => None,
                })
                .collect();
            let how = match &e.state {
                FlightState::Running => "still waiting".to_string(),
                FlightState::Failed(err) => format!("failed: {err}"),
                FlightState::Done => unreachable!("filtered"),
            };
            let line = match behind.is_empty() {
                true => format!(
                    "{group} {members:?}: rank {rank} at #{} {} ({how})",
                    e.seq,
                    e.op.name()
                ),
                false => format!(
                    "{group} {members:?}: rank {rank} at #{} {} ({how}), waiting for {}",
                    e.seq,
                    e.op.name(),
                    behind.join(", ")
                ),
            };
            findings.push((e.seq == furthest && !behind.is_empty(), line));
        }
    }
    findings.sort_by_key(|(telling, _)| !telling);
    findings.into_iter().map(|(_, line)| line).collect()
}

fn state_word(state: &FlightState) -> &'static str {
    match state {
        FlightState::Running => "running",
        FlightState::Done => "done",
        FlightState::Failed(_) => "failed",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CommunicatorExt, ThreadWorld};
    use std::time::Duration;

    #[test]
    fn a_rank_that_skips_a_collective_is_named_with_the_call_its_peers_wait_in() {
        let dir = std::env::temp_dir().join(format!("flight-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let comms = ThreadWorld::new(3)
            .timeout(Duration::from_millis(300))
            .build();
        std::thread::scope(|s| {
            for (rank, comm) in comms.into_iter().enumerate() {
                let dir = dir.clone();
                s.spawn(move || {
                    let recorder = FlightRecorder::new(rank, 8);
                    let group = Group::new(Arc::new(comm)).recorded(recorder.clone());
                    let mut v = [1.0f32; 4];
                    group.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                    // Rank 2 stops here; the others wait in the second all-reduce and time out.
                    if rank != 2 {
                        assert!(group.all_reduce(&mut v, ReduceOp::Sum).is_err());
                    }
                    recorder.dump(&dir).unwrap();
                });
            }
        });
        let dumps = read_dumps(&dir).unwrap();
        assert_eq!(dumps.len(), 3);
        assert_eq!(dumps[0].entries.len(), 2);
        assert_eq!(dumps[2].entries[0].state, FlightState::Done);
        let findings = diagnose(&dumps);
        assert_eq!(findings.len(), 2, "{findings:?}");
        for (rank, line) in findings.iter().enumerate() {
            assert!(
                line.contains(&format!("rank {rank} at #1 all_reduce")),
                "{line}"
            );
            assert!(
                line.contains("waiting for rank 2 (last at #0 all_reduce, done)"),
                "{line}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn refusing_unmarked_host_buffers_fails_their_call_and_takes_staging_and_control() {
        let comms = ThreadWorld::new(1).build();
        let recorder = FlightRecorder::new(0, 8);
        let comm = comms.into_iter().next().expect("one rank");
        let group = Group::new(Arc::new(comm)).recorded(recorder.clone());
        recorder.refuse_unmarked();
        let mut v = [1.0f32; 4];
        let refused = group
            .all_reduce(&mut v, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        assert!(refused.contains("outside the tensor adapter"), "{refused}");
        assert!(refused.contains("AllReduce of 16 B"), "{refused}");
        crate::control(|| group.all_reduce(&mut v, ReduceOp::Sum)).unwrap();
        crate::host_buffers::marked(crate::host_buffers::Purpose::Staging, || {
            group.all_reduce(&mut v, ReduceOp::Sum)
        })
        .unwrap();
        let tally = recorder.host_buffers();
        assert_eq!((tally.unmarked.calls, tally.control.calls), (1, 1));
        assert_eq!(tally.staged.calls, 1);
    }
}
