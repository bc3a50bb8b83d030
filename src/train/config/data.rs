//! `[data]`: where a job's tokens come from.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// `[data]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataSection {
    /// `markov` (embedded, known loss floor) or `text` (byte tokens from `path`).
    pub source: String,
    /// Text file for `source = "text"`.
    pub path: Option<PathBuf>,
    /// Vocabulary of the Markov chain.
    pub vocab: usize,
    /// Successors per token of the Markov chain.
    pub branching: usize,
    /// Tokens per sample (the model sees `seq_len` inputs and predicts the next of each).
    pub seq_len: usize,
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection {
            source: "markov".into(),
            path: None,
            vocab: 64,
            branching: 4,
            seq_len: 32,
        }
    }
}
