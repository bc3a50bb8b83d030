//! Flashover's checkpoints for a `Learner` under a plan, in place of burn-train's checkpointer:
//! the model as each rank holds it, the optimizer's state placed as its parameters are, and the
//! learning-rate scheduler, saved at the end of every epoch and read back on any mesh and plan.
//!
//! A `Learner` keeps its optimizer and scheduler private and hands their records only to a
//! `LearningCheckpointer`, so one runs here with checkpointers that keep the records in memory
//! (the model's record, taken while parameters read as stored, costs no collective and is
//! dropped: the placements write the model).

use crate::plan_checkpoint::{Checkpoints, RunState};
use burn::optim::OptimizerRecord;
use burn::optim::lr_scheduler::LrSchedulerRecord;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use burn_train::checkpoint::{
    AsyncCheckpointer, Checkpoint, Checkpointer, CheckpointerError, CheckpointingAction,
    CheckpointingStrategy,
};
use burn_train::metric::store::EventStoreClient;
use burn_train::{Learner, LearnerModel, LearningCheckpointer};
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::Parallelized;
use flashover_runtime::RankContext;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Where a `Learner`'s checkpoints go and come from.
#[derive(Default)]
pub(super) struct LearnerCheckpoints {
    /// Saved at the end of every epoch, when set.
    save: Option<Checkpoints>,
    /// Another run's checkpoints to resume from, when set (otherwise `save`'s).
    resume_from: Option<PathBuf>,
}

impl LearnerCheckpoints {
    /// Saves under `root`, keeping the newest `keep`.
    pub(super) fn save_to(&mut self, root: &Path, keep: usize) {
        self.save = Some(Checkpoints::new(root, keep));
    }

    /// Resumes from the checkpoints under `root` (another run's).
    pub(super) fn resume_from(&mut self, root: &Path) {
        self.resume_from = Some(root.to_path_buf());
    }

    /// Saves the state after `epoch` (collective).
    pub(super) fn save<M: LearnerModel>(
        &mut self,
        par: &Parallelized,
        ctx: &RankContext,
        epoch: usize,
        learner: &Learner<M>,
        store: &EventStoreClient,
    ) -> Result<(), ParallelError> {
        let Some(checkpoints) = &mut self.save else {
            return Ok(());
        };
        let (optim, scheduler) = records(par, learner, store)?;
        let scheduler = scheduler
            .into_bytes()
            .map_err(|e| fail(format!("the learning-rate scheduler's record: {e}")))?
            .to_vec();
        let user = serde_json::json!({ "epoch": epoch, "lr_scheduler": scheduler });
        checkpoints.save_record(par, ctx, epoch as u64, &learner.model(), optim, user)
    }

    /// `learner` (its model, optimizer and scheduler) as saved after `epoch`, whatever mesh
    /// and plan saved it. Fails naming the directory when there is no such checkpoint.
    pub(super) fn resume<M: LearnerModel>(
        &self,
        par: &Parallelized,
        ctx: &RankContext,
        epoch: usize,
        learner: &mut Learner<M>,
    ) -> Result<(), ParallelError> {
        let saved = self.save.as_ref().map(Checkpoints::root);
        let Some(root) = self.resume_from.as_deref().or(saved) else {
            return Err(fail(format!(
                "SupervisedTraining::checkpoint({epoch}) resumes from Flashover's checkpoints: \
                 give ParallelLearning::checkpoints(dir, keep) or resume_from(dir)"
            )));
        };
        let dir = Checkpoints::new(root, 1)
            .of_step(epoch as u64)?
            .ok_or_else(|| {
                fail(format!(
                    "no committed checkpoint of epoch {epoch} under {}",
                    root.display()
                ))
            })?;
        let (model, optim, run) = Checkpoints::resume_record(par, ctx, &dir, learner.model())?;
        learner.load_model(par.sharded().with_stored_reads(|| model.into_record()));
        learner.load_optim(optim);
        learner.load_scheduler(scheduler_of(&run, &dir)?);
        Ok(())
    }
}

/// The learning-rate scheduler's record in a checkpoint's run state.
fn scheduler_of(run: &RunState, dir: &Path) -> Result<LrSchedulerRecord, ParallelError> {
    let bytes: Vec<u8> = serde_json::from_value(run.user["lr_scheduler"].clone()).map_err(|e| {
        fail(format!(
            "{}: not a Learner's checkpoint (no learning-rate scheduler state: {e})",
            dir.display()
        ))
    })?;
    LrSchedulerRecord::from_bytes(Bytes::from_bytes_vec(bytes)).map_err(|e| {
        fail(format!(
            "{}: the learning-rate scheduler's record: {e}",
            dir.display()
        ))
    })
}

fn fail(what: impl std::fmt::Display) -> ParallelError {
    ParallelError::Invalid(format!("Learner checkpoint: {what}"))
}

/// `learner`'s optimizer and scheduler records, through a `LearningCheckpointer` whose
/// checkpointers keep them.
fn records<M: LearnerModel>(
    par: &Parallelized,
    learner: &Learner<M>,
    store: &EventStoreClient,
) -> Result<(OptimizerRecord, LrSchedulerRecord), ParallelError> {
    let optim = Kept::default();
    let scheduler = Kept::default();
    par.sharded().with_stored_reads(|| {
        let mut checkpointer = LearningCheckpointer::new(
            AsyncCheckpointer::new(Kept::<ModuleRecord>::default()),
            AsyncCheckpointer::new(optim.clone()),
            AsyncCheckpointer::new(scheduler.clone()),
            Box::new(EveryEpoch),
        );
        checkpointer.checkpoint(learner, 0, store);
        // Dropped here: its writer threads finish before the records are read.
    });
    let missing = || fail("burn-train's checkpointer handed over no record");
    Ok((
        optim.take().ok_or_else(missing)?,
        scheduler.take().ok_or_else(missing)?,
    ))
}

/// A checkpointer that keeps the last record it is given.
struct Kept<R>(Arc<Mutex<Option<R>>>);

impl<R> Default for Kept<R> {
    fn default() -> Self {
        Kept(Arc::new(Mutex::new(None)))
    }
}

impl<R> Clone for Kept<R> {
    fn clone(&self) -> Self {
        Kept(self.0.clone())
    }
}

impl<R> Kept<R> {
    fn take(&self) -> Option<R> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl<R: Checkpoint + Send> Checkpointer<R> for Kept<R> {
    fn save(&self, _epoch: usize, record: R) -> Result<(), CheckpointerError> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(record);
        Ok(())
    }

    fn delete(&self, _epoch: usize) -> Result<(), CheckpointerError> {
        Ok(())
    }

    fn restore(&self, _epoch: usize) -> Result<R, CheckpointerError> {
        Err(CheckpointerError::Unknown(
            "records are only kept, never restored".into(),
        ))
    }
}

/// Saves whenever asked.
struct EveryEpoch;

impl CheckpointingStrategy for EveryEpoch {
    fn checkpointing(
        &mut self,
        _epoch: usize,
        _collector: &EventStoreClient,
    ) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}
