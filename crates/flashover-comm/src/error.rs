//! The one error type of the collective layer.

use crate::op::OpKind;
use std::time::Duration;

/// Result of a collective operation.
pub type CommResult<T> = Result<T, CommError>;

/// Why a collective operation failed. Every variant names the group and, where it applies, the
/// operation, its sequence number in the group and the global ranks involved, so a user can find
/// the rank that hung or misbehaved.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum CommError {
    /// Some ranks did not reach the operation before the deadline.
    #[error(
        "{op} #{seq} in group {group} timed out after {waited:?}: ranks {missing:?} did not arrive (arrived: {arrived:?})"
    )]
    Timeout {
        /// The operation that timed out.
        op: OpKind,
        /// The group's name.
        group: String,
        /// Sequence number of the operation in the group (0 = first).
        seq: u64,
        /// Global ranks that did not arrive.
        missing: Vec<usize>,
        /// Global ranks that did arrive.
        arrived: Vec<usize>,
        /// How long this rank waited.
        waited: Duration,
    },
    /// Ranks issued different operations (or the same one with different sizes) at the same step.
    #[error("mismatched collective #{seq} in group {group}: {detail}")]
    Mismatch {
        /// The group's name.
        group: String,
        /// Sequence number of the operation in the group.
        seq: u64,
        /// What each rank called, e.g. `rank 0: all_gather f32 x10; rank 1: all_reduce f32 x12`.
        detail: String,
    },
    /// A peer left the group (its thread or process ended or panicked) while others needed it.
    #[error("{op} in group {group}: rank {rank} left the group ({reason})")]
    PeerLeft {
        /// The operation that could not complete.
        op: OpKind,
        /// The group's name.
        group: String,
        /// Global rank that left.
        rank: usize,
        /// Why it left, e.g. `panicked: index out of bounds`.
        reason: String,
    },
    /// The group failed earlier; no further operation can complete on it.
    #[error("group {group} is unusable after an earlier failure: {cause}")]
    Poisoned {
        /// The group's name.
        group: String,
        /// The first failure.
        cause: Box<CommError>,
    },
    /// The arguments of this rank's call are invalid on their own.
    #[error("invalid {op} in group {group}: {detail}")]
    InvalidArgument {
        /// The operation.
        op: OpKind,
        /// The group's name.
        group: String,
        /// What is wrong and what is expected.
        detail: String,
    },
    /// A fault injected on purpose by a [`crate::FaultPlan`].
    #[error("injected fault on rank {rank} at {op}")]
    Injected {
        /// Global rank.
        rank: usize,
        /// The operation.
        op: OpKind,
    },
    /// The engine itself failed (MPI or NCCL error, missing library).
    #[error("{engine} engine: {detail}")]
    Engine {
        /// Engine name (`mpi`, `nccl`).
        engine: &'static str,
        /// The engine's message.
        detail: String,
    },
}

impl CommError {
    /// The first failure behind a [`CommError::Poisoned`] chain (or `self`).
    pub fn root_cause(&self) -> &CommError {
        match self {
            CommError::Poisoned { cause, .. } => cause.root_cause(),
            other => other,
        }
    }
}

/// The text of a panic payload (`panic!` with a literal or a formatted message).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

impl CommError {
    /// A panic on an engine's communication thread (`thread`, e.g. "gradient communication
    /// thread"), as the error its waiting caller receives instead of waiting forever.
    pub fn from_panic(
        engine: &'static str,
        thread: &str,
        payload: &(dyn std::any::Any + Send),
    ) -> Self {
        CommError::Engine {
            engine,
            detail: format!("{thread} panicked: {}", panic_message(payload)),
        }
    }
}
