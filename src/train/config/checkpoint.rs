//! `[checkpoint]`: saving and resuming a job's training checkpoints.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// `[checkpoint]`: sharded training checkpoints (see `docs/checkpoints.md`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointSection {
    /// Where checkpoints go: one `step-NNNNNNNN` directory each.
    pub dir: Option<PathBuf>,
    /// Save after every this many steps and after the last (0: never).
    pub save_every: usize,
    /// How many committed checkpoints to keep (oldest removed first).
    pub keep: usize,
    /// Write in the background while training continues (the next save waits for it).
    pub async_save: bool,
    /// Resume from this checkpoint (a `step-*` directory, or a directory of them: the newest).
    pub resume: Option<PathBuf>,
    /// Start from these weights instead of the seeded initialisation: a safetensors file of
    /// whole tensors named as the model's parameters (`ckpt export` writes one; so does
    /// ordinary Burn code with burn-store). The optimizer starts fresh at step 0.
    pub init_from: Option<PathBuf>,
    /// Fault injection for tests: `(rank, step)` makes that rank fail right after writing its
    /// shard of that step's checkpoint, before anything is committed.
    #[serde(skip)]
    pub fail_after_write: Option<(usize, usize)>,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        CheckpointSection {
            dir: None,
            save_every: 0,
            keep: 3,
            async_save: false,
            resume: None,
            init_from: None,
            fail_after_write: None,
        }
    }
}
