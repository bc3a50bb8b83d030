//! The save protocol seen from one rank: write its shard (now or in the background), agree
//! with every other rank on each phase, and let rank 0 commit and prune.

use flashover_checkpoint::{CheckpointError, PieceData, ShardManifest};
use flashover_comm::{CommunicatorExt, Group, control};
use std::path::Path;

/// Every rank's `value` of `world`, in rank order (collective; JSON bytes padded to the
/// longest): the shard manifests, or any small state each rank holds part of.
pub(crate) fn all_gather_json<T: serde::Serialize + serde::de::DeserializeOwned>(
    world: &Group,
    value: &T,
) -> Result<Vec<T>, String> {
    let bytes = serde_json::to_vec(value).map_err(|e| e.to_string())?;
    let mut longest = [bytes.len() as u64];
    control(|| world.all_reduce(&mut longest, flashover_comm::ReduceOp::Max))
        .map_err(|e| e.to_string())?;
    let mut padded = bytes;
    padded.resize(longest[0] as usize, b' ');
    let all = control(|| world.all_gather_vec(&padded)).map_err(|e| e.to_string())?;
    all.chunks(longest[0].max(1) as usize)
        .map(|chunk| serde_json::from_slice(chunk).map_err(|e| e.to_string()))
        .collect()
}

/// A save whose shard is being written in the background.
struct Pending {
    step: u64,
    run: serde_json::Value,
    writer: std::thread::JoinHandle<Result<ShardManifest, CheckpointError>>,
}

/// One rank's side of saving: write its shard (now or in the background), then, with every
/// other rank, commit (rank 0 writes the index) and prune. A save waits for the previous one.
pub struct Saver {
    root: std::path::PathBuf,
    keep: usize,
    background: bool,
    pending: Option<Pending>,
    /// Fault injection: fail after writing the shard of this step.
    fail_after_write: Option<u64>,
}

impl Saver {
    /// Saves under `root`, keeping `keep` checkpoints; `background` writes asynchronously.
    /// `fail_after_write` (tests) makes this rank fail after writing that step's shard.
    pub fn new(root: &Path, keep: usize, background: bool, fail_after_write: Option<u64>) -> Self {
        Saver {
            root: root.to_path_buf(),
            keep,
            background,
            pending: None,
            fail_after_write,
        }
    }

    /// Saves this rank's `pieces` as part of the checkpoint of `step` (collective over
    /// `world`). With background writing, returns once the shard's writer has started; the
    /// checkpoint is committed by the next `save` or [`Saver::finish`].
    pub fn save(
        &mut self,
        world: &Group,
        step: u64,
        run: serde_json::Value,
        pieces: Vec<PieceData>,
    ) -> Result<(), String> {
        self.finish(world)?;
        // Rank 0 prepares the directory; everyone learns whether that worked.
        let prepared = if world.rank() == 0 {
            flashover_checkpoint::begin(&self.root, step).map(|_| ())
        } else {
            Ok(())
        };
        agree(world, "prepare", step, prepared.map_err(|e| e.to_string()))?;
        let dir = flashover_checkpoint::partial(&self.root, step);
        let rank = world.rank();
        let writer = std::thread::Builder::new()
            .name(format!("ckpt-writer-{rank}"))
            .spawn(move || flashover_checkpoint::write_shard(&dir, rank, &pieces))
            .map_err(|e| format!("starting the checkpoint writer: {e}"))?;
        self.pending = Some(Pending { step, run, writer });
        if !self.background {
            self.finish(world)?;
        }
        Ok(())
    }

    /// Waits for the pending save (if any) and commits it (collective over `world`).
    pub fn finish(&mut self, world: &Group) -> Result<(), String> {
        let Some(p) = self.pending.take() else {
            return Ok(());
        };
        let mine = p
            .writer
            .join()
            .map_err(|_| "the checkpoint writer panicked".to_string())
            .and_then(|r| r.map_err(|e| e.to_string()))
            .and_then(|m| {
                if self.fail_after_write == Some(p.step) {
                    Err("injected failure after writing the shard".into())
                } else {
                    Ok(m)
                }
            });
        let written = agree(
            world,
            "write",
            p.step,
            mine.as_ref().map(|_| ()).map_err(Clone::clone),
        );
        let manifest = match (written, mine) {
            (Ok(()), Ok(m)) => m,
            (Err(e), _) | (_, Err(e)) => return Err(e),
        };
        let manifests = all_gather_json(world, &manifest)?;
        let committed = if world.rank() == 0 {
            flashover_checkpoint::commit(&self.root, p.step, p.run, manifests)
                .and_then(|_| flashover_checkpoint::prune(&self.root, self.keep))
                .map_err(|e| e.to_string())
        } else {
            Ok(())
        };
        agree(world, "commit", p.step, committed)
    }
}

/// Every rank's outcome of one phase of a save: all succeed, or all fail with a message naming
/// the ranks that failed (and this rank's own error).
fn agree(world: &Group, phase: &str, step: u64, mine: Result<(), String>) -> Result<(), String> {
    let failed = control(|| world.all_gather_vec(&[mine.is_err() as u8]))
        .map_err(|e| format!("checkpoint of step {step} ({phase}): {e}"))?;
    let ranks: Vec<usize> = (0..failed.len()).filter(|&r| failed[r] != 0).collect();
    if ranks.is_empty() {
        return Ok(());
    }
    Err(format!(
        "checkpoint of step {step} not committed: {phase} failed on rank(s) {ranks:?}{}; the previous checkpoint is intact",
        mine.err()
            .map_or(String::new(), |e| format!(" (here: {e})"))
    ))
}
