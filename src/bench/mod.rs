//! Benchmarks behind `flashover bench`. Figures go to `docs/benchmarks.md` with the command that
//! produced them; ratios are measured side by side in one run because these machines are noisy.

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
