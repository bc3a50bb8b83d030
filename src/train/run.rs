//! The training job: one closure per rank under the launcher, data parallel over the `dp` axis.

use super::config::TrainConfig;
use super::report::{RankTimes, StepRecord, TrainReport};
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover_data::{BatchPlan, MarkovSource, TextSource, TokenSource};
use flashover_models::{Transformer, next_token_loss};
use flashover_parallel::FlatAdamWConfig;
use flashover_parallel::data_parallel::DataParallelConfig;
use flashover_parallel::params::{ParamLayout, flatten_params};
use flashover_parallel::zero::ZeroOptimizer;
use flashover_runtime::{Axis, CommunicatorExt, Launch, RankContext, RankError};
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The token source the configuration names.
pub fn token_source(config: &TrainConfig) -> Result<Arc<dyn TokenSource>, String> {
    let d = &config.data;
    Ok(match d.source.as_str() {
        "markov" => Arc::new(MarkovSource::new(d.vocab, d.branching, config.run.seed)),
        "text" => {
            let path = d
                .path
                .as_ref()
                .ok_or("data.path is required when data.source = \"text\"")?;
            Arc::new(
                TextSource::open(path, d.seq_len + 1, config.run.seed)
                    .map_err(|e| e.to_string())?,
            )
        }
        other => return Err(format!("data.source = `{other}`: expected markov or text")),
    })
}

/// Inputs and next-token targets for samples `indices`, each `seq_len + 1` tokens.
pub fn make_batch(
    source: &dyn TokenSource,
    indices: std::ops::Range<u64>,
    seq_len: usize,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let b = (indices.end - indices.start) as usize;
    let mut inputs = Vec::with_capacity(b * seq_len);
    let mut targets = Vec::with_capacity(b * seq_len);
    for i in indices {
        let s = source.sample(i, seq_len + 1);
        inputs.extend(s[..seq_len].iter().map(|&t| t as i64));
        targets.extend(s[1..].iter().map(|&t| t as i64));
    }
    (
        Tensor::from_data(TensorData::new(inputs, [b, seq_len]), device),
        Tensor::from_data(TensorData::new(targets, [b, seq_len]), device),
    )
}

/// Runs the job. `on_step` sees every step's record as it completes (rank 0's thread).
pub fn train(
    config: &TrainConfig,
    on_step: &(dyn Fn(&StepRecord) + Sync),
) -> Result<TrainReport, String> {
    let errors = config.validate();
    if !errors.is_empty() {
        return Err(format!("invalid configuration:\n  {}", errors.join("\n  ")));
    }
    let mesh = config.mesh()?;
    let source = token_source(config)?;
    let model_config = config.transformer(source.vocab_size())?;
    let device = config.run.device.device(0).map_err(|e| e.to_string())?;
    let log = match &config.run.log_jsonl {
        Some(path) => Some(
            std::fs::File::create(path)
                .map_err(|e| format!("run.log_jsonl {}: {e}", path.display()))?,
        ),
        None => None,
    };
    let log_error = std::sync::Mutex::new(None::<String>);
    let started = Instant::now();
    let outputs = Launch::new(&mesh)
        .map_err(|e| e.to_string())?
        .device(device)
        .timeout(Duration::from_secs_f64(config.parallel.timeout_s))
        .run(|ctx| {
            let emit = |record: &StepRecord| {
                on_step(record);
                if let Some(file) = log.as_ref() {
                    let mut file = file;
                    if let Err(e) = writeln!(
                        file,
                        "{}",
                        serde_json::to_string(record).expect("records serialise")
                    ) {
                        *log_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                    }
                }
            };
            train_rank(&ctx, config, &model_config, source.as_ref(), &emit)
        })
        .map_err(|e| e.to_string())?;
    if let Some(e) = log_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(format!("writing run.log_jsonl: {e}"));
    }
    let (steps, params, buckets, overlap) = outputs
        .into_iter()
        .next()
        .flatten()
        .expect("rank 0 reports");
    Ok(TrainReport {
        tokens: steps.len() * config.run.global_batch * config.data.seq_len,
        steps,
        params,
        loss_floor: source.loss_floor(),
        num_params: model_config.num_params(),
        mesh: mesh.to_spec(),
        buckets,
        overlap,
        wall_s: started.elapsed().as_secs_f64(),
    })
}

type RankOutput = Option<(Vec<StepRecord>, Vec<(String, Vec<f32>)>, usize, bool)>;

fn train_rank(
    ctx: &RankContext,
    config: &TrainConfig,
    model_config: &flashover_models::TransformerConfig,
    source: &dyn TokenSource,
    emit: &dyn Fn(&StepRecord),
) -> Result<RankOutput, RankError> {
    let device = ctx.device().clone().autodiff();
    let dp = ctx.group(Axis::Dp);
    let plan = BatchPlan::new(
        config.run.global_batch,
        dp.size(),
        dp.rank(),
        config.run.micro_batches,
    )?;
    let model: Transformer = model_config.init(config.run.seed, &device);
    let ddp_config = DataParallelConfig::new()
        .with_bucket_bytes((config.parallel.bucket_mb * (1 << 20) as f64) as usize)
        .with_overlap(config.parallel.overlap)
        .with_average(config.parallel.gradient_reduction == "mean");
    let (mut model, mut ddp) = ddp_config.init(model, dp)?;
    let adamw = FlatAdamWConfig::new().with_weight_decay(config.optim.weight_decay as f32);
    let mut optim = adamw.to_burn().init();
    // ZeRO-1: the same AdamW, its state sharded over the data-parallel group.
    let mut sharded = (config.parallel.zero == 1).then(|| ZeroOptimizer::new(&model, dp, &adamw));
    let clip = config.optim.clip.filter(|&c| c > 0.0);
    let tokens_per_step = (config.run.global_batch * config.data.seq_len) as f64;
    let mut records = vec![];
    let world = ctx.world();
    for step in 0..config.run.steps {
        let stats_before = ctx.comm_stats();
        let t0 = Instant::now();
        ddp.begin_step(plan.micro_batches());
        let mut loss_sum = 0.0f64;
        for micro in 0..plan.micro_batches() {
            let (inputs, targets) = make_batch(
                source,
                plan.indices(step as u64, micro),
                config.data.seq_len,
                &device,
            );
            let loss = next_token_loss(ddp.prepare(&model).forward(inputs), targets);
            loss_sum += loss.clone().into_scalar::<f32>() as f64;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            ddp.backward_done(&model, grads);
        }
        let lr = config.lr_at(step);
        let report = match sharded.as_mut() {
            Some(zero) => {
                let report = ddp.finish_flat(clip)?;
                model = zero.step(lr, model, ddp.flat_grads())?;
                report
            }
            None => {
                let reduced = ddp.finish(&model, clip)?;
                model = optim.step(lr, model, reduced.grads);
                reduced.report
            }
        };
        let step_s = t0.elapsed().as_secs_f64();
        let idle = ctx
            .comm_stats()
            .since(&stats_before)
            .total()
            .wait
            .as_secs_f64();
        let exposed = report.exposed.as_secs_f64();
        let mine = [
            loss_sum / plan.micro_batches() as f64,
            step_s,
            report.comm.as_secs_f64(),
            report.overlapped.as_secs_f64(),
            exposed,
            idle,
            report.grad_norm as f64,
        ];
        let all = world.all_gather_vec(&mine)?;
        if ctx.rank() == 0 {
            let per: Vec<&[f64]> = all.chunks(mine.len()).collect();
            let step_time = per.iter().map(|p| p[1]).fold(0.0, f64::max);
            let record = StepRecord {
                step,
                loss: per.iter().map(|p| p[0]).sum::<f64>() / per.len() as f64,
                lr,
                grad_norm: per[0][6],
                tokens_per_s: tokens_per_step / step_time,
                step_time_s: step_time,
                ranks: per
                    .iter()
                    .enumerate()
                    .map(|(rank, p)| RankTimes {
                        rank,
                        step_s: p[1],
                        compute_s: (p[1] - p[4]).max(0.0),
                        comm_s: p[2],
                        overlapped_s: p[3],
                        exposed_comm_s: p[4],
                        idle_s: p[5],
                    })
                    .collect(),
            };
            emit(&record);
            records.push(record);
        }
    }
    if ctx.rank() != 0 {
        return Ok(None);
    }
    let layout = ParamLayout::of(&model);
    let flat = flatten_params(&model.valid());
    let params = layout
        .slots
        .iter()
        .map(|s| (s.name.clone(), flat[s.offset..s.offset + s.numel].to_vec()))
        .collect();
    Ok(Some((records, params, ddp.num_buckets(), ddp.overlaps())))
}
