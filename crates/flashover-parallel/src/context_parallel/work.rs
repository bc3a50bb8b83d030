//! Counting each rank's attention work, to measure how evenly causal work is spread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Attention work done by one rank, summed over calls.
#[derive(Debug, Default)]
pub struct WorkCounter {
    elements: AtomicU64,
    nanos: AtomicU64,
}

/// A snapshot of a [`WorkCounter`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AttentionWork {
    /// Attention scores computed (batch x heads x queries x keys, over the computed blocks).
    pub score_elements: u64,
    /// Time spent computing attention blocks in forward (not waiting for the exchanges).
    pub compute: Duration,
}

impl AttentionWork {
    /// The work done since `earlier`, a snapshot of the same counter.
    pub fn since(&self, earlier: &AttentionWork) -> AttentionWork {
        AttentionWork {
            score_elements: self.score_elements.saturating_sub(earlier.score_elements),
            compute: self.compute.saturating_sub(earlier.compute),
        }
    }
}

impl WorkCounter {
    pub(super) fn add(&self, elements: usize, time: Duration) {
        self.elements.fetch_add(elements as u64, Ordering::Relaxed);
        self.nanos
            .fetch_add(time.as_nanos() as u64, Ordering::Relaxed);
    }

    /// The work so far.
    pub fn snapshot(&self) -> AttentionWork {
        AttentionWork {
            score_elements: self.elements.load(Ordering::Relaxed),
            compute: Duration::from_nanos(self.nanos.load(Ordering::Relaxed)),
        }
    }
}
