//! Burn's own text classifier (the model of Burn's text-classification example: token and
//! position embeddings, a `TransformerEncoder` with a padding mask, a linear head on the first
//! position), parallelized by a plan. The model's code is Burn's with one changed import: the
//! encoder comes from `flashover::nn::transformer` (Burn's encoder with the same config,
//! fields, record and one-rank forward, whose layers a plan can split and shard).
//!
//! Each layout trains the same model on the same data as its own single-rank Burn loop, with
//! the encoder's dropout at 0.1 as in Burn's example; losses and every final weight match
//! within 1e-5 (fp32). The drop-in draws every layout's dropout masks as one device draws
//! them: the one-device loop says which samples of which step it computes
//! (`set_dropout_draws`), the plans do it in `batch_share` and `pipeline()?.step`. Under
//! `fsdp=2` every parameter is sharded: each rank stores half of the model's parameter bytes.
//!
//! Layouts: `dp=2`, `fsdp=2`, `tp=2`, `tp=2` with sequence parallelism, `cp=2` (context
//! parallelism: the encoder splits each sequence's positions, its attention all-to-all),
//! `fsdp=2,tp=2`, and, with the forward cut in three for the pipeline (`impl
//! PipelineModel`), `pp=2` and `fsdp=2,tp=2,pp=2`.
//!
//! Not yet here: sequence or context parallelism in a pipeline (the encoder splits sequences
//! in its own forward, which a stage calling its layers one by one bypasses: refused).
//!
//! Run: `cargo run --example parallelize_burn_transformer`

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
// The one changed line: was `use burn::nn::transformer::{...}`.
use flashover::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use flashover::parallel::params::{ParamLayout, flatten_params, load_flat};
use flashover::prelude::*;

const VOCAB: usize = 50;
const SEQ: usize = 12;
const D_MODEL: usize = 32;
const CLASSES: usize = 4;
const GLOBAL_BATCH: usize = 8;
const STEPS: usize = 8;
const LR: f64 = 1e-3;
/// The dropout masks' seed, the same on one device and in every plan.
const SEED: u64 = 42;

// ---- The user's model: Burn's text classifier. ----

#[derive(Module, Debug)]
struct TextClassifier {
    transformer: TransformerEncoder,
    embedding_token: Embedding,
    embedding_pos: Embedding,
    output: Linear,
}

impl TextClassifier {
    /// Burn's random initialisation: every layout starts from the reference's weights below.
    fn new(device: &Device) -> Self {
        TextClassifier {
            transformer: TransformerEncoderConfig::new(D_MODEL, 4 * D_MODEL, 4, 2)
                .with_norm_first(true)
                .with_dropout(0.1)
                .init(device),
            embedding_token: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
            embedding_pos: EmbeddingConfig::new(SEQ, D_MODEL).init(device),
            output: LinearConfig::new(D_MODEL, CLASSES).init(device),
        }
    }

    /// Class logits of `tokens: [batch, seq]`, `pad: [batch, seq]` true past each sentence.
    fn forward(&self, tokens: Tensor<2, Int>, pad: Tensor<2, Bool>) -> Tensor<2> {
        let x = self.embed(tokens);
        self.head(
            self.transformer
                .forward(TransformerEncoderInput::new(x).mask_pad(pad)),
        )
    }

    /// Token and position embeddings.
    fn embed(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [batch, seq] = tokens.dims();
        let positions = Tensor::<1, Int>::arange(0..seq as i64, &tokens.device())
            .reshape([1, seq])
            .repeat_dim(0, batch);
        self.embedding_token.forward(tokens) + self.embedding_pos.forward(positions)
    }

    /// Class logits at the first position.
    fn head(&self, encoded: Tensor<3>) -> Tensor<2> {
        let batch = encoded.dims()[0];
        self.output
            .forward(encoded)
            .narrow(1, 0, 1)
            .reshape([batch, CLASSES])
    }
}

/// Sentences: tokens, padding, labels.
type Sentences = (Tensor<2, Int>, Tensor<2, Bool>, Tensor<1, Int>);

// ---- For pipelines: the same forward, cut in three (+). ----

impl PipelineModel for TextClassifier {
    type Batch = Sentences;
    type Activation = Tensor<3>;

    fn embed(&self, (tokens, _, _): &Sentences) -> Tensor<3> {
        TextClassifier::embed(self, tokens.clone())
    }

    /// Burn's encoder layer `index`, reading the micro-batch's padding mask.
    fn layer_for(
        &self,
        index: usize,
        x: Tensor<3>,
        batch: &Sentences,
    ) -> (Tensor<3>, Option<Tensor<1>>) {
        let pad = Some(batch.1.clone());
        (self.transformer.layers[index].forward(x, pad, None), None)
    }

    fn head_loss(&self, x: Tensor<3>, (_, _, labels): &Sentences) -> Tensor<1> {
        cross_entropy(self.head(x), labels.clone())
    }
}

/// Burn's mean cross-entropy.
fn cross_entropy(logits: Tensor<2>, labels: Tensor<1, Int>) -> Tensor<1> {
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits, labels)
}

/// Samples `range` of an endless set of padded sentences.
fn sentences(range: std::ops::Range<usize>, device: &Device) -> Sentences {
    let n = range.len();
    let (mut tokens, mut pad, mut labels) = (vec![], vec![], vec![]);
    for s in range {
        let len = SEQ / 2 + s % (SEQ / 2);
        for p in 0..SEQ {
            let token = (s * 17 + p * 5) % (VOCAB - 1) + 1;
            tokens.push(if p < len { token as i64 } else { 0 });
            pad.push(p >= len);
        }
        labels.push(((s * 3 + len) % CLASSES) as i64);
    }
    (
        Tensor::from_data(TensorData::new(tokens, [n, SEQ]), device),
        Tensor::from_data(TensorData::new(pad, [n, SEQ]), device),
        Tensor::from_data(TensorData::new(labels, [n]), device),
    )
}

/// The mean cross-entropy of samples `range`.
fn loss(model: &TextClassifier, range: std::ops::Range<usize>, device: &Device) -> Tensor<1> {
    let (tokens, pad, labels) = sentences(range, device);
    cross_entropy(model.forward(tokens, pad), labels)
}

// ---- Training: the plain single-rank loop, and the same loop under a plan. ----

/// Losses and final weights.
type Run = (Vec<f32>, Vec<f32>);

/// The plain Burn loop on one device, from `initial`.
fn single_rank(initial: &[f32]) -> Run {
    let device = Device::flex().autodiff();
    let mut model = load_flat(TextClassifier::new(&device), initial);
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
        let samples = step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH;
        // The masks a plan draws: those of these samples of this step.
        flashover::nn::set_dropout_draws(SEED, step, samples.clone());
        let loss = loss(&model, samples, &device);
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    (losses, flatten_params(&model))
}

/// The same loop under `plan` on `mesh`, from `initial`: rank 0's run and every rank's
/// stored parameter elements.
fn parallel(mesh: &str, plan: &ParallelizePlan, initial: &[f32]) -> (Run, Vec<usize>) {
    let out = launch(mesh, |ctx| {
        // +
        let device = ctx.device().clone().autodiff();
        let model = load_flat(TextClassifier::new(&device), initial);
        // The lines a plan adds to the loop are marked `+`, those it changes `~`.
        let (mut model, par) = parallelize(model, plan, &ctx)?; // +
        let stored = ParamLayout::of(&model).numel;
        let mut optim = AdamWConfig::new().init();
        let mut losses = vec![];
        for step in 0..STEPS {
            let loss = loss(&model, par.data().batch_share(GLOBAL_BATCH, step)?, &device); // ~
            losses.push(par.data().mean_loss(loss.clone().into_scalar::<f32>())?); // ~
            let (grads, _) = par.gradients(&model, loss.backward(), None, &ctx)?; // ~
            model = optim.step(LR, model, grads);
        }
        let weights = flatten_params(&par.sharded().whole(model)?); // +
        Ok::<_, ParallelError>(((losses, weights), stored))
    })
    .expect("parallel training");
    let stored = out.iter().map(|(_, s)| *s).collect();
    (out.into_iter().next().unwrap().0, stored)
}

/// The same loop under a pipelined `plan` on `mesh`: each step runs the plan's schedule over
/// the micro-batches (forward and backward) and hands back the reduced gradients.
fn pipelined(mesh: &str, plan: &ParallelizePlan, initial: &[f32]) -> (Run, Vec<usize>) {
    let out = launch(mesh, |ctx| {
        // +
        let device = ctx.device().clone().autodiff();
        let model = load_flat(TextClassifier::new(&device), initial);
        let (mut model, par) = parallelize(model, plan, &ctx)?; // +
        let stored = ParamLayout::of(&model).numel;
        let mut optim = AdamWConfig::new().init();
        let mut losses = vec![];
        let micro_batch = |samples| sentences(samples, &device); // +
        for step in 0..STEPS {
            let out = par
                .pipeline()?
                .step(&model, GLOBAL_BATCH, step, &micro_batch, None, &ctx)?; // ~
            losses.push(out.scalars.read().loss); // ~
            model = optim.step(LR, model, out.grads);
        }
        let weights = flatten_params(&par.sharded().whole(model)?); // +
        Ok::<_, ParallelError>(((losses, weights), stored))
    })
    .expect("pipelined training");
    let stored = out.iter().map(|(_, s)| *s).collect();
    (out.into_iter().next().unwrap().0, stored)
}

fn main() {
    let initial = flatten_params(&TextClassifier::new(&Device::flex()));
    let reference = single_rank(&initial);
    let whole = initial.len();
    println!(
        "Burn's text classifier, {whole} parameters, dropout 0.1; one rank's loss {:.4} -> {:.4}",
        reference.0[0],
        reference.0[STEPS - 1]
    );
    // The encoder's Megatron split, ready-made: attention by whole heads, the feed-forward's
    // pair (one line in the plan).
    let encoder = TextClassifier::new(&Device::flex()).transformer;
    let tp = ParallelizePlan::new()
        .dropout_seed(SEED)
        .tensor_parallel_rules(encoder.tensor_parallel_rules("transformer"));
    let plan = ParallelizePlan::new().dropout_seed(SEED);
    // Sequence parallelism: the encoder splits each sequence over tp between its split
    // layers (its norms, residuals and dropout run on this rank's positions).
    let sp = tp
        .clone()
        .sequence_parallel_rules(encoder.sequence_parallel_rules("transformer"));
    // Context parallelism: the encoder splits each sequence over cp, its attention swapping
    // positions for heads.
    let cp = plan
        .clone()
        .context_parallel(ContextParallelRule::all_to_all(&[]))
        .sequence_split_stack("transformer");
    // Burn's `layers` cut as they are into stages, the embeddings on the first, the head on
    // the last.
    let stages = PipelineRule::new("transformer.layers", ScheduleKind::OneFOneB, 4)
        .first(&["embedding_token", "embedding_pos"])
        .last(&["output"]);
    let layouts = [
        ("dp=2", plan.clone()),
        ("fsdp=2", plan.clone().fully_shard("")),
        ("tp=2", tp.clone()),
        ("tp=2 (sp)", sp),
        ("cp=2", cp),
        ("fsdp=2,tp=2", tp.clone().fully_shard("")),
        ("pp=2", plan.pipeline(stages.clone())),
        ("fsdp=2,tp=2,pp=2", tp.fully_shard("").pipeline(stages)),
    ];
    for (layout, plan) in &layouts {
        let mesh = layout.trim_end_matches(" (sp)");
        let (run, stored) = match plan.pipeline {
            None => parallel(mesh, plan, &initial),
            Some(_) => pipelined(mesh, plan, &initial),
        };
        let losses = flashover::check::relative_difference(&reference.0, &run.0);
        let weights = flashover::check::relative_difference(&reference.1, &run.1);
        println!(
            "{layout:<17} stores {stored:?} of {whole} parameters per rank; max relative difference: losses {losses:.2e}, weights {weights:.2e}"
        );
        assert!(
            losses < 1e-5 && weights < 1e-5,
            "{layout} must match one rank"
        );
        if mesh == "fsdp=2" {
            // ZeRO-3: every parameter sharded, so each rank holds half the bytes (a parameter
            // of an odd number of rows pads one row).
            let bytes: Vec<usize> = stored.iter().map(|s| s * 4).collect();
            println!(
                "{:<17} ZeRO-3 parameter bytes per rank {bytes:?}, whole / fsdp = {}",
                "",
                whole * 4 / 2
            );
            let rows_of_padding = 2 * D_MODEL;
            assert!(stored.iter().all(|s| *s <= whole / 2 + rows_of_padding));
        }
    }
    println!("match: every plan trains Burn's text classifier as one rank");
}
