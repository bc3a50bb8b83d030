//! `flashover bench memory`: per-rank bytes of parameters, gradients, optimizer state and
//! gathered parameters, measured by the strategies themselves, for DDP and each ZeRO stage at
//! several shard counts, next to the usual fp32 + AdamW formulas.

use flashover::train::{TrainConfig, memory_formula, train};
use serde::Serialize;

/// One layout's measurement (rank 0; every rank holds the same amounts up to padding).
#[derive(Debug, Clone, Serialize)]
pub struct MemoryBenchRecord {
    /// ZeRO stage (0: DDP).
    pub zero: u8,
    /// Ranks state is sharded over.
    pub n: usize,
    /// Mesh the run used.
    pub mesh: String,
    /// Parameters in the model.
    pub params: usize,
    /// Measured bytes: parameters, gradients (peak in the step), optimizer state.
    pub measured_state: usize,
    /// Measured peak of gathered (unsharded) parameters, ZeRO-3 only.
    pub gathered_peak: usize,
    /// Formula bytes, not counting gathered units.
    pub formula: f64,
    /// Largest ZeRO-3 unit in bytes (the formula's "plus gathered units").
    pub largest_unit: usize,
}

/// Runs `config` (two steps; memory is measured in the last) for every stage in `stages` and
/// shard count in `ns`.
pub fn run(
    config: &TrainConfig,
    stages: &[u8],
    ns: &[usize],
) -> Result<Vec<MemoryBenchRecord>, String> {
    let mut out = vec![];
    for &zero in stages {
        for &n in ns {
            let mut c = config.clone();
            c.parallel.zero = zero;
            c.parallel.mesh = if zero == 3 {
                format!("fsdp={n}")
            } else {
                format!("dp={n}")
            };
            c.run.global_batch = c.run.global_batch.div_ceil(n) * n;
            c.run.micro_batches = 1;
            c.run.steps = 2;
            c.run.log_jsonl = None;
            let report = train(&c, &|_| {})?;
            let m = report.memory[0];
            let shard_n = if zero == 0 { 1 } else { n };
            let model_config = c.transformer(c.vocab_size())?;
            let per_block = model_config.num_params_per_block();
            let root = model_config.num_params() - per_block * model_config.n_layers;
            out.push(MemoryBenchRecord {
                zero,
                n,
                mesh: c.parallel.mesh.clone(),
                params: report.num_params,
                measured_state: m.total() - m.gathered_peak,
                gathered_peak: m.gathered_peak,
                formula: memory_formula(zero, report.num_params, shard_n),
                largest_unit: if zero == 3 {
                    4 * per_block.max(root)
                } else {
                    0
                },
            });
        }
    }
    Ok(out)
}
