//! Benchmarks behind `flashover bench`. Figures go to `docs/benchmarks.md` with the command that
//! produced them; ratios are measured side by side in one run because these machines are noisy.
//!
//! ```
//! use flashover::OpKind;
//! use flashover::bench::{calibrate, comm, working_memory};
//! use flashover::train::TrainConfig;
//! use std::time::Duration;
//!
//! // Message sizes of `bench comm`, and one all-reduce of 4 KiB over two rank threads.
//! assert_eq!(comm::sizes(4096, 65536), vec![4096, 16384, 65536]);
//! assert!(comm::time_collective(OpKind::AllReduce, 2, 4096, Duration::from_millis(20)) > 0.0);
//! assert!(comm::memcpy_gbps(1 << 16, Duration::from_millis(20)) > 0.0);
//! // The matrix-product rate `bench plan` calibrates the planner with.
//! assert!(calibrate::matmul_rate(32, 0.01) > 0.0);
//! // Heap measurements need the counting allocator, which the `flashover` binary installs.
//! let mut job = TrainConfig::default();
//! job.run.steps = 2;
//! let measured = working_memory::measure(&job);
//! assert_eq!(measured.is_ok(), flashover::heap::counting());
//! ```

pub mod calibrate;
pub mod checkpoint;
pub mod comm;
pub mod context;
pub mod memory;
pub mod moe;
pub mod pipeline;
pub mod recompute;
pub mod train;
pub mod working_memory;
