//! burn-train's `Learner` under `flashover::learner::ParallelLearning`: global-norm clipping
//! and early stopping as one device has them (pipelined plans too, where another rank than 0
//! reports and decides), checkpoints resumed onto a pipeline, a language model with a mixture
//! of experts whose sequences are split over `cp` and experts over `ep`, with and without
//! pipeline stages (weights and validation losses against one device's `Learner`), and the
//! layouts and set-ups it refuses, each with its reason. (`examples/learner_parallel.rs`
//! checks weights, validation metrics and resumed checkpoints against one device's `Learner`.)

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig};
use burn::optim::{AdamWConfig, SgdConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_train::metric::LossMetric;
use burn_train::metric::store::EventStoreClient;
use burn_train::{
    ClassificationOutput, EarlyStoppingStrategy, InferenceStep, Learner, SequenceOutput,
    SupervisedTraining, TrainOutput, TrainStep, TrainingStrategy,
};
use flashover::check::relative_difference;
use flashover::learner::{
    GatherOutput, ParallelLearning, PipelineLearnerModel, RankSteps, SequenceBatch, ShareBatcher,
};
use flashover::models::{Moe, MoeConfig};
use flashover::nn::{CausalAttention, Linear, LinearConfig, MoeForward};
use flashover::parallel::params::{flatten_params, load_flat};
use flashover::prelude::*;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

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
            blocks: (0..4)
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

impl PipelineModel for Net {
    type Activation = Tensor<2>;
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

impl PipelineLearnerModel for Net {
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
    /// Data loaders with two worker threads.
    workers: bool,
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
            workers: false,
            pipelined: false,
            save_to: None,
            resume_from: None,
        }
    }
}

/// Rank 0's final weights, or the first rank's error.
fn train(run: Run, initial: &[f32], name: &str) -> Result<Vec<f32>, String> {
    // Emptied once, before any rank writes there (the reporting one does).
    let directory = dir(name);
    // A minute for any collective: these runs take well under a second.
    let launcher = Launch::new(run.mesh)
        .unwrap()
        .timeout(Duration::from_secs(60));
    let out = launcher.run(|ctx| {
        let device = ctx.device().clone().autodiff();
        let (net, par) = parallelize(load_flat(Net::new(&device), initial), &run.plan, &ctx)?;
        let batcher = ShareBatcher::new(RowBatcher, &par);
        let (train_loader, valid_loader) = match (run.unsharded_loader, run.workers) {
            // Every rank batching the whole batch: refused, not silently repeated.
            (true, _) => (loader(RowBatcher, run.batch), loader(batcher, run.batch)),
            // Batches in the order worker threads finish them: refused, not mixed up.
            (_, true) => {
                let with_workers = || {
                    DataLoaderBuilder::new(batcher.clone())
                        .batch_size(run.batch)
                        .num_workers(2)
                        .build(InMemDataset::new((0..24).collect::<Vec<usize>>()))
                };
                (with_workers(), with_workers())
            }
            (false, false) => (
                loader(batcher.clone(), run.batch),
                loader(batcher, run.batch),
            ),
        };
        let strategy: TrainingStrategy<Net> = match run.pipelined {
            true => configured(ParallelLearning::pipelined(&ctx, par)?, &run).into(),
            false => configured(ParallelLearning::new(&ctx, par)?, &run).into(),
        };
        let mut training = SupervisedTraining::new(&directory, train_loader, valid_loader)
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
    seeded(&Net::new(&Device::flex()))
}

/// `model`'s parameters as the same well-spread values (a hash of the index) in every run and
/// every test thread: Burn's initialisers draw from one generator all threads share, and how
/// close AdamW keeps two layouts depends on the start (elements with tiny gradients take
/// steps of their rounding).
fn seeded<M: Module>(model: &M) -> Vec<f32> {
    let n = flatten_params(model).len();
    (0..n)
        .map(|i| (((i as f32 * 12.9898).sin() * 43758.547).fract() - 0.5) * 0.6)
        .collect()
}

/// Two stages of two blocks each; `micro_batches` per rank's share.
fn pipeline(schedule: ScheduleKind, micro_batches: usize) -> ParallelizePlan {
    ParallelizePlan::new().pipeline(
        PipelineRule::new("blocks", schedule, micro_batches)
            .first(&["input"])
            .last(&["head"]),
    )
}

/// Megatron's pairs, each inside one pipeline stage of [`pipeline`]: blocks 0 and 2 split by
/// columns, 1 and 3 back by rows; every weight sharded over fsdp too.
fn tp_fsdp() -> ParallelizePlan {
    ParallelizePlan::new()
        .tensor_parallel(TensorParallelRule::colwise(&["blocks.0", "blocks.2"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["blocks.1", "blocks.3"]))
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
    let active = relative_difference(&one, &unclipped);
    assert!(active > 1e-3 && active.is_finite(), "{active}");
    let diff = relative_difference(&one, &split);
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
    let diff = relative_difference(&one, &staged);
    assert!(diff < 1e-5, "dp=2,pp=2 clipped {diff:.2e} from one rank");
    // Each block's forward run again in backward: the same gradients.
    let run = Run {
        mesh: "dp=2,pp=2",
        plan: pipeline(ScheduleKind::OneFOneB, 2).activation_checkpointing(CheckpointPolicy::Full),
        pipelined: true,
        clip: Some(0.05),
        ..Run::default()
    };
    let recomputed = train(run, &initial, "clip-dp2-pp2-recompute").unwrap();
    let diff = relative_difference(&one, &recomputed);
    assert!(
        diff < 1e-5,
        "dp=2,pp=2 recomputed, clipped {diff:.2e} from one rank"
    );
    // Three axes: each stage's layers split over tp and sharded over fsdp.
    let mut plan = tp_fsdp();
    plan.pipeline = pipeline(ScheduleKind::OneFOneB, 2).pipeline;
    let run = Run {
        mesh: "pp=2,fsdp=2,tp=2",
        plan,
        pipelined: true,
        clip: Some(0.05),
        ..Run::default()
    };
    let composed = train(run, &initial, "clip-pp2-fsdp2-tp2").unwrap();
    let diff = relative_difference(&one, &composed);
    assert!(
        diff < 1e-5,
        "pp=2,fsdp=2,tp=2 clipped {diff:.2e} from one rank"
    );
    // Two stages per rank (one block each): validation's forward passes the activation
    // from rank 0 to 1 and back.
    let interleaved = ParallelizePlan::new().pipeline(
        PipelineRule::new("blocks", ScheduleKind::Interleaved1F1B, 2)
            .chunks(2)
            .first(&["input"])
            .last(&["head"]),
    );
    let run = Run {
        mesh: "pp=2",
        plan: interleaved,
        pipelined: true,
        clip: Some(0.05),
        ..Run::default()
    };
    let staged = train(run, &initial, "clip-pp2-interleaved").unwrap();
    let diff = relative_difference(&one, &staged);
    assert!(
        diff < 1e-5,
        "pp=2 interleaved clipped {diff:.2e} from one rank"
    );
    let logs = |name: &str| -> Vec<f32> {
        let dir = std::env::temp_dir().join(format!("flashover-learner-test-{name}"));
        (1..=2).flat_map(|e| logged_losses(&dir, e)).collect()
    };
    let (one_losses, staged_losses) = (logs("clip-dp=1"), logs("clip-pp2-interleaved"));
    assert_eq!(one_losses.len(), staged_losses.len());
    let diff = relative_difference(&one_losses, &staged_losses);
    assert!(
        diff < 1e-5,
        "pp=2 interleaved validation losses {diff:.2e} from one rank"
    );
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
    let diff = relative_difference(&one_epoch, &stopped);
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
    let diff = relative_difference(&one_epoch, &stopped);
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
    let diff = relative_difference(&uninterrupted, &resumed);
    assert!(
        diff < 1e-5,
        "resumed at dp=2,pp=2: {diff:.2e} from uninterrupted"
    );
    // Resuming from nothing is not an uninterrupted run: the check can fail.
    let moved = relative_difference(&uninterrupted, &initial);
    assert!(moved > 1e-3 && moved.is_finite(), "{moved}");
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
                plan: pipelined.clone(),
                pipelined: true,
                unsharded_loader: true,
                ..Run::default()
            },
            "not made by a ShareBatcher on the rank's own thread",
        ),
        (
            Run {
                mesh: "dp=2",
                workers: true,
                ..Run::default()
            },
            "without num_workers",
        ),
        (
            // The input split by columns, gathered back by the first block: what stage 0
            // returns is wider than what `embed` gives it.
            Run {
                mesh: "pp=2,tp=2",
                plan: ParallelizePlan {
                    pipeline: pipelined.pipeline.clone(),
                    ..ParallelizePlan::new()
                        .tensor_parallel(TensorParallelRule::colwise(&["input"]))
                        .tensor_parallel(TensorParallelRule::rowwise(&["blocks.0"]))
                },
                pipelined: true,
                ..Run::default()
            },
            "every stage must return the shapes and dtypes it is given",
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
        (
            // A TrainStep takes its gradients of the model it is handed: none on a cast view.
            Run {
                mesh: "dp=2",
                plan: ParallelizePlan::new().mixed_precision(MixedPrecision::new(Precision::BF16)),
                ..Run::default()
            },
            "train the plan in a loop of your own",
        ),
        (
            Run {
                mesh: "dp=2,pp=2",
                plan: pipelined
                    .clone()
                    .mixed_precision(MixedPrecision::new(Precision::F16)),
                pipelined: true,
                ..Run::default()
            },
            "a Learner's TrainStep does not: compute in bf16",
        ),
    ];
    for (i, (run, reason)) in cases.into_iter().enumerate() {
        let mesh = run.mesh.to_string();
        let err = train(run, &initial, &format!("refused-{i}")).unwrap_err();
        assert!(err.contains(reason), "{mesh}: {err}");
    }
}

// ---- Context and expert parallelism: a small causal language model with a mixture of
// experts, its sequences split over `cp`, its experts spread over `ep`. ----

const VOCAB: usize = 11;
const SEQ: usize = 8;
const WIDTH: usize = 8;
const HEADS: usize = 2;

/// Token and position embeddings, two blocks (causal self-attention and a mixture of experts
/// of 4, top 2, each with a residual), a head.
#[derive(Module, Debug)]
struct Lm {
    tokens: Embedding,
    positions: Embedding,
    blocks: Vec<LmBlock>,
    head: Linear,
}

#[derive(Module, Debug)]
struct LmBlock {
    query: Linear,
    key: Linear,
    value: Linear,
    core: CausalAttention,
    moe: Moe,
}

/// Token ids `[batch, seq]`, their positions `[seq]` (a cp rank holds some of them), the next
/// tokens `[batch, seq]`.
#[derive(Clone, Debug)]
struct TextBatch {
    tokens: Tensor<2, Int>,
    positions: Tensor<1, Int>,
    targets: Tensor<2, Int>,
}

impl SequenceBatch for TextBatch {
    fn sequence_share(self, par: &Parallelized) -> Result<Self, ParallelError> {
        Ok(TextBatch {
            tokens: par.sequences().share(self.tokens, 1)?,
            positions: par.sequences().share(self.positions, 0)?,
            targets: par.sequences().share(self.targets, 1)?,
        })
    }
}

impl Lm {
    fn new(device: &Device) -> Self {
        let linear = |d_out| LinearConfig::new(WIDTH, d_out).init(device);
        let block = || LmBlock {
            query: linear(WIDTH),
            key: linear(WIDTH),
            value: linear(WIDTH),
            core: CausalAttention::new(device),
            moe: MoeConfig::new(4, 2, 6).init(WIDTH, device),
        };
        Lm {
            tokens: EmbeddingConfig::new(VOCAB, WIDTH).init(device),
            positions: EmbeddingConfig::new(SEQ, WIDTH).init(device),
            blocks: vec![block(), block()],
            head: linear(VOCAB),
        }
    }

    /// The output (its loss the next-token loss) and the experts' load-balancing losses: the
    /// objective is their sum.
    fn predict(&self, batch: &TextBatch) -> (SequenceOutput, Tensor<1>) {
        let mut x = self.embed(batch);
        let mut aux = vec![];
        for i in 0..self.blocks.len() {
            let (y, more) = self.layer_with_aux(i, x);
            x = y;
            aux.extend(more);
        }
        let aux = aux
            .into_iter()
            .reduce(|a, b| a + b)
            .expect("two MoE layers");
        (self.train_head(x, batch), aux)
    }
}

impl LmBlock {
    fn forward(&self, x: Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>) {
        let [b, s, _] = x.dims();
        let heads = |t: Tensor<3>| t.reshape([b, s, HEADS, WIDTH / HEADS]).swap_dims(1, 2);
        let (q, k, v) = (
            heads(self.query.forward(x.clone())),
            heads(self.key.forward(x.clone())),
            heads(self.value.forward(x.clone())),
        );
        let attended = self
            .core
            .forward(q, k, v)
            .swap_dims(1, 2)
            .reshape([b, s, WIDTH]);
        let x = x + attended;
        let (experts, aux) = MoeForward::forward(&self.moe, x.clone());
        (x + experts, aux)
    }
}

impl TrainStep for Lm {
    type Input = TextBatch;
    type Output = SequenceOutput;
    fn step(&self, batch: TextBatch) -> TrainOutput<SequenceOutput> {
        let (item, aux) = self.predict(&batch);
        TrainOutput::new(self, (item.loss.clone() + aux).backward(), item)
    }
}

impl InferenceStep for Lm {
    type Input = TextBatch;
    type Output = SequenceOutput;
    fn step(&self, batch: TextBatch) -> SequenceOutput {
        self.predict(&batch).0
    }
}

impl PipelineModel for Lm {
    type Activation = Tensor<3>;
    type Batch = TextBatch;
    fn embed(&self, batch: &TextBatch) -> Tensor<3> {
        self.tokens.forward(batch.tokens.clone())
            + self
                .positions
                .forward(batch.positions.clone().unsqueeze::<2>())
    }
    fn layer(&self, index: usize, x: Tensor<3>) -> Tensor<3> {
        self.layer_with_aux(index, x).0
    }
    fn layer_with_aux(&self, index: usize, x: Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>) {
        self.blocks[index].forward(x)
    }
    fn head_loss(&self, x: Tensor<3>, batch: &TextBatch) -> Tensor<1> {
        self.train_head(x, batch).loss
    }
}

impl PipelineLearnerModel for Lm {
    fn samples(batch: &TextBatch) -> usize {
        batch.tokens.dims()[0]
    }
    fn micro_batch(batch: &TextBatch, samples: Range<usize>) -> TextBatch {
        TextBatch {
            tokens: batch.tokens.clone().narrow(0, samples.start, samples.len()),
            positions: batch.positions.clone(),
            targets: batch
                .targets
                .clone()
                .narrow(0, samples.start, samples.len()),
        }
    }
    fn train_head(&self, x: Tensor<3>, batch: &TextBatch) -> SequenceOutput {
        let logits = self.head.forward(x);
        let [b, s, _] = logits.dims();
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(
                logits.clone().reshape([b * s, VOCAB]),
                batch.targets.clone().reshape([b * s]),
            );
        SequenceOutput {
            loss,
            logits,
            predictions: None,
            targets: batch.targets.clone(),
        }
    }
    fn inference_head(&self, x: Tensor<3>, batch: &TextBatch) -> SequenceOutput {
        self.train_head(x, batch)
    }
}

#[derive(Clone)]
struct TextBatcher;

impl Batcher<usize, TextBatch> for TextBatcher {
    fn batch(&self, items: Vec<usize>, device: &Device) -> TextBatch {
        let n = items.len();
        let token = |s: usize, t: usize| ((s * 5 + t * t * 3 + t) % VOCAB) as i64;
        let sequences = |shift: usize| -> Vec<i64> {
            items
                .iter()
                .flat_map(|&s| (0..SEQ).map(move |t| token(s, t + shift)))
                .collect()
        };
        let ids = |v: Vec<i64>| Tensor::from_data(TensorData::new(v, [n, SEQ]), device);
        TextBatch {
            tokens: ids(sequences(0)),
            positions: Tensor::arange(0..SEQ as i64, device),
            targets: ids(sequences(1)),
        }
    }
}

fn text_loader<B>(batcher: B) -> Arc<dyn DataLoader<TextBatch>>
where
    B: Batcher<usize, TextBatch> + Clone + 'static,
{
    DataLoaderBuilder::new(batcher)
        .batch_size(4)
        .build(InMemDataset::new((0..16).collect::<Vec<usize>>()))
}

/// Sequences split over `cp` (ring attention), experts spread over `ep`, on the meshes that
/// have those axes.
fn context_parallel() -> ParallelizePlan {
    ParallelizePlan::new()
        .context_parallel(ContextParallelRule::ring(&["blocks.*.core"]))
        .expert_parallel("blocks.*.moe")
}

/// [`context_parallel`] with one block per pipeline stage (1F1B, 2 micro-batches).
fn staged_context_parallel() -> ParallelizePlan {
    let stages = PipelineRule::new("blocks", ScheduleKind::OneFOneB, 2)
        .first(&["tokens", "positions"])
        .last(&["head"]);
    context_parallel().pipeline(stages)
}

/// The language model trained for two epochs on `mesh` under `plan` (its steps on split
/// sequences when `split`): rank 0's final weights and the validation losses burn-train
/// logged, or the first rank's error.
fn train_lm(
    mesh: &str,
    plan: &ParallelizePlan,
    split: bool,
    initial: &[f32],
) -> Result<(Vec<f32>, Vec<f32>), String> {
    let name = format!("lm-{}", mesh.replace([',', '='], "-"));
    let out = launch(mesh, |ctx| {
        let device = ctx.device().clone().autodiff();
        let (lm, par) = parallelize(load_flat(Lm::new(&device), initial), plan, &ctx)?;
        let batcher = ShareBatcher::new(TextBatcher, &par);
        // Pipelined plans run the stages; cp plans need the sequences split.
        let (strategy, reporter): (TrainingStrategy<Lm>, usize) =
            match (plan.pipeline.is_some(), split) {
                (false, false) => reported(ParallelLearning::new(&ctx, par)?),
                (false, true) => reported(ParallelLearning::new(&ctx, par)?.split_sequences()),
                (true, false) => reported(ParallelLearning::pipelined(&ctx, par)?),
                (true, true) => reported(ParallelLearning::pipelined(&ctx, par)?.split_sequences()),
            };
        let reports = ctx.rank() == reporter;
        let directory = dir(&format!("{name}-{}", ctx.rank()));
        let result = SupervisedTraining::new(
            &directory,
            text_loader(batcher.clone()),
            text_loader(batcher),
        )
        .metric_valid_numeric(LossMetric::new())
        .num_epochs(2)
        .with_application_logger(None)
        .with_training_strategy(strategy)
        // SGD: its update is proportional to the gradient, so a mis-scaled reduction over cp
        // shows (AdamW normalizes scale away, and amplifies the rounding of gradients that are
        // zero in exact arithmetic, such as the key bias's under softmax).
        .launch(Learner::new(lm, SgdConfig::new().init(), 2e-1));
        if let Some(e) = result.error {
            return Err(ParallelError::Invalid(e.to_string()));
        }
        let losses = match reports {
            true => (1..=2).flat_map(|e| logged_losses(&directory, e)).collect(),
            false => vec![],
        };
        Ok((flatten_params(&result.model), losses))
    });
    match out {
        // Rank 0's weights (every rank has the whole model), the reporting rank's losses.
        Ok(runs) => {
            let weights = runs[0].0.clone();
            let losses = runs.into_iter().map(|r| r.1).find(|l| !l.is_empty());
            Ok((weights, losses.unwrap_or_default()))
        }
        Err(e) => Err(e.to_string()),
    }
}

/// The strategy as burn-train takes it, and the rank that reports.
fn reported<S: RankSteps<Lm>>(strategy: ParallelLearning<S>) -> (TrainingStrategy<Lm>, usize) {
    let reporter = strategy.reporting_rank();
    (strategy.into(), reporter)
}

/// The validation losses burn-train logged in `epoch` under `dir`.
fn logged_losses(dir: &std::path::Path, epoch: usize) -> Vec<f32> {
    let file = dir.join(format!("valid/epoch-{epoch}/Loss.log"));
    std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .lines()
        .map(|line| line.split(',').next().unwrap().parse().unwrap())
        .collect()
}

#[test]
fn sequences_over_cp_and_experts_over_ep_train_as_one_device() {
    let initial = flatten_params(&Lm::new(&Device::flex()));
    let (one, one_losses) = train_lm("dp=1", &ParallelizePlan::new(), false, &initial).unwrap();
    // Four validation batches an epoch and the epoch's mean, two epochs.
    assert_eq!(one_losses.len(), 10);
    let layouts = [
        ("cp=2", context_parallel()),
        ("dp=2,cp=2", context_parallel()),
        ("ep=2", context_parallel()),
        ("ep=2,cp=2", context_parallel()),
        ("pp=2", staged_context_parallel()),
        ("pp=2,cp=2", staged_context_parallel()),
        ("pp=2,ep=2", staged_context_parallel()),
        ("fsdp=2,ep=2", context_parallel().fully_shard("")),
    ];
    for (mesh, plan) in layouts {
        let (weights, losses) = train_lm(mesh, &plan, true, &initial).unwrap();
        assert_eq!(
            losses.len(),
            one_losses.len(),
            "{mesh}: as many validation losses"
        );
        let diff = relative_difference(&one, &weights);
        assert!(diff < 1e-5, "{mesh}: weights {diff:.2e} from one device");
        let worst = relative_difference(&one_losses, &losses);
        assert!(
            worst < 1e-5,
            "{mesh}: validation loss {worst:.2e} from one device"
        );
        println!("{mesh}: weights {diff:.2e}, validation losses {worst:.2e} from one device");
    }
    // Whole sequences given to a step under a cp plan: refused, not attended twice.
    let err = train_lm("cp=2", &context_parallel(), false, &initial).unwrap_err();
    assert!(err.contains("call .split_sequences()"), "{err}");
}

#[test]
fn outputs_of_split_sequences_are_put_back_in_position_order() {
    let device = Device::flex();
    let lm = Lm::new(&device);
    let initial = flatten_params(&lm);
    let batch = TextBatcher.batch(vec![3, 4], &device);
    let whole = InferenceStep::step(&lm, batch.clone());
    let gathered = launch("cp=2", |ctx| {
        let lm = load_flat(Lm::new(ctx.device()), &initial);
        let (lm, par) = parallelize(lm, &context_parallel(), &ctx)?;
        let batch = TextBatcher.batch(vec![3, 4], ctx.device());
        let output = InferenceStep::step(&lm, batch.sequence_share(&par)?);
        GatherOutput::gather_sequences(output, &par)
    })
    .unwrap();
    for output in gathered {
        let targets: Vec<i64> = output
            .targets
            .into_data()
            .convert::<i64>()
            .try_to_vec()
            .unwrap();
        let expected: Vec<i64> = whole
            .targets
            .clone()
            .into_data()
            .convert::<i64>()
            .try_to_vec()
            .unwrap();
        assert_eq!(targets, expected, "targets in position order");
        let logits: Vec<f32> = output
            .logits
            .into_data()
            .convert::<f32>()
            .try_to_vec()
            .unwrap();
        let expected: Vec<f32> = whole
            .logits
            .clone()
            .into_data()
            .convert::<f32>()
            .try_to_vec()
            .unwrap();
        let diff = relative_difference(&expected, &logits);
        assert!(diff < 1e-5, "logits {diff:.2e} from one device's");
        let loss =
            (output.loss.into_scalar::<f32>() - whole.loss.clone().into_scalar::<f32>()).abs();
        assert!(loss < 1e-5, "loss {loss:.2e} from one device's");
    }
}
