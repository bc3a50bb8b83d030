//! Per-communicator counters: how often each operation ran, how many bytes it moved, how long
//! this rank waited for its peers (idle) and how long the data movement itself took.

use crate::op::OpKind;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Counters of one operation kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct OpStats {
    /// Number of calls.
    pub calls: u64,
    /// Bytes in this rank's largest buffer of each call, summed (nccl-tests' "size").
    pub bytes: u64,
    /// Time spent waiting for peers to arrive: idle time caused by imbalance.
    pub wait: Duration,
    /// Time spent moving and reducing data after every peer arrived.
    pub transfer: Duration,
}

/// A snapshot of a communicator's counters, by operation kind.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CommStats {
    /// Counters per operation kind (kinds never called are absent).
    pub ops: BTreeMap<OpKind, OpStats>,
}

impl CommStats {
    /// Sum of all kinds.
    pub fn total(&self) -> OpStats {
        self.ops
            .values()
            .fold(OpStats::default(), |acc, s| OpStats {
                calls: acc.calls + s.calls,
                bytes: acc.bytes + s.bytes,
                wait: acc.wait + s.wait,
                transfer: acc.transfer + s.transfer,
            })
    }

    /// Adds another snapshot (e.g. of another group of the same rank) into this one.
    pub fn merge(&mut self, other: &CommStats) {
        for (kind, s) in &other.ops {
            let e = self.ops.entry(*kind).or_default();
            e.calls += s.calls;
            e.bytes += s.bytes;
            e.wait += s.wait;
            e.transfer += s.transfer;
        }
    }

    /// The counters accumulated since `earlier` (a snapshot of the same communicator).
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let mut ops = BTreeMap::new();
        for (kind, s) in &self.ops {
            let e = earlier.ops.get(kind).copied().unwrap_or_default();
            ops.insert(
                *kind,
                OpStats {
                    calls: s.calls - e.calls,
                    bytes: s.bytes - e.bytes,
                    wait: s.wait.saturating_sub(e.wait),
                    transfer: s.transfer.saturating_sub(e.transfer),
                },
            );
        }
        CommStats { ops }
    }
}

/// Lock-free counters an engine updates on every call.
#[derive(Debug, Default)]
pub(crate) struct StatsRecorder {
    slots: [[AtomicU64; 4]; OpKind::ALL.len()],
}

impl StatsRecorder {
    pub(crate) fn record(&self, kind: OpKind, bytes: usize, wait: Duration, transfer: Duration) {
        let slot = &self.slots[kind.index()];
        slot[0].fetch_add(1, Ordering::Relaxed);
        slot[1].fetch_add(bytes as u64, Ordering::Relaxed);
        slot[2].fetch_add(wait.as_nanos() as u64, Ordering::Relaxed);
        slot[3].fetch_add(transfer.as_nanos() as u64, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> CommStats {
        let mut ops = BTreeMap::new();
        for kind in OpKind::ALL {
            let slot = &self.slots[kind.index()];
            let calls = slot[0].load(Ordering::Relaxed);
            if calls > 0 {
                ops.insert(
                    kind,
                    OpStats {
                        calls,
                        bytes: slot[1].load(Ordering::Relaxed),
                        wait: Duration::from_nanos(slot[2].load(Ordering::Relaxed)),
                        transfer: Duration::from_nanos(slot[3].load(Ordering::Relaxed)),
                    },
                );
            }
        }
        CommStats { ops }
    }
}
