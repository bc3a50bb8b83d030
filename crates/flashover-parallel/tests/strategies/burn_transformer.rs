//! Burn's own text classifier (as in Burn's text-classification example: token and position
//! embeddings, a transformer encoder with a padding mask, a linear head on the first
//! position), with one changed import: the encoder comes from `flashover_parallel::nn::transformer`.
//! Every layout trains as the plain single-rank Burn loop does (losses, clipped gradient
//! norms, every weight within 1e-5), without dropout and with dropout 0.1 (the encoder's and
//! a `flashover_parallel::nn::Dropout` on the embeddings), and under `fully_shard` every
//! parameter is sharded.

use crate::common::{assert_run_matches, plain_step};
use crate::plan_loops::{GLOBAL_BATCH, MAX_NORM, differences, plan_loop, reference_loop};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Dropout, DropoutConfig, Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use flashover_parallel::ParallelError;
use flashover_parallel::activation_checkpointing::CheckpointPolicy;
use flashover_parallel::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use flashover_parallel::parallelize::{
    ContextParallelRule, ParallelizePlan, PipelineModel, PipelineRule, TensorParallelRule,
    parallelize,
};
use flashover_parallel::params::{ParamLayout, load_flat};
use flashover_parallel::pipeline::ScheduleKind;
use flashover_runtime::Launch;

const VOCAB: usize = 11;
const SEQ: usize = 6;
const D_MODEL: usize = 16;
const HEADS: usize = 4;
const CLASSES: usize = 3;

#[derive(Module, Debug)]
struct TextClassifier {
    transformer: TransformerEncoder,
    embedding_token: Embedding,
    embedding_pos: Embedding,
    /// On the embeddings (not in Burn's example; Burn's `Dropout` with one changed import).
    dropout: flashover_parallel::nn::Dropout,
    output: Linear,
}

/// The dropout masks' seed, on one device and in the plans.
const SEED: u64 = 17;

fn config() -> TransformerEncoderConfig {
    TransformerEncoderConfig::new(D_MODEL, 2 * D_MODEL, HEADS, 2)
        .with_norm_first(true)
        .with_dropout(0.0)
}

impl TextClassifier {
    /// Built from Burn's configs, then every parameter set from its index, so that every rank
    /// and the reference start alike (Burn's generator is shared by the rank threads).
    fn new(device: &Device) -> Self {
        Self::with_dropout(device, 0.0)
    }

    /// [`Self::new`] with the encoder's dropout at `p`.
    fn with_dropout(device: &Device, p: f64) -> Self {
        let model = TextClassifier {
            transformer: config().with_dropout(p).init(device),
            embedding_token: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
            embedding_pos: EmbeddingConfig::new(SEQ, D_MODEL).init(device),
            dropout: flashover_parallel::nn::DropoutConfig::new(p).init(),
            output: LinearConfig::new(D_MODEL, CLASSES).init(device),
        };
        let n = ParamLayout::of(&model).numel;
        let values: Vec<f32> = (0..n)
            .map(|i| ((i as f32 * 0.37 + 0.1).sin()) * 0.3)
            .collect();
        load_flat(model, &values)
    }

    /// `tokens: [batch, seq]`, `pad: [batch, seq]` (true past each sample's end) -> logits
    /// `[batch, classes]` read at the first position.
    fn forward(&self, tokens: Tensor<2, Int>, pad: Tensor<2, Bool>) -> Tensor<2> {
        let x = self.embed(tokens);
        self.head(
            self.transformer
                .forward(TransformerEncoderInput::new(x).mask_pad(pad)),
        )
    }

    /// Token and position embeddings of `tokens: [batch, seq]`.
    fn embed(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [batch, seq] = tokens.dims();
        let positions = Tensor::<1, Int>::arange(0..seq as i64, &tokens.device())
            .reshape([1, seq])
            .repeat_dim(0, batch);
        let x = self.embedding_token.forward(tokens) + self.embedding_pos.forward(positions);
        self.dropout.forward(x)
    }

    /// Class logits read at the first position of `encoded: [batch, seq, d_model]`.
    fn head(&self, encoded: Tensor<3>) -> Tensor<2> {
        let batch = encoded.dims()[0];
        self.output
            .forward(encoded)
            .narrow(1, 0, 1)
            .reshape([batch, CLASSES])
    }
}

/// Burn's mean cross-entropy of `logits` against `labels`.
fn cross_entropy(logits: Tensor<2>, labels: Tensor<1, Int>) -> Tensor<1> {
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits, labels)
}

/// Sentences: tokens, padding, labels.
type Sentences = (Tensor<2, Int>, Tensor<2, Bool>, Tensor<1, Int>);

/// The classifier's forward in the pipeline's three parts; its layers read the padding mask
/// (so `layer_for` is the one layer method it writes).
impl PipelineModel for TextClassifier {
    type Batch = Sentences;
    type Activation = Tensor<3>;

    fn embed(&self, (tokens, _, _): &Sentences) -> Tensor<3> {
        TextClassifier::embed(self, tokens.clone())
    }

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

/// The mean cross-entropy of samples `samples` of an endless data set of padded sentences.
fn loss(model: &TextClassifier, samples: std::ops::Range<usize>, device: &Device) -> Tensor<1> {
    let (tokens, pad, labels) = sentences(samples, device);
    cross_entropy(model.forward(tokens, pad), labels)
}

/// Samples `samples` of an endless data set of padded sentences: tokens, padding, labels.
fn sentences(samples: std::ops::Range<usize>, device: &Device) -> Sentences {
    let n = samples.len();
    let (mut tokens, mut pad, mut labels) = (vec![], vec![], vec![]);
    for s in samples {
        let len = 3 + s % 4;
        for p in 0..SEQ {
            tokens.push(if p < len {
                ((s * 5 + p * 3) % (VOCAB - 1) + 1) as i64
            } else {
                0
            });
            pad.push(p >= len);
        }
        labels.push(((s * 7 + len) % CLASSES) as i64);
    }
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(tokens, [n, SEQ]), device);
    let pad = Tensor::<2, Bool>::from_data(TensorData::new(pad, [n, SEQ]), device);
    let labels = Tensor::<1, Int>::from_data(TensorData::new(labels, [n]), device);
    (tokens, pad, labels)
}

/// Trains the classifier with dropout `p` on `mesh` under `plan`: rank 0's run and every
/// rank's stored parameter elements.
fn parallel(mesh: &str, plan: &ParallelizePlan, p: f64) -> (crate::plan_loops::Run, Vec<usize>) {
    plan_loop(
        mesh,
        &plan.clone().dropout_seed(SEED),
        |device| TextClassifier::with_dropout(device, p),
        |model, par, step, ctx, device| {
            plain_step(model, par, step, ctx, |m, samples| loss(m, samples, device))
        },
    )
}

/// The encoder's Megatron split (attention by whole heads, the feed-forward's pair).
fn tp_plan() -> ParallelizePlan {
    tp_plan_at("transformer")
}

/// [`tp_plan`] with Megatron's sequence parallelism: the encoder splits each sequence over
/// `tp` between its split layers.
fn sp_plan() -> ParallelizePlan {
    let encoder = config().init(&Device::flex());
    tp_plan().sequence_parallel_rules(encoder.sequence_parallel_rules("transformer"))
}

/// `plan` with context parallelism of the encoder: it splits each sequence over `cp`, its
/// attention swapping positions for heads (all-to-all).
fn cp_plan(plan: ParallelizePlan) -> ParallelizePlan {
    plan.context_parallel(ContextParallelRule::all_to_all(&[]))
        .sequence_split_stack("transformer")
}

/// [`tp_plan`] for an encoder at `path`.
fn tp_plan_at(path: &str) -> ParallelizePlan {
    let encoder = config().init(&Device::flex());
    ParallelizePlan::new().tensor_parallel_rules(encoder.tensor_parallel_rules(path))
}

#[test]
fn burns_text_classifier_trains_as_one_rank_on_every_layout() {
    trains_as_one_rank_on_every_layout(0.0);
}

#[test]
fn with_dropout_burns_text_classifier_trains_as_one_rank_on_every_layout() {
    trains_as_one_rank_on_every_layout(0.1);
}

/// Every layout with dropout `p` against the one-device loop, whose masks are drawn by
/// `set_dropout_draws` as the plans' are.
fn trains_as_one_rank_on_every_layout(p: f64) {
    let device = Device::flex().autodiff();
    let model = TextClassifier::with_dropout(&device, p);
    let reference = reference_loop(model, |model, samples| {
        let step = samples.start / GLOBAL_BATCH;
        flashover_parallel::nn::set_dropout_draws(SEED, step, samples.clone());
        loss(model, samples, &device)
    });
    if p > 0.0 {
        // The masks change what is computed (or the comparison below would not test them).
        let undropped = reference_loop(TextClassifier::new(&device), |model, samples| {
            loss(model, samples, &device)
        });
        let (loss, _, _) = differences(&undropped, &reference);
        assert!(loss > 1e-3, "dropout {p} changed the losses by {loss:e}");
    }
    let layouts = [
        ("dp=2", ParallelizePlan::new()),
        ("fsdp=2", ParallelizePlan::new().fully_shard("")),
        ("tp=2", tp_plan()),
        ("fsdp=2,tp=2", tp_plan().fully_shard("")),
        ("tp=2", sp_plan()),
        ("dp=2,tp=2", sp_plan()),
        ("cp=2", cp_plan(ParallelizePlan::new())),
        (
            "fsdp=2,cp=2",
            cp_plan(ParallelizePlan::new().fully_shard("")),
        ),
        ("tp=2,cp=2", cp_plan(tp_plan())),
    ];
    let mut held = vec![];
    for (mesh, plan) in layouts {
        let (run, per_rank) = parallel(mesh, &plan, p);
        let (loss, norm, weights) = differences(&run, &reference);
        let sp = match plan.sequence_parallel.is_empty() {
            true => "",
            false => " with sp",
        };
        assert!(
            loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
            "{mesh}{sp}: losses {loss:e}, norms {norm:e}, weights {weights:e}"
        );
        held.push(per_rank.into_iter().max().unwrap());
    }
    // What each rank stores: the whole under dp; half under fsdp (within a row of padding per
    // parameter); less than the whole under tp (the encoder's linear layers are split, the
    // embeddings and head replicated); and fsdp halves what tp leaves.
    // Burn's `layers` cut as they are into two stages, the mask riding in each micro-batch.
    let rule = PipelineRule::new("transformer.layers", ScheduleKind::OneFOneB, 4)
        .first(&["embedding_token", "embedding_pos"])
        .last(&["output"]);
    // Recomputed in backward, a layer draws the masks its forward drew.
    let recomputed = ParallelizePlan::new()
        .pipeline(rule.clone())
        .activation_checkpointing(CheckpointPolicy::Full);
    for (mesh, plan) in [
        ("pp=2", ParallelizePlan::new().pipeline(rule.clone())),
        ("pp=2", recomputed),
        ("fsdp=2,tp=2,pp=2", tp_plan().fully_shard("").pipeline(rule)),
    ] {
        let (run, _) = plan_loop(
            mesh,
            &plan.dropout_seed(SEED),
            |device| TextClassifier::with_dropout(device, p),
            |model, par, step, ctx, device| {
                let micro_batch = |samples| sentences(samples, device);
                let out = par.pipeline()?.step(
                    model,
                    GLOBAL_BATCH,
                    step,
                    &micro_batch,
                    Some(MAX_NORM),
                    ctx,
                )?;
                let values = out.scalars.read();
                Ok((out.grads, values.loss, values.norm))
            },
        );
        let (loss, norm, weights) = differences(&run, &reference);
        assert!(
            loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
            "{mesh}: losses {loss:e}, norms {norm:e}, weights {weights:e}"
        );
    }
    let whole = reference.2.len();
    let slack = ParamLayout::of(&TextClassifier::new(&Device::flex()))
        .slots
        .len()
        * D_MODEL;
    assert_eq!(held[0], whole);
    assert!(
        held[1] <= whole / 2 + slack,
        "fsdp=2: {} of {whole}",
        held[1]
    );
    assert!(held[2] < whole, "tp=2: {} of {whole}", held[2]);
    assert_eq!(
        held[4], held[2],
        "sequence parallelism splits activations only"
    );
    assert!(
        held[3] <= held[2] / 2 + slack,
        "fsdp=2,tp=2: {} of {}",
        held[3],
        held[2]
    );
}

#[test]
fn fully_shard_leaves_no_parameter_of_burns_text_classifier_whole() {
    let held = Launch::new("fsdp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let plan = ParallelizePlan::new().fully_shard("");
            let (model, par) = parallelize(TextClassifier::new(&device), &plan, &ctx)?;
            assert!(par.sharded().kept_whole().is_empty());
            // Every stored parameter is a shard: half the rows of the whole, rounded up.
            let whole = ParamLayout::of(&TextClassifier::new(&Device::flex()));
            let held = ParamLayout::of(&model);
            for (mine, all) in held.slots.iter().zip(&whole.slots) {
                assert!(
                    mine.numel < all.numel,
                    "`{}` is whole: {} elements",
                    all.name,
                    all.numel
                );
            }
            Ok::<_, ParallelError>(held.numel)
        })
        .unwrap();
    let whole = ParamLayout::of(&TextClassifier::new(&Device::flex())).numel;
    for h in held {
        assert!(h * 2 <= whole + 64 * 2, "{h} of {whole}");
    }
}

#[test]
fn the_encoder_split_over_tp_refuses_dropout_without_draws() {
    let err = Launch::new("tp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let model = TextClassifier::with_dropout(&device, 0.1);
            let (model, par) = parallelize(model, &tp_plan(), &ctx)?;
            let samples = par.data().batch_share(GLOBAL_BATCH, 0)?;
            // A loop of one's own that forgets the draws: each rank's device would draw.
            flashover_parallel::nn::clear_dropout_draws();
            Ok::<_, ParallelError>(loss(&model, samples, &device))
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("MultiHeadAttention is split over tp=2 and has dropout 0.1")
            && err.contains("no dropout draws set"),
        "{err}"
    );
}

/// Burn's text classifier with Burn's own `Dropout` on the embeddings: a value replicated
/// over `tp`, on which each rank draws its own mask from the device.
#[derive(Module, Debug)]
struct DroppedEmbeddings {
    classifier: TextClassifier,
    dropout: Dropout,
}

#[test]
fn burns_own_dropout_under_tp_is_refused_on_the_first_step_naming_a_parameter() {
    let out = Launch::new("tp=2").unwrap().run(|ctx| {
        let device = Device::flex().autodiff();
        let model = DroppedEmbeddings {
            classifier: TextClassifier::new(&device),
            dropout: DropoutConfig::new(0.1).init(),
        };
        let (model, par) = parallelize(model, &tp_plan_at("classifier.transformer"), &ctx)?;
        let samples = par.data().batch_share(GLOBAL_BATCH, 0)?;
        let (tokens, pad, labels) = sentences(samples, &device);
        let c = &model.classifier;
        let x = model.dropout.forward(TextClassifier::embed(c, tokens));
        let encoded = c
            .transformer
            .forward(TransformerEncoderInput::new(x).mask_pad(pad));
        let loss = cross_entropy(c.head(encoded), labels);
        par.gradients(&model, loss.backward(), None, &ctx)
            .map(|_| ())
    });
    let err = out.unwrap_err().to_string();
    assert!(
        err.contains("is whole on every tp rank, but its gradient differs")
            && err.contains("Dropout"),
        "{err}"
    );
}

#[test]
fn column_wise_projections_whose_reader_stays_whole_are_refused_naming_both() {
    let qkv_only = ParallelizePlan::new().tensor_parallel(
        TensorParallelRule::colwise(&[
            "transformer.layers.*.mha.query",
            "transformer.layers.*.mha.key",
            "transformer.layers.*.mha.value",
        ])
        .in_units(D_MODEL / HEADS),
    );
    let err = Launch::new("tp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            parallelize(TextClassifier::new(&device), &qkv_only, &ctx).map(|_| ())
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`transformer.layers.0.mha.query`")
            && err.contains("`transformer.layers.0.mha.output` beside it")
            && err.contains("row-wise"),
        "{err}"
    );
}

/// Self-attention of one's own that reshapes by the head count of its configuration, as
/// many do: right on one device, wrong when its projections are split over `tp` (each rank
/// holds `HEADS / tp` heads, but reshapes its part into `HEADS` narrower ones).
#[derive(Module, Debug)]
struct ConfiguredHeads {
    embedding: Embedding,
    query: flashover_parallel::nn::Linear,
    key: flashover_parallel::nn::Linear,
    value: flashover_parallel::nn::Linear,
    out: flashover_parallel::nn::Linear,
    head: Linear,
    n_heads: usize,
}

impl ConfiguredHeads {
    fn new(device: &Device) -> Self {
        let linear =
            |d_in, d_out| flashover_parallel::nn::LinearConfig::new(d_in, d_out).init(device);
        let model = ConfiguredHeads {
            embedding: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
            query: linear(D_MODEL, D_MODEL),
            key: linear(D_MODEL, D_MODEL),
            value: linear(D_MODEL, D_MODEL),
            out: linear(D_MODEL, D_MODEL),
            head: LinearConfig::new(D_MODEL, CLASSES).init(device),
            n_heads: HEADS,
        };
        let n = ParamLayout::of(&model).numel;
        load_flat(
            model,
            &(0..n)
                .map(|i| (i as f32 * 0.29).cos() * 0.3)
                .collect::<Vec<_>>(),
        )
    }

    fn loss(&self, (tokens, _, labels): Sentences) -> Tensor<1> {
        let x = self.embedding.forward(tokens);
        let [b, s, _] = x.dims();
        let heads = |t: Tensor<3>| {
            let width = t.dims()[2];
            t.reshape([b, s, self.n_heads, width / self.n_heads])
                .swap_dims(1, 2)
        };
        let [q, k, v] = flashover_parallel::nn::Linear::forward_shared(
            [&self.query, &self.key, &self.value],
            x,
        );
        let width = q.dims()[2];
        let weights = burn::tensor::activation::softmax(heads(q).matmul(heads(k).transpose()), 3);
        let context = weights
            .matmul(heads(v))
            .swap_dims(1, 2)
            .reshape([b, s, width]);
        let logits = self
            .head
            .forward(self.out.forward(context))
            .narrow(1, 0, 1)
            .reshape([b, CLASSES]);
        cross_entropy(logits, labels)
    }
}

#[test]
fn check_split_names_the_layer_whose_forward_does_not_follow_the_split() {
    let rules = |path: &str| {
        let at = |name: &str| format!("{path}{name}");
        ParallelizePlan::new()
            .tensor_parallel(
                TensorParallelRule::colwise(&[&at("query"), &at("key"), &at("value")])
                    .in_units(D_MODEL / HEADS),
            )
            .tensor_parallel(TensorParallelRule::rowwise(&[&at("out")]))
    };
    let check = |mesh: &str, plan: ParallelizePlan, configured: bool| {
        Launch::new(mesh)
            .unwrap()
            .run(|ctx| {
                let device = Device::flex().autodiff();
                let samples = 0..GLOBAL_BATCH;
                if configured {
                    let (model, par) = parallelize(ConfiguredHeads::new(&device), &plan, &ctx)?;
                    par.check_split(
                        &model,
                        |m| m.loss(sentences(samples.clone(), &device)),
                        1e-4,
                        &ctx,
                    )
                } else {
                    let (model, par) = parallelize(TextClassifier::new(&device), &plan, &ctx)?;
                    par.check_split(&model, |m| loss(m, samples.clone(), &device), 1e-4, &ctx)
                }
            })
            .map(|checks| checks.into_iter().next().unwrap())
    };
    // Burn's encoder through the drop-in follows every split.
    for (mesh, plan) in [
        ("tp=2", tp_plan()),
        ("fsdp=2,tp=2", tp_plan().fully_shard("")),
    ] {
        let passed = check(mesh, plan, false).unwrap();
        assert!(
            passed.compared > 0 && passed.max_gradient_difference < 1e-5,
            "{mesh}: {passed:?}"
        );
    }
    // On one rank the configured head count is right; split, it is not, and the check names
    // the first parameter whose gradient differs (the split layers all do; the query comes
    // first).
    let err = check("tp=2", rules(""), true).unwrap_err().to_string();
    assert!(err.contains("`query.weight`'s gradient"), "{err}");
    let err = check("dp=2", rules(""), true);
    assert!(err.is_ok(), "{err:?}");
}

/// Burn's decoder (one changed import too) in a model of its own: a target embedding decoded
/// over a memory, with a causal mask and dropout 0.1.
#[derive(Module, Debug)]
struct Decoded {
    embedding: Embedding,
    decoder: flashover_parallel::nn::transformer::TransformerDecoder,
    output: Linear,
}

impl Decoded {
    fn new(device: &Device) -> Self {
        let model = Decoded {
            embedding: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
            decoder: flashover_parallel::nn::transformer::TransformerDecoderConfig::new(
                D_MODEL,
                2 * D_MODEL,
                HEADS,
                2,
            )
            .with_dropout(0.1)
            .init(device),
            output: LinearConfig::new(D_MODEL, CLASSES).init(device),
        };
        let n = ParamLayout::of(&model).numel;
        load_flat(
            model,
            &(0..n)
                .map(|i| (i as f32 * 0.23).sin() * 0.3)
                .collect::<Vec<_>>(),
        )
    }

    fn loss(&self, (tokens, pad, labels): Sentences) -> Tensor<1> {
        let [batch, seq] = tokens.dims();
        let device = tokens.device();
        let target = self.embedding.forward(tokens);
        let memory = target.clone().flip([1]) * 0.5;
        let causal = burn::nn::attention::generate_autoregressive_mask(batch, seq, &device);
        let input =
            flashover_parallel::nn::transformer::TransformerDecoderInput::new(target, memory)
                .target_mask_attn(causal)
                .memory_mask_pad(pad);
        let decoded = self.decoder.forward(input);
        let logits = self
            .output
            .forward(decoded)
            .narrow(1, 0, 1)
            .reshape([batch, CLASSES]);
        cross_entropy(logits, labels)
    }
}

#[test]
fn burns_decoder_split_over_tp_computes_its_loss_and_gradients_as_whole() {
    for (mesh, fsdp, sp) in [
        ("tp=2", false, false),
        ("fsdp=2,tp=2", true, false),
        ("tp=2", false, true),
    ] {
        let checks = Launch::new(mesh)
            .unwrap()
            .run(|ctx| {
                let device = Device::flex().autodiff();
                let model = Decoded::new(&device);
                let rules = model.decoder.tensor_parallel_rules("decoder");
                let plan = ParallelizePlan::new().tensor_parallel_rules(rules);
                let plan = if fsdp { plan.fully_shard("") } else { plan };
                let plan = match sp {
                    true => plan
                        .sequence_parallel_rules(model.decoder.sequence_parallel_rules("decoder")),
                    false => plan,
                };
                let (model, par) = parallelize(model, &plan, &ctx)?;
                let data = || sentences(0..GLOBAL_BATCH, &device);
                // Both forwards drop what one device drops of these samples.
                flashover_parallel::nn::set_dropout_draws(SEED, 0, 0..GLOBAL_BATCH);
                par.check_split(&model, |m| m.loss(data()), 1e-5, &ctx)
            })
            .unwrap();
        for check in checks {
            assert!(check.compared > 0, "{mesh}: {check:?}");
            assert!(check.max_gradient_difference < 1e-5, "{mesh}: {check:?}");
        }
    }
}

#[test]
fn a_splitting_stack_s_layer_run_by_a_pipeline_stage_is_refused_naming_it() {
    let rule = PipelineRule::new("transformer.layers", ScheduleKind::OneFOneB, 2)
        .first(&["embedding_token", "embedding_pos"])
        .last(&["output"]);
    let plan = sp_plan().pipeline(rule);
    let err = Launch::new("tp=2,pp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (model, par) = parallelize(TextClassifier::new(&device), &plan, &ctx)?;
            let micro_batch = |samples| sentences(samples, &device);
            par.pipeline()?
                .step(&model, GLOBAL_BATCH, 0, &micro_batch, None, &ctx)
                .map(|_| ())
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`transformer.layers.0.mha.")
            && err.contains("ran outside the stack's forward"),
        "{err}"
    );
}

#[test]
fn burns_decoder_with_dropout_trains_as_one_rank_split_by_heads_and_by_positions() {
    let device = Device::flex().autodiff();
    let reference = reference_loop(Decoded::new(&device), |model, samples| {
        let step = samples.start / GLOBAL_BATCH;
        flashover_parallel::nn::set_dropout_draws(SEED, step, samples.clone());
        model.loss(sentences(samples, &device))
    });
    let decoder = Decoded::new(&Device::flex()).decoder;
    let tp = ParallelizePlan::new().tensor_parallel_rules(decoder.tensor_parallel_rules("decoder"));
    // Heads over tp; positions over tp between the split layers (sp); positions over cp.
    let layouts = [
        ("tp=2", tp.clone()),
        (
            "dp=2,tp=2",
            tp.sequence_parallel_rules(decoder.sequence_parallel_rules("decoder")),
        ),
        (
            "cp=2",
            ParallelizePlan::new()
                .context_parallel(ContextParallelRule::all_to_all(&[]))
                .sequence_split_stack("decoder"),
        ),
    ];
    for (mesh, plan) in layouts {
        let (run, _) = plan_loop(
            mesh,
            &plan.dropout_seed(SEED),
            Decoded::new,
            |model, par, step, ctx, device| {
                plain_step(model, par, step, ctx, |m, samples| {
                    m.loss(sentences(samples, device))
                })
            },
        );
        assert_run_matches(mesh, &run, &reference);
    }
}

#[test]
fn a_splitting_stack_without_a_sequence_split_or_with_two_is_refused_at_parallelize() {
    let refused = |mesh: &str, plan: ParallelizePlan| {
        Launch::new(mesh)
            .unwrap()
            .run(|ctx| {
                let device = Device::flex().autodiff();
                parallelize(TextClassifier::new(&device), &plan, &ctx).map(|_| ())
            })
            .unwrap_err()
            .to_string()
    };
    let err = refused("dp=2", tp_plan().sequence_split_stack("transformer"));
    assert!(
        err.contains("`transformer` (sequence_split_stacks)") && err.contains("over neither tp"),
        "{err}"
    );
    let err = refused("tp=2,cp=2", cp_plan(sp_plan()));
    assert!(err.contains("both tp"), "{err}");
}
