//! The strategies' multi-rank tests, in one test binary (one link instead of four): DDP under
//! faults, ZeRO stages 1-3 and HSDP, tensor-parallel layers, and the pipeline executor.

mod common;
mod ddp_faults;
mod pipeline;
mod tensor_parallel;
mod zero;
