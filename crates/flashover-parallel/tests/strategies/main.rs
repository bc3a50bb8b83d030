//! The strategies' multi-rank tests, in one test binary (one link instead of four): DDP under
//! faults, ZeRO stages 1-3 and HSDP, tensor-parallel layers and the expert-parallel MoE layer
//! (the pipeline executor's own tests are the crate's unit tests, `pipeline/executor_tests.rs`).

mod activation_checkpointing;
mod burn_layers;
mod burn_transformer;
mod common;
mod context_parallel;
mod ddp_faults;
mod expert_parallel;
mod host_buffers;
mod loop_overlap;
mod parallelize;
mod parallelize_context;
mod parallelize_experts;
mod parallelize_precision;
mod parallelize_streams;
mod plan_loops;
mod tensor_parallel;
mod zero;
