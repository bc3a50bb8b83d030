//! `[run]`: steps, batch, seed, device, logs, and kill drills.

use flashover_runtime::DeviceChoice;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// `[run]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunSection {
    /// Optimizer steps.
    pub steps: usize,
    /// Samples per step over all data-parallel ranks.
    pub global_batch: usize,
    /// Micro-batches per step on each rank (gradient accumulation).
    pub micro_batches: usize,
    /// Seed of the model, the data and everything random.
    pub seed: u64,
    /// `flex`, `wgpu` or `cuda` (`BURN_DEVICE` overrides the default).
    pub device: DeviceChoice,
    /// Write one JSON line per step here.
    pub log_jsonl: Option<PathBuf>,
    /// Read the steps' losses and gradient norms to the host every this many steps, all of
    /// them in one read (1: every step). On a GPU each read waits for the device's queue;
    /// the steps' records are reported when read.
    pub log_every: usize,
    /// Write a timeline of every rank's steps (and pipeline actions) here, as Chrome trace
    /// JSON (open it in Perfetto).
    pub trace: Option<PathBuf>,
    /// Stop once this many steps are done (counted from step 0, resumed steps included), as an
    /// interrupted job would; the learning-rate schedule still spans `steps`. A checkpoint is
    /// saved on exit when saving is on.
    pub exit_after: Option<usize>,
    /// Fault drills (tests, `--kill RANK@STEP`, `--stall RANK@STEP`): each kills (a panic) or
    /// stalls its rank as that step starts, once per elastic run.
    #[serde(skip)]
    pub kills: Vec<KillDrill>,
}

/// Kill rank `rank` as step `step` starts (or stall it there), once: a restarted run on the
/// survivors may have a rank of that number again; the drill does not repeat.
#[derive(Debug, Clone, Default)]
pub struct KillDrill {
    /// Global rank of the world the drill fires in.
    pub rank: usize,
    /// The step at whose start it fires.
    pub step: usize,
    /// Stall this long instead of dying (its peers' collectives time out meanwhile).
    pub stall: Option<std::time::Duration>,
    fired: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl KillDrill {
    /// Kill `rank` at the start of `step`.
    pub fn new(rank: usize, step: usize) -> Self {
        KillDrill {
            rank,
            step,
            stall: None,
            fired: Default::default(),
        }
    }

    /// Stall `rank` for `duration` at the start of `step`.
    pub fn stall(rank: usize, step: usize, duration: std::time::Duration) -> Self {
        KillDrill {
            stall: Some(duration),
            ..KillDrill::new(rank, step)
        }
    }

    /// `RANK@STEP`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = || format!("`{text}`: expected RANK@STEP, e.g. 1@25");
        let (rank, step) = text.split_once('@').ok_or_else(bad)?;
        Ok(KillDrill::new(
            rank.trim().parse().map_err(|_| bad())?,
            step.trim().parse().map_err(|_| bad())?,
        ))
    }

    /// Whether it fires now, on `rank` at `step` (at most once).
    pub(crate) fn fires(&self, rank: usize, step: usize) -> bool {
        rank == self.rank
            && step == self.step
            && !self.fired.swap(true, std::sync::atomic::Ordering::SeqCst)
    }
}

impl PartialEq for KillDrill {
    fn eq(&self, other: &Self) -> bool {
        (self.rank, self.step, self.stall) == (other.rank, other.step, other.stall)
    }
}

impl Default for RunSection {
    fn default() -> Self {
        RunSection {
            steps: 200,
            global_batch: 16,
            micro_batches: 1,
            seed: 1,
            device: DeviceChoice::Flex,
            log_jsonl: None,
            log_every: 1,
            trace: None,
            exit_after: None,
            kills: vec![],
        }
    }
}
