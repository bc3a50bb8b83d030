//! Pipeline parallelism over the `pp` mesh axis: schedules, their executor, deferred weight
//! gradients.
//!
//! A schedule is data ([`Schedule`]): per rank, the ordered list of forward, backward (or
//! input- and weight-gradient) and send/receive actions. Generators build GPipe, 1F1B,
//! interleaved 1F1B and zero-bubble H1; users can write their own. [`validate`] checks a
//! schedule before anything runs (a backward before its forward, an unmatched or misordered
//! message, deadlock); [`simulate`] times it with given costs, giving each rank's bubble and
//! peak activations in flight; [`render_table`] prints the time x stage table.
//! What crosses a stage boundary is one tensor or several ([`StageBoundary`]). The crate's
//! executor runs a schedule on this rank's model chunks, under
//! `PipelineRunner::step` (the one way a plan's model is pipelined); [`deferred_linear`]
//! lets linear layers leave their weight gradients to the schedule's weight-gradient actions.

mod boundary;
mod executor;
#[cfg(test)]
mod executor_tests;
mod schedule;
mod simulate;
pub(crate) mod weight_grad;

pub use crate::plan::ScheduleKind;
pub use boundary::{BoundaryTensor, NoGrad, StageBoundary};
pub(crate) use boundary::{PartSpec, boundary_tensors, from_boundary_tensors, specs_of};
pub(crate) use executor::BackwardSink;
pub use executor::PipelineStepReport;
pub(crate) use executor::{PipelineExecutor, StageOutput};
pub use schedule::{Action, ActionKind, Schedule};
pub use simulate::{
    Costs, ScheduleError, Slot, Timeline, render_table, simulate, unbuffered_deadlock, validate,
};
pub(crate) use weight_grad::deferred_product;
pub use weight_grad::{DeferredWeightGrad, WeightGradStore, deferral_supported, deferred_linear};
