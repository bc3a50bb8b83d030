//! Shared state of one thread-engine group: the rendezvous every collective starts with, the
//! phase barriers between its data-movement steps, and the point-to-point mailboxes.
//!
//! Protocol of one collective (see `ThreadComm::collective`):
//! 1. **Entry** (with a deadline): each rank publishes a description of its call and pointers
//!    to its buffers, then waits for all ranks. The last to arrive checks that the calls match.
//!    A rank that is missing at the deadline, or that left the group, fails every waiting rank
//!    with an error naming it, and poisons the group so late arrivals fail at once.
//! 2. **Phases** (no deadline): each rank reads its peers' published buffers and writes only its
//!    own. Barriers separate phases; the last one keeps every buffer alive until no peer reads
//!    it any more. After entry every rank does bounded memory work, so these barriers cannot hang;
//!    a panic inside a phase is caught, still counted as an arrival, and fails the op everywhere.

use crate::dtype::DType;
use crate::error::{CommError, CommResult};
use crate::fault::FaultPlan;
use crate::op::{OpKind, ReduceOp};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

/// What one rank asked for; compared across ranks at entry.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OpDesc {
    pub kind: OpKind,
    pub dtype: DType,
    /// Length of the send (or in-place) buffer in bytes.
    pub send_bytes: usize,
    /// Length of the receive buffer in bytes.
    pub recv_bytes: usize,
    pub root: usize,
    pub reduce: Option<ReduceOp>,
    /// Set when this rank's own arguments are invalid: every rank then fails with it.
    pub invalid: Option<String>,
}

impl OpDesc {
    pub(crate) fn new(kind: OpKind, dtype: DType, send_bytes: usize, recv_bytes: usize) -> Self {
        OpDesc {
            kind,
            dtype,
            send_bytes,
            recv_bytes,
            root: 0,
            reduce: None,
            invalid: None,
        }
    }

    fn describe(&self) -> String {
        let mut s = format!(
            "{} {} send={}B recv={}B",
            self.kind, self.dtype, self.send_bytes, self.recv_bytes
        );
        if let Some(op) = self.reduce {
            s += &format!(" op={op:?}");
        }
        if self.kind == OpKind::Broadcast {
            s += &format!(" root={}", self.root);
        }
        if let Some(why) = &self.invalid {
            s += &format!(" INVALID: {why}");
        }
        s
    }
}

/// Buffer addresses a rank publishes for its peers to read during the phases of one op.
/// Addresses are stored as integers: they are only dereferenced between entry and the last
/// phase barrier, while the owner is blocked inside the same op.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Published {
    pub send: usize,
    pub recv: usize,
    pub send_counts: usize,
    pub recv_counts: usize,
}

struct Entry {
    desc: OpDesc,
    published: Published,
}

struct RendezvousState {
    /// Sequence number of the op being gathered.
    seq: u64,
    entries: Vec<Option<Entry>>,
    entered: usize,
    /// Buffers of the last released op, read by its ranks after they wake.
    released: Vec<Published>,
    phase_gen: u64,
    phase_arrived: usize,
    phase_failed: bool,
    last_phase_failed: bool,
    departed: Vec<Option<String>>,
    poison: Option<CommError>,
}

pub(crate) struct Message {
    pub dtype: DType,
    pub data: Vec<u8>,
}

#[derive(Default)]
pub(crate) struct Mailbox {
    pub queue: Mutex<VecDeque<Message>>,
    pub ready: Condvar,
}

/// State shared by every rank of one world.
pub(crate) struct WorldShared {
    pub timeout: Duration,
    pub faults: FaultPlan,
    /// Sub-groups by (parent id, split number, color), so the ranks of a split find each other.
    pub registry: Mutex<HashMap<(u64, u64, usize), Arc<GroupShared>>>,
    pub groups: Mutex<Vec<Weak<GroupShared>>>,
    pub next_id: Mutex<u64>,
}

impl WorldShared {
    pub(crate) fn new_group(
        self: &Arc<Self>,
        name: String,
        members: Vec<usize>,
    ) -> Arc<GroupShared> {
        let id = {
            let mut next = lock(&self.next_id);
            *next += 1;
            *next
        };
        let n = members.len();
        let group = Arc::new(GroupShared {
            id,
            name,
            members,
            world: self.clone(),
            state: Mutex::new(RendezvousState {
                seq: 0,
                entries: (0..n).map(|_| None).collect(),
                entered: 0,
                released: vec![],
                phase_gen: 0,
                phase_arrived: 0,
                phase_failed: false,
                last_phase_failed: false,
                departed: vec![None; n],
                poison: None,
            }),
            changed: Condvar::new(),
            mailboxes: (0..n * n).map(|_| Mailbox::default()).collect(),
        });
        lock(&self.groups).push(Arc::downgrade(&group));
        group
    }

    /// Marks global rank `rank` as gone from every group it belongs to.
    pub(crate) fn depart(&self, rank: usize, reason: &str) {
        let groups: Vec<Arc<GroupShared>> = lock(&self.groups)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for g in groups {
            if let Some(local) = g.members.iter().position(|&m| m == rank) {
                g.depart(local, reason);
            }
        }
    }
}

/// One group's shared state.
pub(crate) struct GroupShared {
    pub id: u64,
    pub name: String,
    /// Global rank of each group rank.
    pub members: Vec<usize>,
    pub world: Arc<WorldShared>,
    state: Mutex<RendezvousState>,
    changed: Condvar,
    /// `mailboxes[src * n + dst]`.
    pub mailboxes: Vec<Mailbox>,
}

/// Locks a mutex, ignoring poisoning: the engine's own invariants do not depend on a panicking
/// holder (panics inside phases are caught before the lock is taken again).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl GroupShared {
    pub(crate) fn size(&self) -> usize {
        self.members.len()
    }

    fn poisoned(&self, cause: &CommError) -> CommError {
        CommError::Poisoned {
            group: self.name.clone(),
            cause: Box::new(cause.root_cause().clone()),
        }
    }

    /// Records that group rank `local` left; ranks waiting for it fail.
    pub(crate) fn depart(&self, local: usize, reason: &str) {
        let mut st = lock(&self.state);
        if st.departed[local].is_none() {
            st.departed[local] = Some(reason.to_string());
        }
        drop(st);
        self.changed.notify_all();
        for mb in &self.mailboxes {
            mb.ready.notify_all();
        }
    }

    /// Why group rank `local` left, if it did.
    pub(crate) fn departure(&self, local: usize) -> Option<String> {
        lock(&self.state).departed[local].clone()
    }

    /// The group's failure, if any (as the error a new op should return).
    pub(crate) fn check_poison(&self) -> CommResult<()> {
        match &lock(&self.state).poison {
            Some(cause) => Err(self.poisoned(cause)),
            None => Ok(()),
        }
    }

    /// Step 1 of every collective: publish, wait for all ranks (until the deadline), check that
    /// the calls match. Returns the op's sequence number and every rank's published buffers.
    pub(crate) fn enter(
        &self,
        me: usize,
        desc: OpDesc,
        published: Published,
    ) -> CommResult<(u64, Vec<Published>)> {
        let start = Instant::now();
        let kind = desc.kind;
        let mut st = lock(&self.state);
        if let Some(cause) = &st.poison {
            return Err(self.poisoned(cause));
        }
        let seq = st.seq;
        if let Some(earlier) = &st.entries[me] {
            // Two threads of one rank in the same group at once: the calls cannot be matched
            // across ranks. Fail every rank now rather than corrupt the rendezvous.
            let err = CommError::Mismatch {
                group: self.name.clone(),
                seq,
                detail: format!(
                    "rank {me} called {kind} while its {} on this group had not completed: two threads of one rank used the group at once (e.g. a collective on the data-parallel group while DDP still reduces gradients on it: call it after finish(), or use another group)",
                    earlier.desc.kind
                ),
            };
            return self.fail(st, err);
        }
        st.entries[me] = Some(Entry { desc, published });
        st.entered += 1;
        if st.entered < self.size() {
            return self.await_release(st, seq, kind, start);
        }
        // The last rank in: check the calls match and release them all.
        let entries: Vec<Entry> = (st.entries.iter_mut())
            .map(|e| e.take().expect("entered"))
            .collect();
        st.entered = 0;
        if let Err(detail) = self.validate(&entries) {
            let group = self.name.clone();
            return self.fail(st, CommError::Mismatch { group, seq, detail });
        }
        st.released = entries.iter().map(|e| e.published).collect();
        st.seq += 1;
        let released = st.released.clone();
        drop(st);
        self.changed.notify_all();
        Ok((seq, released))
    }

    /// Waits (holding `st`'s lock between wake-ups) until op `seq`, a `kind` this rank entered
    /// at `start`, is released by the last rank in, or fails: poisoned meanwhile, a missing
    /// rank departed, or the deadline passed with ranks missing.
    fn await_release(
        &self,
        mut st: MutexGuard<'_, RendezvousState>,
        seq: u64,
        kind: OpKind,
        start: Instant,
    ) -> CommResult<(u64, Vec<Published>)> {
        let deadline = start + self.world.timeout;
        loop {
            if st.seq != seq {
                return Ok((seq, st.released.clone()));
            }
            if let Some(cause) = &st.poison {
                // Poisoned while this op was gathering: the cause is this op's failure.
                return Err(cause.clone());
            }
            let n = self.size();
            let missing: Vec<usize> = (0..n).filter(|&r| st.entries[r].is_none()).collect();
            if let Some(&gone) = missing.iter().find(|&&r| st.departed[r].is_some()) {
                let err = CommError::PeerLeft {
                    op: kind,
                    group: self.name.clone(),
                    rank: self.members[gone],
                    reason: st.departed[gone].clone().unwrap_or_default(),
                };
                return self.fail(st, err);
            }
            let now = Instant::now();
            if now >= deadline {
                let err = CommError::Timeout {
                    op: kind,
                    group: self.name.clone(),
                    seq,
                    missing: missing.iter().map(|&r| self.members[r]).collect(),
                    arrived: (0..n)
                        .filter(|r| !missing.contains(r))
                        .map(|r| self.members[r])
                        .collect(),
                    waited: now - start,
                };
                return self.fail(st, err);
            }
            st = self
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Poisons the group with `err` (every rank's pending and later ops fail with it), wakes
    /// the ranks waiting and returns it.
    fn fail<T>(&self, mut st: MutexGuard<'_, RendezvousState>, err: CommError) -> CommResult<T> {
        st.poison = Some(err.clone());
        drop(st);
        self.changed.notify_all();
        Err(err)
    }

    /// Checks that every rank made the same call; the message lists each rank's call.
    fn validate(&self, entries: &[Entry]) -> Result<(), String> {
        let first = &entries[0].desc;
        let same = entries.iter().all(|e| {
            let d = &e.desc;
            d.invalid.is_none()
                && d.kind == first.kind
                && d.dtype == first.dtype
                && d.reduce == first.reduce
                && d.root == first.root
                && (d.kind == OpKind::AllToAll
                    || (d.send_bytes == first.send_bytes && d.recv_bytes == first.recv_bytes))
        });
        if !same {
            return Err(self.describe_all(entries));
        }
        if first.kind == OpKind::AllToAll {
            self.validate_counts(entries)?;
        }
        Ok(())
    }

    fn describe_all(&self, entries: &[Entry]) -> String {
        entries
            .iter()
            .enumerate()
            .map(|(r, e)| format!("rank {}: {}", self.members[r], e.desc.describe()))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// All-to-all counts must agree pairwise: what `i` sends to `j` is what `j` expects from `i`.
    fn validate_counts(&self, entries: &[Entry]) -> Result<(), String> {
        let n = self.size();
        // SAFETY: every rank is blocked in `enter` of this op (or is the caller), so the count
        // slices it published (length `n`, checked locally before entering) are alive.
        let counts = |p: usize| unsafe { std::slice::from_raw_parts(p as *const usize, n) };
        for i in 0..n {
            for j in 0..n {
                let sent = counts(entries[i].published.send_counts)[j];
                let expected = counts(entries[j].published.recv_counts)[i];
                if sent != expected {
                    return Err(format!(
                        "all_to_all counts disagree: rank {} sends {sent} elements to rank {}, which expects {expected}",
                        self.members[i], self.members[j]
                    ));
                }
            }
        }
        Ok(())
    }

    /// A barrier between data phases. No deadline: every rank is past entry and doing bounded
    /// memory work. Returns whether any rank reported a failure in this phase.
    pub(crate) fn phase_barrier(&self, failed: bool) -> bool {
        let n = self.size();
        let mut st = lock(&self.state);
        let generation = st.phase_gen;
        st.phase_arrived += 1;
        st.phase_failed |= failed;
        if st.phase_arrived == n {
            st.phase_arrived = 0;
            st.phase_gen += 1;
            st.last_phase_failed = std::mem::take(&mut st.phase_failed);
            let result = st.last_phase_failed;
            drop(st);
            self.changed.notify_all();
            return result;
        }
        while st.phase_gen == generation {
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.last_phase_failed
    }

    /// Marks the group unusable after a failure inside a phase.
    pub(crate) fn poison(&self, err: CommError) {
        let mut st = lock(&self.state);
        if st.poison.is_none() {
            st.poison = Some(err);
        }
        drop(st);
        self.changed.notify_all();
    }
}
