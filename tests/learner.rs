//! burn-train's `Learner` under `flashover::learner::ParallelLearning`: global-norm clipping
//! and early stopping as one device has them (pipelined plans too, where another rank than 0
//! reports and decides), checkpoints resumed onto a pipeline, and the layouts and set-ups it
//! refuses, each with its reason. (`examples/learner_parallel.rs` checks weights, validation
//! metrics and resumed checkpoints against one device's `Learner`.)

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::AdamWConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_train::TrainingStrategy;
use burn_train::metric::LossMetric;
use burn_train::metric::store::EventStoreClient;
use burn_train::{
    ClassificationOutput, EarlyStoppingStrategy, InferenceStep, Learner, SupervisedTraining,
    TrainOutput, TrainStep,
};
use flashover::learner::{ParallelLearning, PipelineLearnerModel, ShareBatcher};
use flashover::nn::{Linear, LinearConfig};
use flashover::parallel::params::{flatten_params, load_flat};
use flashover::prelude::*;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

const FEATURES: usize = 6;
const CLASSES: usize = 3;

#[derive(Module, Debug)]
struct Net {
    input: Linear,
    blocks: Vec<Linear>,
    head: Linear,
}

impl Net {
    fn new(device: &Device) -> Self {
        Net {
            input: LinearConfig::new(FEATURES, 8).init(device),
            blocks: (0..2)
                .map(|_| LinearConfig::new(8, 8).init(device))
                .collect(),
            head: LinearConfig::new(8, CLASSES).init(device),
        }
    }

    fn classify(&self, batch: Rows) -> ClassificationOutput {
        let mut h = self.embed(&batch);
        for i in 0..self.blocks.len() {
            h = self.layer(i, h);
        }
        self.train_head(h, &batch)
    }
}

impl PipelineModel<2> for Net {
    type Batch = Rows;
    fn embed(&self, batch: &Rows) -> Tensor<2> {
        self.input.forward(batch.x.clone()).tanh()
    }
    fn layer(&self, index: usize, x: Tensor<2>) -> Tensor<2> {
        self.blocks[index].forward(x).tanh()
    }
    fn head_loss(&self, x: Tensor<2>, batch: &Rows) -> Tensor<1> {
        self.train_head(x, batch).loss
    }
}

impl PipelineLearnerModel<2> for Net {
    fn samples(batch: &Rows) -> usize {
        batch.y.dims()[0]
    }
    fn micro_batch(batch: &Rows, samples: Range<usize>) -> Rows {
        Rows {
            x: batch.x.clone().narrow(0, samples.start, samples.len()),
            y: batch.y.clone().narrow(0, samples.start, samples.len()),
        }
    }
    fn train_head(&self, x: Tensor<2>, batch: &Rows) -> ClassificationOutput {
        let logits = self.head.forward(x);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.y.clone());
        ClassificationOutput::new(loss, logits, batch.y.clone())
    }
    fn inference_head(&self, x: Tensor<2>, batch: &Rows) -> ClassificationOutput {
        self.train_head(x, batch)
    }
}

impl TrainStep for Net {
    type Input = Rows;
    type Output = ClassificationOutput;
    fn step(&self, batch: Rows) -> TrainOutput<ClassificationOutput> {
        let item = self.classify(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Net {
    type Input = Rows;
    type Output = ClassificationOutput;
    fn step(&self, batch: Rows) -> ClassificationOutput {
        self.classify(batch)
    }
}

#[derive(Clone, Debug)]
struct Rows {
    x: Tensor<2>,
    y: Tensor<1, Int>,
}

#[derive(Clone)]
struct RowBatcher;

impl Batcher<usize, Rows> for RowBatcher {
    fn batch(&self, items: Vec<usize>, device: &Device) -> Rows {
        let n = items.len();
        let x: Vec<f32> = items
            .iter()
            .flat_map(|&s| (0..FEATURES).map(move |f| ((s * 5 + f * 3) as f32 * 0.7).cos() * 4.0))
            .collect();
        let y: Vec<i64> = items.iter().map(|&s| (s % CLASSES) as i64).collect();
        Rows {
            x: Tensor::from_data(TensorData::new(x, [n, FEATURES]), device),
            y: Tensor::from_data(TensorData::new(y, [n]), device),
        }
    }
}

fn loader<B>(batcher: B, batch: usize) -> Arc<dyn DataLoader<Rows>>
where
    B: Batcher<usize, Rows> + Clone + 'static,
{
    DataLoaderBuilder::new(batcher)
        .batch_size(batch)
        .build(InMemDataset::new((0..24).collect::<Vec<usize>>()))
}

fn dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("flashover-learner-test-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Stops after `epoch` (decided on rank 0, whose event store holds the metrics).
#[derive(Clone)]
struct StopAfter(usize);

impl EarlyStoppingStrategy for StopAfter {
    fn should_stop(&mut self, epoch: usize, _store: &EventStoreClient) -> bool {
        epoch >= self.0
    }
}

/// How a run is set up.
struct Run<'a> {
    mesh: &'a str,
    plan: ParallelizePlan,
    batch: usize,
    clip: Option<f32>,
    epochs: usize,
    stop_after: Option<usize>,
    burn_checkpointer: bool,
    resume_epoch: Option<usize>,
    unsharded_loader: bool,
    /// Train through `ParallelLearning::pipelined` rather than `new`.
    pipelined: bool,
    save_to: Option<PathBuf>,
    resume_from: Option<PathBuf>,
}

impl Default for Run<'_> {
    fn default() -> Self {
        Run {
            mesh: "dp=1",
            plan: ParallelizePlan::new(),
            batch: 8,
            clip: None,
            epochs: 2,
            stop_after: None,
            burn_checkpointer: false,
            resume_epoch: None,
            unsharded_loader: false,
            pipelined: false,
            save_to: None,
            resume_from: None,
        }
    }
}

/// Rank 0's final weights, or the first rank's error.
fn train(run: Run, initial: &[f32], name: &str) -> Result<Vec<f32>, String> {
    let out = launch(run.mesh, |ctx| {
        let device = ctx.device().clone().autodiff();
        let (net, par) = parallelize(load_flat(Net::new(&device), initial), &run.plan, &ctx)?;
        let batcher = ShareBatcher::new(RowBatcher, &par);
        let (train_loader, valid_loader) = match run.unsharded_loader {
            // Every rank batching the whole batch: refused, not silently repeated.
            true => (loader(RowBatcher, run.batch), loader(batcher, run.batch)),
            false => (
                loader(batcher.clone(), run.batch),
                loader(batcher, run.batch),
            ),
        };
        let strategy: TrainingStrategy<Net> = match run.pipelined {
            true => configured(ParallelLearning::pipelined::<2>(&ctx, par)?, &run).into(),
            false => configured(ParallelLearning::new(&ctx, par)?, &run).into(),
        };
        let mut training = SupervisedTraining::new(dir(name), train_loader, valid_loader)
            .metric_valid_numeric(LossMetric::new())
            .num_epochs(run.epochs)
            .with_application_logger(None)
            .with_training_strategy(strategy);
        if let Some(epoch) = run.stop_after {
            training = training.early_stopping(StopAfter(epoch));
        }
        if let Some(epoch) = run.resume_epoch {
            training = training.checkpoint(epoch);
        }
        if run.burn_checkpointer {
            training = training.with_default_checkpointers();
        }
        let result = training.launch(Learner::new(net, AdamWConfig::new().init(), 2e-2));
        match result.error {
            Some(e) => Err(ParallelError::Invalid(e.to_string())),
            None => Ok(flatten_params(&result.model)),
        }
    });
    match out {
        Ok(weights) => Ok(weights.into_iter().next().unwrap()),
        Err(e) => Err(e.to_string()),
    }
}

/// `strategy` with the run's clipping and checkpoints.
fn configured<S>(mut strategy: ParallelLearning<S>, run: &Run) -> ParallelLearning<S> {
    if let Some(clip) = run.clip {
        strategy = strategy.clip_grad_norm(clip);
    }
    if let Some(to) = &run.save_to {
        strategy = strategy.checkpoints(to, 4);
    }
    if let Some(from) = &run.resume_from {
        strategy = strategy.resume_from(from);
    }
    strategy
}

fn initial() -> Vec<f32> {
    flatten_params(&Net::new(&Device::flex()))
}

fn max_scaled(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(1e-12_f32, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

/// Two stages of one block each; `micro_batches` per rank's share.
fn pipeline(schedule: ScheduleKind, micro_batches: usize) -> ParallelizePlan {
    ParallelizePlan::new().pipeline(
        PipelineRule::new("blocks", schedule, micro_batches)
            .first(&["input"])
            .last(&["head"]),
    )
}

fn tp_fsdp() -> ParallelizePlan {
    ParallelizePlan::new()
        .tensor_parallel(TensorParallelRule::colwise(&["input"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["blocks.0"]))
        .fully_shard("")
}

#[test]
fn gradients_are_clipped_by_the_whole_models_norm_in_every_layout() {
    let initial = initial();
    let clipped = |mesh, plan| {
        let run = Run {
            mesh,
            plan,
            clip: Some(0.05),
            ..Run::default()
        };
        train(run, &initial, &format!("clip-{mesh}")).unwrap()
    };
    let one = clipped("dp=1", ParallelizePlan::new());
    let split = clipped("fsdp=2,tp=2", tp_fsdp());
    let unclipped = train(Run::default(), &initial, "unclipped").unwrap();
    // The clipping is active: it changes the weights.
    assert!(max_scaled(&one, &unclipped) > 1e-3);
    let diff = max_scaled(&one, &split);
    assert!(diff < 1e-5, "fsdp=2,tp=2 clipped {diff:.2e} from one rank");
    // Stages hold different parameters: the norm is summed over them.
    let run = Run {
        mesh: "dp=2,pp=2",
        plan: pipeline(ScheduleKind::OneFOneB, 2),
        pipelined: true,
        clip: Some(0.05),
        ..Run::default()
    };
    let staged = train(run, &initial, "clip-dp2-pp2").unwrap();
    let diff = max_scaled(&one, &staged);
    assert!(diff < 1e-5, "dp=2,pp=2 clipped {diff:.2e} from one rank");
}

#[test]
fn early_stopping_is_decided_once_for_every_rank() {
    let initial = initial();
    let run = |mesh, plan, stop_after, epochs| Run {
        mesh,
        plan,
        stop_after,
        epochs,
        ..Run::default()
    };
    let stopped = train(run("fsdp=2,tp=2", tp_fsdp(), Some(1), 3), &initial, "stop").unwrap();
    let one_epoch = train(
        run("dp=1", ParallelizePlan::new(), None, 1),
        &initial,
        "one",
    )
    .unwrap();
    let diff = max_scaled(&one_epoch, &stopped);
    assert!(
        diff < 1e-5,
        "stopped after one epoch: {diff:.2e} from one epoch"
    );
    // Under a pipeline the last stage's first rank (rank 1 of pp=2) reports and decides.
    let staged = Run {
        pipelined: true,
        ..run("pp=2", pipeline(ScheduleKind::GPipe, 4), Some(1), 3)
    };
    let stopped = train(staged, &initial, "stop-pp2").unwrap();
    let diff = max_scaled(&one_epoch, &stopped);
    assert!(diff < 1e-5, "pp=2 stopped: {diff:.2e} from one epoch");
}

#[test]
fn checkpoints_of_fsdp_tp_resume_onto_a_pipeline() {
    let initial = initial();
    let saved = dir("checkpoints-fsdp2-tp2");
    let run = Run {
        mesh: "fsdp=2,tp=2",
        plan: tp_fsdp(),
        epochs: 3,
        save_to: Some(saved.clone()),
        ..Run::default()
    };
    let uninterrupted = train(run, &initial, "save").unwrap();
    let resumed = Run {
        mesh: "dp=2,pp=2",
        plan: pipeline(ScheduleKind::OneFOneB, 2),
        pipelined: true,
        epochs: 3,
        resume_epoch: Some(1),
        resume_from: Some(saved),
        ..Run::default()
    };
    let resumed = train(resumed, &initial, "resume-dp2-pp2").unwrap();
    let diff = max_scaled(&uninterrupted, &resumed);
    assert!(
        diff < 1e-5,
        "resumed at dp=2,pp=2: {diff:.2e} from uninterrupted"
    );
    // Resuming from nothing is not an uninterrupted run: the check can fail.
    assert!(max_scaled(&uninterrupted, &initial) > 1e-3);
}

#[test]
fn what_the_strategy_cannot_run_is_refused_with_the_reason() {
    let initial = initial();
    let pipelined = ParallelizePlan::new().pipeline(
        PipelineRule::new("blocks", ScheduleKind::GPipe, 2)
            .first(&["input"])
            .last(&["head"]),
    );
    let cases = [
        (
            Run {
                mesh: "dp=4",
                batch: 6,
                ..Run::default()
            },
            "a batch of 6 samples does not split over 4 data-parallel ranks",
        ),
        (
            Run {
                mesh: "dp=2",
                burn_checkpointer: true,
                ..Run::default()
            },
            "burn-train's checkpointer",
        ),
        (
            Run {
                mesh: "pp=2",
                plan: pipelined.clone(),
                ..Run::default()
            },
            "implement flashover::learner::PipelineLearnerModel for the model and build the \
             strategy with ParallelLearning::pipelined",
        ),
        (
            Run {
                mesh: "dp=2",
                pipelined: true,
                ..Run::default()
            },
            "ParallelLearning::pipelined needs a plan with a pipeline rule",
        ),
        (
            Run {
                mesh: "dp=2,pp=2",
                plan: pipelined,
                pipelined: true,
                unsharded_loader: true,
                ..Run::default()
            },
            "gave this rank a batch of 8 samples, not its share of 4",
        ),
        (
            Run {
                mesh: "dp=2",
                unsharded_loader: true,
                ..Run::default()
            },
            "build the data loaders with flashover::learner::ShareBatcher",
        ),
        (
            Run {
                resume_epoch: Some(1),
                ..Run::default()
            },
            "SupervisedTraining::checkpoint(1) resumes from Flashover's checkpoints",
        ),
    ];
    for (i, (run, reason)) in cases.into_iter().enumerate() {
        let mesh = run.mesh.to_string();
        let err = train(run, &initial, &format!("refused-{i}")).unwrap_err();
        assert!(err.contains(reason), "{mesh}: {err}");
    }
}
