//! `flashover bench train`: tokens/s of the reference model under Flashover's DDP at dp=1 and
//! dp=2 (one thread per rank), next to a plain Burn training loop on the same model, data and
//! optimizer. Variants are interleaved and repeated; medians are reported, because ratios
//! measured side by side are what survives a noisy machine.

use super::median;
use burn::optim::{AdamWConfig, GradientsParams};
use flashover::train::{
    StepRecord, TrainConfig, axis_bucket_name, make_batch, token_source, train,
};
use flashover_data::{BatchPlan, TokenSource};
use flashover_models::next_token_loss;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Instant;

/// One variant's result.
#[derive(Debug, Clone, Serialize)]
pub struct TrainBenchRecord {
    /// `plain_burn`, `flashover_dp1`, `flashover_dp2`, ...
    pub variant: String,
    /// Median over repeats of tokens per second (steps after the first).
    pub tokens_per_s: f64,
    /// Median milliseconds per step.
    pub step_ms: f64,
    /// Every repeat's tokens per second.
    pub samples: Vec<f64>,
    /// Parameter bytes rank 0 held (0 for the plain loop: the whole model).
    pub param_bytes: usize,
    /// Per mesh axis with collectives (`tp`, `fsdp`, `world`, ...), milliseconds per step and
    /// rank of communication the computing thread did not hide, in the last repeat (empty for
    /// the plain loop).
    pub exposed_ms: BTreeMap<String, f64>,
    /// The same for communication hidden behind compute.
    pub overlapped_ms: BTreeMap<String, f64>,
}

/// Exposed and overlapped milliseconds per step and rank, per axis, over `steps`.
fn comm_by_axis(steps: &[StepRecord]) -> (BTreeMap<String, f64>, BTreeMap<String, f64>) {
    let (mut exposed, mut overlapped) = (BTreeMap::new(), BTreeMap::new());
    let samples = steps.iter().map(|s| s.ranks.len()).sum::<usize>().max(1) as f64;
    for rank in steps.iter().flat_map(|s| &s.ranks) {
        for (i, axis) in rank.axes.iter().enumerate().filter(|(_, a)| a.calls > 0) {
            let name = axis_bucket_name(i).to_string();
            *exposed.entry(name.clone()).or_insert(0.0) += axis.exposed_s * 1e3 / samples;
            *overlapped.entry(name).or_insert(0.0) += axis.overlapped_s * 1e3 / samples;
        }
    }
    (exposed, overlapped)
}

/// Seconds per step (after the first) of a plain Burn loop: forward, backward, AdamW step.
pub fn plain_burn_step_s(config: &TrainConfig) -> Result<f64, String> {
    let source = token_source(config)?;
    let model_config = config.transformer(source.vocab_size())?;
    let device = config
        .run
        .device
        .device(0)
        .map_err(|e| e.to_string())?
        .autodiff();
    let mut model = model_config.init(config.run.seed, &device);
    let mut optim = AdamWConfig::new()
        .with_weight_decay(config.optim.weight_decay as f32)
        .init();
    let plan = BatchPlan::new(config.run.global_batch, 1, 0, 1).map_err(|e| e.to_string())?;
    let mut start = Instant::now();
    for step in 0..config.run.steps {
        if step == 1 {
            start = Instant::now();
        }
        let (inputs, targets) = make_batch(
            source.as_ref() as &dyn TokenSource,
            plan.indices(step as u64, 0),
            config.data.seq_len,
            &device,
        );
        let loss = next_token_loss(model.forward(inputs), targets);
        let _ = loss.clone().into_scalar::<f32>();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(config.lr_at(step), model, grads);
    }
    Ok(start.elapsed().as_secs_f64() / (config.run.steps - 1).max(1) as f64)
}

/// Runs every variant `repeats` times, interleaved: plain Burn, DDP at each of `dps`, each
/// ZeRO stage of `zero_stages` at the largest of `dps` (stages 1-2 over `dp`, 3 over `fsdp`),
/// and tensor parallelism at each of `tps`.
/// `base` sets model, data, batch and steps; its mesh is replaced per variant. Clipping is off in
/// every variant (plain Burn has no global norm clipping to compare with).
pub fn run(
    base: &TrainConfig,
    dps: &[usize],
    zero_stages: &[u8],
    tps: &[usize],
    repeats: usize,
) -> Result<Vec<TrainBenchRecord>, String> {
    let mut base = base.clone();
    base.optim.clip = None;
    base.run.log_jsonl = None;
    let tokens_per_step = (base.run.global_batch * base.data.seq_len) as f64;
    let world = dps.iter().copied().max().unwrap_or(1);
    let mut variants: Vec<(String, String, u8)> = dps
        .iter()
        .map(|dp| (format!("flashover_dp{dp}"), format!("dp={dp}"), 0))
        .collect();
    for &zero in zero_stages {
        let axis = if zero == 3 { "fsdp" } else { "dp" };
        variants.push((
            format!("zero{zero}_{axis}{world}"),
            format!("{axis}={world}"),
            zero,
        ));
    }
    for &tp in tps {
        variants.push((format!("tp{tp}"), format!("tp={tp}"), 0));
    }
    let mut param_bytes = vec![0; variants.len() + 1];
    let mut comm = vec![(BTreeMap::new(), BTreeMap::new()); variants.len() + 1];
    let mut samples: Vec<(String, Vec<f64>)> = vec![("plain_burn".into(), vec![])];
    samples.extend(variants.iter().map(|(name, ..)| (name.clone(), vec![])));
    for _ in 0..repeats.max(1) {
        samples[0]
            .1
            .push(tokens_per_step / plain_burn_step_s(&base)?);
        for (i, (_, mesh, zero)) in variants.iter().enumerate() {
            let mut c = base.clone();
            c.parallel.mesh = mesh.clone();
            c.parallel.zero = *zero;
            let report = train(&c, &|_| {})?;
            param_bytes[i + 1] = report.memory.first().map_or(0, |m| m.params);
            let timed = &report.steps[1..];
            comm[i + 1] = comm_by_axis(timed);
            let step_s =
                timed.iter().map(|s| s.step_time_s).sum::<f64>() / timed.len().max(1) as f64;
            samples[i + 1].1.push(tokens_per_step / step_s);
        }
    }
    Ok(samples
        .into_iter()
        .zip(param_bytes)
        .zip(comm)
        .map(
            |(((variant, s), param_bytes), (exposed_ms, overlapped_ms))| {
                let tps = median(s.clone());
                TrainBenchRecord {
                    variant,
                    tokens_per_s: tps,
                    step_ms: tokens_per_step / tps * 1e3,
                    samples: s,
                    param_bytes,
                    exposed_ms,
                    overlapped_ms,
                }
            },
        )
        .collect())
}
