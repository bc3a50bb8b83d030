//! What can go wrong with a checkpoint: every error names the file (or tensor) concerned.

use std::path::PathBuf;

/// A checkpoint error.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file's contents are not what the index promises (corrupt, truncated, malformed).
    #[error("{path}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The checkpoint does not fit the model or request (a missing tensor, another shape).
    #[error("{0}")]
    Mismatch(String),
    /// A caller's request is invalid (a region outside its tensor, bad arguments).
    #[error("{0}")]
    Invalid(String),
    /// No committed checkpoint where one was expected.
    #[error("{0}")]
    NotFound(String),
}

impl CheckpointError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CheckpointError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn corrupt(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        CheckpointError::Corrupt {
            path: path.into(),
            reason: reason.into(),
        }
    }
}
