//! burn-train's `Learner` on a device mesh: a classifier written in plain Burn, with its own
//! `TrainStep` and `InferenceStep`, a Burn dataset and `DataLoader` (shuffled), accuracy and
//! loss metrics, a learning-rate schedule and gradient accumulation, trained by burn-train at
//! `fsdp=2,tp=2`, `dp=2` and `dp=2,pp=2` (1F1B, 2 micro-batches per rank). Each layout's final
//! weights, and every validation metric burn-train logged, match the same `Learner` on one
//! device within 1e-5 (fp32).
//!
//! The `fsdp=2,tp=2` run saves Flashover checkpoints every epoch; a `dp=2` run resumes from its
//! first epoch's and finishes within 1e-5 of the uninterrupted single-device run.
//!
//! The lines a layout adds to the single-device set-up are marked `+`.
//!
//! Run: `cargo run --features learner --example learner_parallel`; one rank per process:
//! `cargo build --features mpi,learner --example learner_parallel && mpirun -np 4
//! target/debug/examples/learner_parallel` (the `fsdp=2,tp=2` and `dp=2,pp=2` runs).

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::AdamWConfig;
use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_train::metric::{AccuracyMetric, LossMetric};
use burn_train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
    TrainingStrategy,
};
use flashover::check::relative_difference;
use flashover::learner::{ParallelLearning, PipelineLearnerModel, ShareBatcher};
use flashover::nn::{Linear, LinearConfig}; // tp: Burn's Linear, whose forward follows a split
use flashover::parallel::params::{flatten_params, load_flat};
use flashover::prelude::*;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

const FEATURES: usize = 12;
const WIDTH: usize = 16;
const CLASSES: usize = 4;
const BATCH: usize = 8;
const EPOCHS: usize = 3;

// ---- The user's model, data and steps: plain Burn and burn-train. ----

/// An input projection, residual MLP blocks, a classification head.
#[derive(Module, Debug)]
struct Classifier {
    input: Linear,
    blocks: Vec<Block>,
    head: Linear,
}

#[derive(Module, Debug)]
struct Block {
    up: Linear,
    down: Linear,
}

impl Block {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        x.clone() + self.down.forward(gelu(self.up.forward(x)))
    }
}

impl Classifier {
    fn new(device: &Device) -> Self {
        let block = || Block {
            up: LinearConfig::new(WIDTH, 2 * WIDTH).init(device),
            down: LinearConfig::new(2 * WIDTH, WIDTH).init(device),
        };
        Classifier {
            input: LinearConfig::new(FEATURES, WIDTH).init(device),
            blocks: vec![block(), block()],
            head: LinearConfig::new(WIDTH, CLASSES).init(device),
        }
    }

    fn classify(&self, batch: &SampleBatch) -> ClassificationOutput {
        let mut x = self.input.forward(batch.features.clone());
        for block in &self.blocks {
            x = block.forward(x);
        }
        self.classify_features(x, batch)
    }

    /// The head on the blocks' output.
    fn classify_features(&self, x: Tensor<2>, batch: &SampleBatch) -> ClassificationOutput {
        let logits = self.head.forward(x);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.labels.clone());
        ClassificationOutput::new(loss, logits, batch.labels.clone())
    }
}

/// The largest batch a training step was given (the check that each rank trains on its share).
static LARGEST_STEP: AtomicUsize = AtomicUsize::new(0);

impl TrainStep for Classifier {
    type Input = SampleBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: SampleBatch) -> TrainOutput<ClassificationOutput> {
        LARGEST_STEP.fetch_max(batch.labels.dims()[0], Ordering::SeqCst);
        let item = self.classify(&batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Classifier {
    type Input = SampleBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: SampleBatch) -> ClassificationOutput {
        self.classify(&batch)
    }
}

// ---- What a pipelined plan adds: the forward in parts (`classify` cut at the blocks). ----

impl PipelineModel for Classifier {
    type Activation = Tensor<2>;
    type Batch = SampleBatch;

    fn embed(&self, batch: &SampleBatch) -> Tensor<2> {
        self.input.forward(batch.features.clone())
    }

    fn layer(&self, index: usize, x: Tensor<2>) -> Tensor<2> {
        LARGEST_STEP.fetch_max(x.dims()[0], Ordering::SeqCst);
        self.blocks[index].forward(x)
    }

    fn head_loss(&self, x: Tensor<2>, batch: &SampleBatch) -> Tensor<1> {
        self.classify_features(x, batch).loss
    }
}

impl PipelineLearnerModel for Classifier {
    fn samples(batch: &SampleBatch) -> usize {
        batch.labels.dims()[0]
    }

    fn micro_batch(batch: &SampleBatch, samples: Range<usize>) -> SampleBatch {
        SampleBatch {
            features: batch
                .features
                .clone()
                .narrow(0, samples.start, samples.len()),
            labels: batch.labels.clone().narrow(0, samples.start, samples.len()),
        }
    }

    fn train_head(&self, x: Tensor<2>, batch: &SampleBatch) -> ClassificationOutput {
        self.classify_features(x, batch)
    }

    fn inference_head(&self, x: Tensor<2>, batch: &SampleBatch) -> ClassificationOutput {
        self.classify_features(x, batch)
    }
}

#[derive(Clone, Debug)]
struct Sample {
    features: [f32; FEATURES],
    label: usize,
}

#[derive(Clone, Debug)]
struct SampleBatch {
    features: Tensor<2>,
    labels: Tensor<1, Int>,
}

#[derive(Clone)]
struct SampleBatcher;

impl Batcher<Sample, SampleBatch> for SampleBatcher {
    fn batch(&self, items: Vec<Sample>, device: &Device) -> SampleBatch {
        let n = items.len();
        let features: Vec<f32> = items.iter().flat_map(|s| s.features).collect();
        let labels: Vec<i64> = items.iter().map(|s| s.label as i64).collect();
        SampleBatch {
            features: Tensor::from_data(TensorData::new(features, [n, FEATURES]), device),
            labels: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// `n` deterministic samples, numbered from `first`: the class is the largest of four
/// feature sums, so there is something to learn.
fn samples(first: usize, n: usize) -> Vec<Sample> {
    (first..first + n)
        .map(|s| {
            let features: [f32; FEATURES] =
                std::array::from_fn(|f| ((s * 31 + f * 7) as f32 * 0.37).sin());
            let sums: Vec<f32> = features.chunks(3).map(|c| c.iter().sum()).collect();
            let label = (0..CLASSES)
                .max_by(|&a, &b| sums[a].total_cmp(&sums[b]))
                .unwrap();
            Sample { features, label }
        })
        .collect()
}

fn loader<B>(batcher: B, samples: Vec<Sample>) -> Arc<dyn DataLoader<SampleBatch>>
where
    B: Batcher<Sample, SampleBatch> + Clone + 'static,
{
    DataLoaderBuilder::new(batcher)
        .batch_size(BATCH)
        .shuffle(7)
        .build(InMemDataset::new(samples))
}

/// The user's burn-train set-up: data, metrics, schedule, accumulation, epochs; headless (this
/// build of burn-train has no terminal dashboard).
fn training<B>(dir: &Path, batcher: B) -> SupervisedTraining<Classifier>
where
    B: Batcher<Sample, SampleBatch> + Clone + 'static,
{
    let (train, valid) = (samples(0, 64), samples(1000, 32));
    SupervisedTraining::new(dir, loader(batcher.clone(), train), loader(batcher, valid))
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        .grads_accumulation(2)
        .num_epochs(EPOCHS)
        .with_application_logger(None)
}

fn learner(model: Classifier) -> Learner<Classifier> {
    let schedule = LinearLrSchedulerConfig::new(5e-3, 1e-3, 12)
        .init()
        .expect("a schedule");
    Learner::new(model, AdamWConfig::new().init(), schedule)
}

// ---- One device, and the same Learner under a plan. ----

fn single_device(dir: &Path, initial: &[f32]) -> Vec<f32> {
    let device = Device::flex().autodiff();
    let model = load_flat(Classifier::new(&device), initial);
    let result = training(dir, SampleBatcher).launch(learner(model));
    flatten_params(&result.model)
}

/// Checkpoints of a run: saved every epoch under `save`; resumed after epoch `resume.1` from
/// those another run saved under `resume.0`.
#[derive(Default)]
struct Checkpointing {
    save: Option<PathBuf>,
    resume: Option<(PathBuf, usize)>,
}

/// One rank's run under `plan` (as threads or one rank per process: nothing here depends on
/// how the ranks were started): the whole trained model's weights.
fn train_rank(
    ctx: RankContext,
    dir: &Path,
    plan: &ParallelizePlan,
    initial: &[f32],
    checkpointing: &Checkpointing,
) -> Result<Vec<f32>, ParallelError> {
    let device = ctx.device().clone().autodiff();
    let model = load_flat(Classifier::new(&device), initial);
    let (model, par) = parallelize(model, plan, &ctx)?; // +
    let mut training = training(dir, ShareBatcher::new(SampleBatcher, &par)); // + (the wrapper)
    let strategy: TrainingStrategy<Classifier> = if par.pipeline().is_ok() {
        let strategy = ParallelLearning::pipelined(&ctx, par)?; // + (pipelined plans)
        with_checkpoints(strategy, checkpointing).into()
    } else {
        with_checkpoints(ParallelLearning::new(&ctx, par)?, checkpointing).into() // +
    };
    if let Some((_, epoch)) = &checkpointing.resume {
        training = training.checkpoint(*epoch);
    }
    let training = training.with_training_strategy(strategy); // +
    let result = training.launch(learner(model));
    if let Some(error) = result.error {
        return Err(ParallelError::Invalid(error.to_string()));
    }
    Ok(flatten_params(&result.model))
}

/// `strategy` saving or resuming checkpoints as `checkpointing` asks.
fn with_checkpoints<S>(
    mut strategy: ParallelLearning<S>,
    checkpointing: &Checkpointing,
) -> ParallelLearning<S> {
    if let Some(save) = &checkpointing.save {
        strategy = strategy.checkpoints(save, EPOCHS);
    }
    if let Some((from, _)) = &checkpointing.resume {
        strategy = strategy.resume_from(from);
    }
    strategy
}

/// [`train_rank`] on every rank of `mesh`, as threads of this process: rank 0's weights.
fn parallel(
    dir: &Path,
    mesh: &str,
    plan: &ParallelizePlan,
    initial: &[f32],
    checkpointing: &Checkpointing,
) -> Vec<f32> {
    let weights = launch(mesh, |ctx| {
        train_rank(ctx, dir, plan, initial, checkpointing)
    })
    .expect("parallel training");
    weights.into_iter().next().expect("rank 0")
}

/// Every value burn-train logged for validation metric `name` in `epochs`, in order.
fn logged(dir: &Path, name: &str, epochs: std::ops::RangeInclusive<usize>) -> Vec<f32> {
    epochs
        .flat_map(|epoch| {
            let file = dir.join(format!("valid/epoch-{epoch}/{name}.log"));
            let text = std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            text.lines()
                .map(|line| line.split(',').next().unwrap().parse::<f32>().unwrap())
                .collect::<Vec<_>>()
        })
        .collect()
}

fn tp_fsdp() -> ParallelizePlan {
    // Megatron's MLP split: each block's hidden features by columns, then back by rows;
    // every weight sharded over fsdp too.
    ParallelizePlan::new()
        .tensor_parallel(TensorParallelRule::colwise(&["blocks.*.up"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["blocks.*.down"]))
        .fully_shard("")
}

fn pipeline() -> ParallelizePlan {
    // One block per stage; the input projection runs before them, the head after.
    let stages = PipelineRule::new("blocks", ScheduleKind::OneFOneB, 2)
        .first(&["input"])
        .last(&["head"]);
    ParallelizePlan::new().pipeline(stages)
}

fn main() {
    #[cfg(feature = "mpi")]
    if let Some(env) = flashover::ProcessEnv::detect().expect("launcher variables") {
        return under_mpirun(env);
    }
    // The same start in every run: how close AdamW keeps two layouts depends on it (elements
    // with tiny gradients take steps of their rounding); unseeded starts measured 9e-8 to
    // 3.7e-6 over a dozen runs.
    Device::flex().seed(17);
    let root: PathBuf = std::env::temp_dir().join("flashover-learner-parallel");
    let _ = std::fs::remove_dir_all(&root);
    let initial = flatten_params(&Classifier::new(&Device::flex()));
    let reference_dir = root.join("one-device");
    let reference = single_device(&reference_dir, &initial);
    assert_eq!(LARGEST_STEP.swap(0, Ordering::SeqCst), BATCH);
    println!(
        "one device: {} parameters, {EPOCHS} epochs",
        reference.len()
    );
    let saved = root.join("checkpoints");
    let runs = [
        (
            "fsdp=2,tp=2",
            tp_fsdp(),
            Checkpointing {
                save: Some(saved.clone()),
                ..Default::default()
            },
        ),
        ("dp=2", ParallelizePlan::new(), Checkpointing::default()),
        ("dp=2,pp=2", pipeline(), Checkpointing::default()),
        (
            "dp=2, resumed after epoch 1 of fsdp=2,tp=2",
            ParallelizePlan::new(),
            Checkpointing {
                resume: Some((saved, 1)),
                ..Default::default()
            },
        ),
    ];
    for (name, plan, checkpointing) in &runs {
        let mesh = name.split(' ').next().unwrap().trim_end_matches(',');
        let dir = root.join(name.replace([',', '=', ' '], "-"));
        let weights = parallel(&dir, mesh, plan, &initial, checkpointing);
        let weights = relative_difference(&reference, &weights);
        let epochs = checkpointing.resume.as_ref().map_or(1, |(_, e)| e + 1)..=EPOCHS;
        let metric = |name| {
            let one = logged(&reference_dir, name, epochs.clone());
            relative_difference(&one, &logged(&dir, name, epochs.clone()))
        };
        let (loss, accuracy) = (metric("Loss"), metric("Accuracy"));
        println!(
            "{name:<44} max relative difference to one device: weights {weights:.2e}, validation loss {loss:.2e}, accuracy {accuracy:.2e}"
        );
        assert!(
            weights < 1e-5 && loss < 1e-5 && accuracy < 1e-5,
            "{name} must match one device"
        );
        // A pipeline's blocks run micro-batches of a rank's share in training (validation
        // runs the whole share).
        assert_eq!(
            LARGEST_STEP.swap(0, Ordering::SeqCst),
            BATCH / 2,
            "{name}: each of the two data-parallel ranks computes half of every batch"
        );
    }
    println!("match: every layout trains the same model as one device's Learner");
}

/// One rank per process (`mpirun -np 4 target/debug/examples/learner_parallel`, built with
/// `--features mpi,learner`): the `fsdp=2,tp=2` and `dp=2,pp=2` runs through the same
/// [`train_rank`], against one device. Each process draws the same initial weights from a
/// seeded generator.
#[cfg(feature = "mpi")]
fn under_mpirun(env: flashover::ProcessEnv) {
    Device::flex().seed(17);
    let initial = flatten_params(&Classifier::new(&Device::flex()));
    let root = std::env::temp_dir().join("flashover-learner-mpirun");
    let reference_dir = root.join(format!("one-device-{}", env.rank));
    let _ = std::fs::remove_dir_all(&reference_dir);
    let reference = single_device(&reference_dir, &initial);
    let mpi = flashover::comm::MpiWorld::init().expect("MPI");
    let world = mpi.group(std::time::Duration::from_secs(60));
    let layouts = root.join("layouts");
    if env.rank == 0 {
        let _ = std::fs::remove_dir_all(&layouts);
    }
    world.barrier().expect("barrier");
    for (mesh, plan) in [("fsdp=2,tp=2", tp_fsdp()), ("dp=2,pp=2", pipeline())] {
        let dir = layouts.join(mesh.replace([',', '='], "-"));
        let weights = flashover::Launch::new(mesh)
            .expect("mesh")
            .run_process(world.clone(), |ctx| {
                train_rank(ctx, &dir, &plan, &initial, &Checkpointing::default())
            })
            .expect("parallel training");
        let weights = relative_difference(&reference, &weights);
        assert!(
            weights < 1e-5,
            "{mesh}, rank {}: weights {weights:.2e}",
            env.rank
        );
        // The reporting rank (not 0 under the pipeline) has written its metrics.
        world.barrier().expect("barrier");
        if env.rank == 0 {
            let one = logged(&reference_dir, "Loss", 1..=EPOCHS);
            let loss = relative_difference(&one, &logged(&dir, "Loss", 1..=EPOCHS));
            assert!(loss < 1e-5, "{mesh}: validation loss {loss:.2e}");
            println!(
                "{mesh} under mpirun, one rank per process: weights {weights:.2e}, validation loss {loss:.2e} from one device"
            );
        }
    }
    if env.rank == 0 {
        println!("match: the Learner under mpirun trains the same model as one device's");
    }
}
