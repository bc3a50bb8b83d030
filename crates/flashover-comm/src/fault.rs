//! Fault injection: make a chosen rank stall, slow down or die at a chosen collective, so tests
//! can prove that failures surface as errors naming the culprit, and that delays never change
//! results.

use crate::op::OpKind;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// What happens when a [`FaultRule`] fires.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FaultAction {
    /// Sleep this long before entering the operation, then carry on. With a duration longer
    /// than the collective timeout this is a stalled rank.
    Delay(Duration),
    /// Panic (the rank dies) before entering the operation.
    Panic,
}

/// One rule: on `rank`, at calls of `op` (any kind if `None`), at the `nth` matching call
/// (0-based; every matching call if `None`), do `action`.
#[derive(Debug, Clone)]
pub struct FaultRule {
    /// Global rank the rule applies to.
    pub rank: usize,
    /// Operation kind filter.
    pub op: Option<OpKind>,
    /// Which matching call fires (0-based), or every call.
    pub nth: Option<u64>,
    /// What to do.
    pub action: FaultAction,
}

/// A set of fault rules shared by every communicator of a world.
///
/// ```
/// use flashover_comm::{FaultPlan, OpKind};
/// use std::time::Duration;
/// // Rank 1 dies at its third all-reduce; rank 0 is slowed before every all-gather.
/// let plan = FaultPlan::new()
///     .panic_at(1, OpKind::AllReduce, 2)
///     .delay_every(0, OpKind::AllGather, Duration::from_millis(5));
/// assert_eq!(plan.rules().len(), 2);
/// ```
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    rules: Vec<(FaultRule, Arc<AtomicU64>)>,
}

impl FaultPlan {
    /// Whether the plan injects nothing.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// An empty plan (no faults).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a rule.
    pub fn with(mut self, rule: FaultRule) -> Self {
        self.rules.push((rule, Arc::new(AtomicU64::new(0))));
        self
    }

    /// `rank` sleeps `duration` before its `nth` call of `op`.
    pub fn stall_at(self, rank: usize, op: OpKind, nth: u64, duration: Duration) -> Self {
        self.with(FaultRule {
            rank,
            op: Some(op),
            nth: Some(nth),
            action: FaultAction::Delay(duration),
        })
    }

    /// `rank` panics at its `nth` call of `op`.
    pub fn panic_at(self, rank: usize, op: OpKind, nth: u64) -> Self {
        self.with(FaultRule {
            rank,
            op: Some(op),
            nth: Some(nth),
            action: FaultAction::Panic,
        })
    }

    /// `rank` sleeps `duration` before every call of `op`.
    pub fn delay_every(self, rank: usize, op: OpKind, duration: Duration) -> Self {
        self.with(FaultRule {
            rank,
            op: Some(op),
            nth: None,
            action: FaultAction::Delay(duration),
        })
    }

    /// The rules, in the order added.
    pub fn rules(&self) -> Vec<&FaultRule> {
        self.rules.iter().map(|(r, _)| r).collect()
    }

    /// Applies the rules for a call of `op` by `rank`: sleeps or panics as they say.
    pub fn apply(&self, rank: usize, op: OpKind) {
        for (rule, counter) in &self.rules {
            if rule.rank != rank || rule.op.is_some_and(|o| o != op) {
                continue;
            }
            let index = counter.fetch_add(1, Ordering::Relaxed);
            if rule.nth.is_some_and(|n| n != index) {
                continue;
            }
            match rule.action {
                FaultAction::Delay(d) => std::thread::sleep(d),
                FaultAction::Panic => {
                    panic!("injected fault: rank {rank} dies at {op} call #{index}")
                }
            }
        }
    }
}
