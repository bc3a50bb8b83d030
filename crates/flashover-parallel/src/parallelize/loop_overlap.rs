//! Gradient buckets reduced while the backward of a loop of one's own runs.
//!
//! A pipeline step knows its micro-batches and marks the last one's backward, whose complete
//! buckets are reduced as they fill. A loop of one's own shows the plan only its forwards
//! ([`super::Parallelized::forward`]) and, after the step, its gradients. So a forward runs on
//! hooked parameters, and the number of micro-batches (forwards whose backward reported before
//! the next forward) is learned from the step before: the first step's buckets are reduced
//! after its backward, and from then on the backward of the micro-batch that ended the last
//! step reduces them while it runs (PyTorch DDP's overlap, and its accumulation: earlier
//! micro-batches only add into the buckets). Two forwards before a backward (several losses
//! summed into one) share one micro-batch, whose buckets wait for the step's gradients (refused
//! under ZeRO-2's reduce-scatter, which reduces every micro-batch as it fills). A step that
//! runs more micro-batches than the one before fails: its buckets were already being reduced.

use crate::data_parallel::BucketedReduction;
use crate::error::ParallelError;
use std::sync::{Mutex, MutexGuard};

/// Where a loop of one's own is in its step, as far as its forwards tell.
#[derive(Debug, Default)]
struct LoopStep {
    /// Whether a forward of this step ran on hooked parameters (the buckets' step began).
    hooked: bool,
    /// The micro-batches of this step so far.
    micro_batches: usize,
    /// The micro-batches of the last hooked step, whose last backward may reduce.
    last_step: Option<usize>,
}

/// The micro-batch protocol of [`BucketedReduction`] driven from a loop's forwards.
#[derive(Debug, Default)]
pub(super) struct LoopOverlap {
    step: Mutex<LoopStep>,
}

impl LoopOverlap {
    fn lock(&self) -> MutexGuard<'_, LoopStep> {
        self.step.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Before a forward on [`BucketedReduction::hooked`] parameters: begins the step's
    /// buckets at its first forward, a micro-batch at each forward after a backward reported
    /// (the last one as many as the step before ran), and keeps one micro-batch for forwards
    /// between which no backward ran. Fails when a backward already reduced what this step
    /// adds to.
    pub(super) fn before_forward(&self, buckets: &BucketedReduction) -> Result<(), ParallelError> {
        let mut step = self.lock();
        if !step.hooked {
            buckets.begin_step(true);
            step.hooked = true;
            step.micro_batches = 1;
            buckets.begin_micro(step.last_step == Some(1));
            return Ok(());
        }
        if !buckets.any_arrived() {
            if buckets.reduces_every_micro() {
                return Err(ParallelError::Invalid(
                    "Parallelized::forward ran twice before a backward, under \
                     gradient_buckets.rows = ReduceScatter (ZeRO-2) with overlap: each \
                     micro-batch's buckets are reduce-scattered as its backward fills them, so \
                     one backward cannot follow two hooked forwards. Compute the losses in one \
                     Parallelized::forward (sum them there), or set gradient_buckets.overlap = \
                     false"
                        .into(),
                ));
            }
            // Another loss of the same micro-batch: its buckets wait for every backward.
            buckets.begin_micro(false);
            return Ok(());
        }
        if buckets.in_last_micro() {
            return Err(ParallelError::Invalid(format!(
                "Parallelized::forward: this step runs more micro-batches than the step before \
                 ({}), whose number the gradient buckets' overlap learned: the last of them \
                 already reduced its buckets during backward. Run as many micro-batches \
                 (forward, then backward) every step, or set gradient_buckets.overlap = false",
                step.micro_batches
            )));
        }
        buckets.end_micro()?;
        step.micro_batches += 1;
        buckets.begin_micro(step.last_step == Some(step.micro_batches));
        Ok(())
    }

    /// At the step's reduction: whether its forwards ran hooked (the buckets' step is under
    /// way); remembers its micro-batches for the next step, which starts afresh.
    pub(super) fn end_step(&self) -> bool {
        let mut step = self.lock();
        let hooked = step.hooked;
        if hooked {
            step.last_step = Some(step.micro_batches);
        }
        step.hooked = false;
        step.micro_batches = 0;
        hooked
    }
}
