//! `flashover bench recompute`: working memory and step time of each activation-checkpointing
//! policy, one rank, at two model sizes ([`super::working_memory`] measures the heap).

use super::working_memory::measure;
use burn::tensor::Device;
use flashover::heap;
use flashover::train::{TrainConfig, make_batch, token_source};
use flashover_models::{ForwardContext, next_token_loss};
use flashover_parallel::activation_checkpointing::CheckpointPolicy;
use serde::Serialize;

/// One (model, policy) measurement.
#[derive(Debug, Clone, Serialize)]
pub struct RecomputeBenchRecord {
    /// `d_model x n_layers`.
    pub model: String,
    /// The policy.
    pub policy: String,
    /// Bytes the autodiff graph holds once forward has computed the loss: the activations
    /// kept for backward (one forward of the job's batch, outside the job).
    pub kept_bytes: usize,
    /// Peak working heap of a step (bytes): activations kept for backward, recomputed ones and
    /// gradients.
    pub working_bytes: usize,
    /// Median step time (seconds).
    pub step_s: f64,
    /// Final loss (every policy must give the same).
    pub loss: f64,
}

/// Runs `config` on one rank for every `(d_model, n_layers)` in `sizes` and every policy.
pub fn run(
    config: &TrainConfig,
    sizes: &[(usize, usize)],
    policies: &[String],
) -> Result<Vec<RecomputeBenchRecord>, String> {
    let mut out = vec![];
    for &(d_model, n_layers) in sizes {
        for policy in policies {
            let mut c = config.clone();
            c.parallel.mesh = "dp=1".into();
            c.model.d_model = Some(d_model);
            c.model.n_layers = Some(n_layers);
            c.model.d_ff = Some(d_model * 8 / 3);
            c.parallel.activation_checkpointing = policy.parse()?;
            let errors = c.validate();
            if !errors.is_empty() {
                return Err(errors.join("; "));
            }
            let kept_bytes = kept_after_forward(&c)?;
            let m = measure(&c)?;
            out.push(RecomputeBenchRecord {
                model: format!("{d_model} x {n_layers}"),
                policy: policy.clone(),
                kept_bytes,
                working_bytes: m.working_bytes,
                step_s: m.step_s,
                loss: m.report.steps.last().map_or(f64::NAN, |s| s.loss),
            });
        }
    }
    Ok(out)
}

/// Heap bytes that one forward of `config`'s batch (on one Flex rank) leaves held for
/// backward, under `config`'s checkpointing policy.
fn kept_after_forward(config: &TrainConfig) -> Result<usize, String> {
    let policy: CheckpointPolicy = config.parallel.activation_checkpointing.clone();
    let source = token_source(config)?;
    let model_config = config.transformer(source.vocab_size())?;
    let mut device = Device::flex().autodiff();
    if policy.is_selective() {
        device = device.gradient_checkpointing();
    }
    let model = model_config.init(config.run.seed, &device);
    let rows = (config.run.global_batch / config.run.micro_batches) as u64;
    let (inputs, targets) = make_batch(&*source, 0..rows, config.data.seq_len, &device);
    let ctx = ForwardContext {
        checkpointing: policy.block_recompute().map(|r| r.hook()),
        ..ForwardContext::default()
    };
    let before = heap::live_bytes();
    let loss = next_token_loss(model.forward_with(inputs, &ctx), targets);
    let kept = heap::live_bytes().saturating_sub(before);
    drop(loss.backward());
    Ok(kept)
}
