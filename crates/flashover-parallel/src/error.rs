//! The strategies' error type.

use flashover_comm::CommError;

/// Why a parallel strategy could not proceed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ParallelError {
    /// A collective failed (timeout, peer left, mismatch).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The model or its gradients do not fit what the strategy expects.
    #[error("{0}")]
    Invalid(String),
}
