//! The training job behind `flashover train` and `flashover verify`: configuration, the per-rank
//! loop, its report, and the equivalence check between layouts.

mod config;
mod report;
mod run;
mod verify;

pub use config::{
    DataSection, ModelSection, OptimSection, ParallelSection, RunSection, TrainConfig,
};
pub use report::{RankTimes, StepRecord, TrainReport};
pub use run::{make_batch, token_source, train};
pub use verify::{Comparison, compare, verify};
