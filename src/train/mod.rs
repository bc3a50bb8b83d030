//! The training job behind `flashover train` and `flashover verify`: configuration, the per-rank
//! loop, its report, and the equivalence check between layouts.
//!
//! ```
//! use flashover::train::{
//!     TrainConfig, make_batch, memory_formula, split_blocks, split_blocks_by_cost, token_source,
//!     train,
//! };
//!
//! // A job: defaults, then a file's fields; `validate` lists every problem at once.
//! let mut config = TrainConfig::default();
//! config.parallel.mesh = "dp=2".into();
//! config.run.steps = 2;
//! config.run.global_batch = 4;
//! assert!(config.validate().is_empty());
//! assert_eq!(config.mesh().unwrap().world_size(), 2);
//! assert!(config.lr_at(0) < config.lr_at(1), "warm-up");
//!
//! // The data: samples by global index, inputs and next-token targets.
//! let source = token_source(&config).unwrap();
//! let model = config.transformer(config.vocab_size()).unwrap();
//! let device = burn::tensor::Device::flex();
//! let (inputs, targets) = make_batch(&*source, 0..2, config.data.seq_len, &device);
//! assert_eq!(inputs.dims(), targets.dims());
//!
//! // The run and its report.
//! let report = train(&config, &|_| {}).unwrap();
//! assert!(report.final_loss().is_finite());
//! assert_eq!(report.rank_totals().len(), 2);
//! assert_eq!(report.params_per_rank(), report.num_params);
//!
//! // Pipeline splits and the ZeRO memory formula (DDP: 16 bytes per parameter in fp32).
//! assert_eq!(split_blocks(5, 2, None).unwrap(), vec![3, 2]);
//! assert_eq!(split_blocks_by_cost(&model, 32, 2).unwrap().iter().sum::<usize>(), model.n_layers);
//! assert_eq!(memory_formula(0, 1000, 4), 16000.0);
//! ```

pub mod checkpoint;
mod config;
mod elastic;
mod metrics;
mod rank;
mod report;
mod run;
mod stage_split;
mod strategy;
mod trace;
mod verify;

pub use config::{
    CheckpointSection, DataSection, Engine, GradientReduction, KillDrill, ModelSection, MoeSection,
    OptimSection, ParallelSection, RunSection, TrainConfig,
};
pub use elastic::{
    ElasticOptions, ElasticReport, NextAttempt, Restart, next_attempt, survivor_mesh, train_elastic,
};
pub use report::{
    AXIS_BUCKETS, AxisComm, DeviceMemory, MoeRecord, RankTimes, StepRecord, TrainReport,
    axis_bucket_name, memory_formula,
};
pub use run::{make_batch, token_source, train, train_process};
pub use stage_split::{split_blocks, split_blocks_by_cost};
pub use verify::{Comparison, compare, verify};
