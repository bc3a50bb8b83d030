//! The training job behind `flashover train` and `flashover verify`: configuration, the per-rank
//! loop, its report, and the equivalence check between layouts.

pub mod checkpoint;
mod config;
mod pp_model;
mod report;
mod run;
mod sharded_model;
mod tp_model;
mod trace;
mod verify;

pub use config::{
    CheckpointSection, DataSection, ModelSection, MoeSection, OptimSection, ParallelSection,
    RunSection, TrainConfig,
};
pub use pp_model::{TransformerStage, split_blocks, split_blocks_by_cost};
pub use report::{MoeRecord, RankTimes, StepRecord, TrainReport, memory_formula};
pub use run::{make_batch, token_source, train, train_process};
pub use sharded_model::ShardedTransformer;
pub use tp_model::TpTransformer;
pub use verify::{Comparison, compare, verify};
