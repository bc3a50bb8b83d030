//! The strategies' error type.

use flashover_comm::CommError;

/// Why a parallel strategy could not proceed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ParallelError {
    /// A collective failed (timeout, peer left, mismatch). The `CommError` is also the
    /// error's source, so launchers can tell a consequence from a root cause.
    #[error("{0}")]
    Comm(#[from] CommError),
    /// The model or its gradients do not fit what the strategy expects.
    #[error("{0}")]
    Invalid(String),
}
