//! A model of two streams, pipelined: an encoder's layers change the first stream (its
//! "memory"), a decoder's layers change the second and read the memory at every layer, and a
//! float mask rides along without a gradient. All three cross every stage boundary
//! (`PipelineModel::Activation` is a tuple), the layers are two lists (`encoder`, then
//! `decoder`) with the encoder's final norm attached to its last layer, and the cuts fall
//! between the lists and inside the decoder, so the memory's gradient comes back from several
//! later stages. Every schedule, and 1F1B with dp, fsdp, tp with sequence parallelism, cp and
//! recomputation, and with a mixture of experts in every decoder layer over ep, against the
//! plain single-rank Burn loop: losses and every weight within 1e-5; bf16 stages against the
//! same plan without pp.

use crate::common::{assert_matches, max_scaled};
use burn::module::{Module, Param};
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover_parallel::ParallelError;
use flashover_parallel::activation_checkpointing::CheckpointPolicy;
use flashover_parallel::expert_parallel::MoeForward;
use flashover_parallel::moe::{Moe, MoeConfig, SwiGlu};
use flashover_parallel::nn;
use flashover_parallel::parallelize::{
    ContextParallelRule, ParallelizePlan, PipelineModel, PipelineRule, TensorParallelRule,
    parallelize,
};
use flashover_parallel::params::flatten_params;
use flashover_parallel::pipeline::{NoGrad, ScheduleKind};
use flashover_parallel::precision::{MixedPrecision, Precision};
use flashover_runtime::Launch;

pub(crate) const VOCAB: usize = 11;
pub(crate) const WIDTH: usize = 8;
pub(crate) const HEADS: usize = 2;
pub(crate) const HEAD_DIM: usize = WIDTH / HEADS;
pub(crate) const SEQ: usize = 8;
pub(crate) const GLOBAL_BATCH: usize = 8;
pub(crate) const STEPS: usize = 4;
pub(crate) const LR: f64 = 2e-2;
/// Layers per list.
pub(crate) const LAYERS: usize = 2;

#[derive(Module, Debug)]
pub(crate) struct TwoStreams {
    embed: nn::Embedding,
    positions: nn::Embedding,
    encoder: Vec<EncoderLayer>,
    encoder_norm: LayerNorm,
    decoder: Vec<DecoderLayer>,
    out_norm: LayerNorm,
}

#[derive(Module, Debug)]
struct EncoderLayer {
    norm: LayerNorm,
    attn: SelfAttention,
}

/// Causal self-attention over its stream, the memory read position by position, and in
/// the model with experts a mixture of experts over the stream.
#[derive(Module, Debug)]
struct DecoderLayer {
    norm: LayerNorm,
    attn: SelfAttention,
    read_in: nn::Linear,
    read_out: nn::Linear,
    experts: Option<Moe>,
}

#[derive(Module, Debug)]
struct SelfAttention {
    query: nn::Linear,
    key: nn::Linear,
    value: nn::Linear,
    core: nn::CausalAttention,
    out: nn::Linear,
}

fn table(rows: usize, cols: usize, salt: f32, device: &Device) -> Param<Tensor<2>> {
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| ((i as f32 * 0.37 + salt) * 1.3).sin() * 0.4)
        .collect();
    Param::from_data(TensorData::new(values, [rows, cols]), device)
}

fn linear(salt: f32, bias: bool, device: &Device) -> nn::Linear {
    let values: Vec<f32> = (0..WIDTH).map(|i| (i as f32 + salt).cos() * 0.1).collect();
    nn::Linear {
        weight: table(WIDTH, WIDTH, salt, device),
        // Keys get no bias: its gradient is zero in exact arithmetic, and Adam would amplify
        // the rounding noise.
        bias: bias.then(|| Param::from_data(TensorData::new(values, [WIDTH]), device)),
    }
}

impl SelfAttention {
    fn new(salt: f32, device: &Device) -> Self {
        SelfAttention {
            query: linear(0.1 + salt, true, device),
            key: linear(0.2 + salt, false, device),
            value: linear(0.5 + salt, true, device),
            core: nn::CausalAttention::new(device),
            out: linear(0.9 + salt, true, device),
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [q, k, v] = nn::Linear::forward_shared([&self.query, &self.key, &self.value], x);
        let [batch, seq, width] = q.dims(); // tp: HEADS / tp heads
        let split = |y: Tensor<3>| {
            y.reshape([batch, seq, width / HEAD_DIM, HEAD_DIM])
                .swap_dims(1, 2)
        };
        let y = self
            .core
            .forward(split(q), split(k), split(v))
            .swap_dims(1, 2);
        self.out.forward(y.reshape([batch, seq, width]))
    }
}

/// Source tokens, target inputs, the positions held, target outputs.
pub(crate) type Batch = (Tensor<2, Int>, Tensor<2, Int>, Vec<usize>, Tensor<2, Int>);

/// The memory, the decoder's stream, and a mask the decoder weighs the memory with.
type Streams = (Tensor<3>, Tensor<3>, NoGrad<Tensor<3>>);

/// 4 experts of hidden width 6, top-2, capacity-limited, with load-balancing and z-losses.
fn experts(salt: f32, device: &Device) -> Moe {
    let mut config = MoeConfig::new(4, 2, 6);
    config.capacity_factor = Some(1.0);
    config.z_loss_coef = 1e-3;
    let matrix = |rows, cols, salt| burn::nn::Linear {
        weight: table(rows, cols, salt, device),
        bias: None,
    };
    let expert = |e: usize| {
        let salt = salt + e as f32;
        SwiGlu {
            w_gate: matrix(WIDTH, 6, salt + 0.1).into(),
            w_up: matrix(WIDTH, 6, salt + 0.2).into(),
            w_down: matrix(6, WIDTH, salt + 0.3).into(),
        }
    };
    Moe {
        router: matrix(WIDTH, 4, salt + 0.5),
        experts: (0..4).map(expert).collect(),
        shared: None,
        first_expert: 0,
        config,
        expert_bias: vec![],
    }
}

impl TwoStreams {
    /// The model, with a mixture of experts in every decoder layer when `with_experts`.
    pub(crate) fn new(with_experts: bool, device: &Device) -> Self {
        TwoStreams {
            embed: nn::Embedding {
                weight: table(VOCAB, WIDTH, 0.8, device),
            },
            positions: nn::Embedding {
                weight: table(SEQ, WIDTH, 0.3, device),
            },
            encoder: (0..LAYERS)
                .map(|i| EncoderLayer {
                    norm: LayerNormConfig::new(WIDTH).init(device),
                    attn: SelfAttention::new(i as f32, device),
                })
                .collect(),
            encoder_norm: LayerNormConfig::new(WIDTH).init(device),
            decoder: (0..LAYERS)
                .map(|i| DecoderLayer {
                    norm: LayerNormConfig::new(WIDTH).init(device),
                    attn: SelfAttention::new(3.0 + i as f32, device),
                    read_in: linear(7.1 + i as f32, true, device),
                    read_out: linear(7.7 + i as f32, true, device),
                    experts: with_experts.then(|| experts(11.0 * (i + 1) as f32, device)),
                })
                .collect(),
            out_norm: LayerNormConfig::new(WIDTH).init(device),
        }
    }

    /// The loss and the experts' auxiliary losses: the pipeline's parts in a row.
    fn loss(&self, batch: &Batch) -> Tensor<1> {
        let mut x = self.embed(batch);
        let mut loss = Tensor::zeros([1], &x.0.device());
        for i in 0..2 * LAYERS {
            let (y, aux) = self.layer_with_aux(i, x);
            x = y;
            loss = loss + aux.unwrap_or_else(|| Tensor::zeros([1], &x.0.device()));
        }
        loss + self.head_loss(x, batch)
    }
}

impl PipelineModel for TwoStreams {
    type Batch = Batch;
    type Activation = Streams;

    fn embed(&self, (source, target, positions, _): &Batch) -> Streams {
        let seq = source.dims()[1];
        let held = self.embed.local_positions(seq); // sp: this tp rank's positions
        let at: Vec<i64> = positions[held.clone()].iter().map(|&p| p as i64).collect();
        let at = Tensor::<2, Int>::from_data(
            TensorData::new(at.clone(), [1, at.len()]),
            &source.device(),
        );
        let place = |tokens: &Tensor<2, Int>| {
            self.embed.forward(tokens.clone()) + self.positions.forward(at.clone())
        };
        // 1 where the source token is not a multiple of 3, else 0.5.
        let source_held = source.clone().narrow(1, held.start, held.len());
        let thirds = source_held.remainder_scalar(3).equal_elem(0).float();
        let memory = place(source);
        // In the compute dtype of a precision policy, as the streams.
        let keep = (thirds.mul_scalar(-0.5) + 1.0)
            .unsqueeze_dim(2)
            .cast(memory.dtype());
        (memory, place(target), NoGrad(keep))
    }

    fn layer(&self, index: usize, x: Streams) -> Streams {
        self.layer_with_aux(index, x).0
    }

    fn layer_with_aux(
        &self,
        index: usize,
        (memory, stream, keep): Streams,
    ) -> (Streams, Option<Tensor<1>>) {
        if index < LAYERS {
            let layer = &self.encoder[index];
            let mut memory = memory.clone() + layer.attn.forward(layer.norm.forward(memory));
            if index == LAYERS - 1 {
                memory = self.encoder_norm.forward(memory); // attached to encoder.1
            }
            return ((memory, stream, keep), None);
        }
        let layer = &self.decoder[index - LAYERS];
        let stream = stream.clone() + layer.attn.forward(layer.norm.forward(stream));
        let read = layer
            .read_out
            .forward(layer.read_in.forward(memory.clone()).tanh());
        let stream = stream + read * keep.0.clone();
        match &layer.experts {
            Some(experts) => {
                let (y, aux) = experts.forward(stream.clone());
                ((memory, stream + y, keep), aux)
            }
            None => ((memory, stream, keep), None),
        }
    }

    fn head_loss(&self, (_, stream, _): Streams, (_, _, _, targets): &Batch) -> Tensor<1> {
        let x = self.out_norm.forward(stream);
        self.embed
            .cross_entropy(self.embed.logits(x), targets.clone())
    }
}

/// Source, target inputs and outputs of samples `samples`: `[n, SEQ]` each.
pub(crate) fn tokens(samples: std::ops::Range<usize>, device: &Device) -> [Tensor<2, Int>; 3] {
    let n = samples.len();
    let make = |f: &dyn Fn(usize, usize) -> usize| {
        let t: Vec<i64> = (samples.clone())
            .flat_map(|s| (0..SEQ).map(move |p| (s, p)))
            .map(|(s, p)| (f(s, p) % VOCAB) as i64)
            .collect();
        Tensor::from_data(TensorData::new(t, [n, SEQ]), device)
    };
    let target = |s: usize, p: usize| s * 3 + p * p + 1;
    [
        make(&|s, p| s * 5 + 2 * p + 1),
        make(&target),
        make(&|s, p| target(s, p + 1)),
    ]
}

/// Losses and final weights.
type Run = (Vec<f32>, Vec<f32>);

fn single_rank(with_experts: bool) -> Run {
    let device = Device::flex().autodiff();
    let mut model = TwoStreams::new(with_experts, &device);
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
        let [source, target, next] =
            tokens(step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH, &device);
        let loss = model.loss(&(source, target, (0..SEQ).collect(), next));
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    (losses, flatten_params(&model))
}

/// The same loop under `plan` on `mesh`: rank 0's losses, the gathered weights, and the
/// layer forwards rank 0 ran again in backward.
fn parallel(mesh: &str, plan: &ParallelizePlan) -> Result<(Run, usize), String> {
    parallel_model(mesh, plan, false)
}

/// [`parallel`] of the model with experts when `with_experts`; its losses are the objective
/// trained (next-token and auxiliary losses).
fn parallel_model(
    mesh: &str,
    plan: &ParallelizePlan,
    with_experts: bool,
) -> Result<(Run, usize), String> {
    let out = Launch::new(mesh)
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let model = TwoStreams::new(with_experts, &device);
            let (mut model, par) = parallelize(model, plan, &ctx)?;
            let mut optim = AdamWConfig::new().init();
            let (mut losses, mut recomputed) = (vec![], 0);
            let positions = par.sequences().positions(SEQ)?;
            let micro_batch = |samples| -> Batch {
                let share = |t| {
                    par.sequences()
                        .share(t, 1)
                        .expect("SEQ cuts into cp chunks")
                };
                let [source, target, next] = tokens(samples, &device).map(share);
                (source, target, positions.clone(), next)
            };
            for step in 0..STEPS {
                let out =
                    par.pipeline()?
                        .step(&model, GLOBAL_BATCH, step, &micro_batch, None, &ctx)?;
                let values = out.scalars.read();
                losses.push(values.loss + values.aux_loss);
                recomputed += out.recomputed;
                model = optim.step(LR, model, out.grads);
            }
            let weights = flatten_params(&par.sharded().whole(model)?);
            Ok::<_, ParallelError>(((losses, weights), recomputed))
        })
        .map_err(|e| e.to_string())?;
    Ok(out.into_iter().next().unwrap())
}

/// Encoder then decoder, cut as `counts` says, `kind` over 4 micro-batches.
pub(crate) fn cut(kind: ScheduleKind, counts: &[usize]) -> PipelineRule {
    PipelineRule::new("encoder", kind, 4)
        .then_layers("decoder")
        .attach("encoder_norm", "encoder.1")
        .first(&["embed", "positions"])
        .last(&["out_norm", "embed"])
        .layers_per_stage(counts)
}

pub(crate) fn with_tp(plan: ParallelizePlan) -> ParallelizePlan {
    let heads = ["*.*.attn.query", "*.*.attn.key", "*.*.attn.value"];
    plan.tensor_parallel(TensorParallelRule::vocab(&["embed"]))
        .tensor_parallel(TensorParallelRule::colwise(&heads).in_units(HEAD_DIM))
        .tensor_parallel(TensorParallelRule::rowwise(&["*.*.attn.out"]).in_units(HEAD_DIM))
        .tensor_parallel(TensorParallelRule::colwise(&["decoder.*.read_in"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["decoder.*.read_out"]))
        .sequence_parallel("*.*.norm")
        .sequence_parallel("encoder_norm")
        .sequence_parallel("out_norm")
        .sequence_parallel("positions")
}

#[test]
fn two_streams_and_a_mask_cross_every_schedule_and_composition_as_one_rank() {
    let reference = single_rank(false);
    let one_f = ScheduleKind::OneFOneB;
    let plan = |rule: PipelineRule| ParallelizePlan::new().pipeline(rule);
    let ring = ContextParallelRule::ring(&["encoder.*.attn.core", "decoder.*.attn.core"]);
    let layouts = [
        ("pp=2", "1F1B, encoder | decoder", plan(cut(one_f, &[2, 2]))),
        (
            "pp=2",
            "1F1B, inside the decoder",
            plan(cut(one_f, &[3, 1])),
        ),
        (
            "pp=2",
            "GPipe, inside the decoder",
            plan(cut(ScheduleKind::GPipe, &[3, 1])),
        ),
        (
            "pp=4",
            "1F1B, one layer a stage",
            plan(cut(one_f, &[1, 1, 1, 1])),
        ),
        (
            "pp=2",
            "interleaved, two chunks",
            plan(cut(ScheduleKind::Interleaved1F1B, &[1, 1, 1, 1]).chunks(2)),
        ),
        (
            "pp=2",
            "zero-bubble H1",
            plan(cut(ScheduleKind::ZeroBubbleH1, &[3, 1])),
        ),
        ("dp=2,pp=2", "1F1B", plan(cut(one_f, &[3, 1]))),
        (
            "fsdp=2,pp=2",
            "1F1B",
            plan(cut(one_f, &[3, 1])).fully_shard(""),
        ),
        (
            "tp=2,pp=2",
            "1F1B, sequence parallel",
            with_tp(plan(cut(one_f, &[3, 1]))),
        ),
        (
            "fsdp=2,tp=2,pp=2",
            "1F1B, sequence parallel",
            with_tp(plan(cut(one_f, &[2, 2]))).fully_shard(""),
        ),
        (
            "pp=2,cp=2",
            "1F1B, ring",
            plan(cut(one_f, &[3, 1])).context_parallel(ring.clone()),
        ),
        (
            "tp=2,pp=2,cp=2",
            "1F1B, sequence parallel, ring",
            with_tp(plan(cut(one_f, &[3, 1]))).context_parallel(ring),
        ),
        (
            "pp=2",
            "1F1B, every layer recomputed",
            plan(cut(one_f, &[3, 1])).activation_checkpointing(CheckpointPolicy::Full),
        ),
    ];
    for (mesh, what, plan) in layouts {
        let what = format!("{mesh} ({what})");
        let (run, recomputed) = parallel(mesh, &plan).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_matches(&what, &run, &reference);
        let recomputes = plan.activation_checkpointing != CheckpointPolicy::None;
        assert_eq!(
            recomputes,
            recomputed > 0,
            "{what}: {recomputed} recomputed"
        );
    }
}

#[test]
fn two_streams_cross_stages_with_experts_spread_over_ep_as_one_rank() {
    let reference = single_rank(true);
    let one_f = ScheduleKind::OneFOneB;
    let spread = |counts: &[usize]| {
        ParallelizePlan::new()
            .pipeline(cut(one_f, counts))
            .expert_parallel("decoder.*.experts")
    };
    let ring = ContextParallelRule::ring(&["encoder.*.attn.core", "decoder.*.attn.core"]);
    for (mesh, what, plan) in [
        ("pp=2,ep=2", "1F1B, inside the decoder", spread(&[3, 1])),
        ("dp=2,pp=2", "1F1B, experts whole", plan_without_ep(&[3, 1])),
        (
            "pp=2,ep=2,cp=2",
            "1F1B, encoder | decoder, ring",
            spread(&[2, 2]).context_parallel(ring),
        ),
    ] {
        let what = format!("{mesh} ({what})");
        let (run, _) = parallel_model(mesh, &plan, true).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_matches(&what, &run, &reference);
    }
}

/// The model with experts cut as `counts` says, its experts on every rank.
fn plan_without_ep(counts: &[usize]) -> ParallelizePlan {
    ParallelizePlan::new().pipeline(cut(ScheduleKind::OneFOneB, counts))
}

#[test]
fn two_streams_cross_stages_in_a_precision_policys_dtype() {
    // bf16 stages, plain and recomputed: the first step's loss (one forward of the same
    // weights) is the same plan's on a mesh without pp, bit for bit, and not f32's; the run
    // stays within bf16's rounding of it.
    let f32_one_rank = single_rank(false);
    let bf16 = ParallelizePlan::new()
        .pipeline(cut(ScheduleKind::OneFOneB, &[3, 1]))
        .mixed_precision(MixedPrecision::new(Precision::BF16));
    let recomputed = bf16
        .clone()
        .activation_checkpointing(CheckpointPolicy::Full);
    for plan in [bf16, recomputed] {
        let what = format!("bf16, {}", plan.activation_checkpointing);
        let run = |mesh, plan| {
            parallel(mesh, plan)
                .unwrap_or_else(|e| panic!("{what}: {e}"))
                .0
        };
        let mut one_stage = plan.clone();
        one_stage
            .pipeline
            .as_mut()
            .expect("a pipeline")
            .layers_per_stage = None;
        let (pipelined, unpiped) = (run("pp=2", &plan), run("pp=1", &one_stage));
        assert_eq!(pipelined.0[0], unpiped.0[0], "{what}: first loss");
        let from_f32 = (pipelined.0[0] - f32_one_rank.0[0]).abs();
        assert!(from_f32 > 1e-4, "{what}: computed as f32 ({from_f32:e})");
        let losses = max_scaled(&pipelined.0, &unpiped.0);
        assert!(
            losses < 1e-2,
            "{what}: losses {losses:e} from the run without pp"
        );
    }
}

#[test]
fn layer_lists_and_attached_modules_read_from_toml_and_refuse_what_does_not_fit() {
    let toml = ParallelizePlan::from_toml(
        r#"
        [pipeline]
        layers = ["encoder", "decoder"]
        attach = [{ module = "encoder_norm", layer = "encoder.1" }]
        first = ["embed", "positions"]
        last = ["out_norm", "embed"]
        schedule = "1f1b"
        micro_batches = 4
        layers_per_stage = [3, 1]
        "#,
    )
    .unwrap();
    assert_eq!(
        toml,
        ParallelizePlan::new().pipeline(cut(ScheduleKind::OneFOneB, &[3, 1]))
    );
    let refused =
        |rule: PipelineRule| parallel("pp=2", &ParallelizePlan::new().pipeline(rule)).unwrap_err();
    // The final norm in no stage.
    let unattached = PipelineRule::new("encoder", ScheduleKind::OneFOneB, 4)
        .then_layers("decoder")
        .first(&["embed", "positions"])
        .last(&["out_norm", "embed"]);
    let err = refused(unattached.clone());
    assert!(
        err.contains("`encoder_norm.") && err.contains("attach"),
        "{err}"
    );
    // Attached to a layer the list does not have, or to a module that is not a layer.
    let err = refused(unattached.clone().attach("encoder_norm", "encoder.2"));
    assert!(
        err.contains("`encoder.2`") && err.contains("names no module"),
        "{err}"
    );
    let err = refused(unattached.clone().attach("encoder_norm", "decoder.0.norm"));
    assert!(
        err.contains("`decoder.0.norm`") && err.contains("not a layer of"),
        "{err}"
    );
    // Attached and named as the last stage's too.
    let twice = unattached.last(&["out_norm", "embed", "encoder_norm"]);
    let err = refused(twice.attach("encoder_norm", "encoder.1"));
    assert!(err.contains("name each module once"), "{err}");
}

#[test]
fn a_pipelined_forward_hands_the_last_stage_every_stream() {
    // Validation and inference: the stages forward only, each boundary's tensors sent with
    // their shapes; the last stage's ranks get what one device's layers return.
    let batch = |device: &Device| -> Batch {
        let [source, target, next] = tokens(0..4, device);
        (source, target, (0..SEQ).collect(), next)
    };
    let device = Device::flex().autodiff();
    let whole = TwoStreams::new(false, &device);
    let one = batch(&device);
    let (memory, stream, NoGrad(keep)) =
        (0..2 * LAYERS).fold(whole.embed(&one), |x, i| whole.layer(i, x));
    let expected: Vec<Vec<f32>> = [memory, stream, keep]
        .map(|t| t.into_data().try_to_vec::<f32>().unwrap())
        .into();
    for (mesh, counts) in [("pp=2", &[3, 1][..]), ("pp=4", &[1, 1, 1, 1][..])] {
        let plan = ParallelizePlan::new().pipeline(cut(ScheduleKind::OneFOneB, counts));
        let out = Launch::new(mesh)
            .unwrap()
            .run(|ctx| {
                let device = Device::flex().autodiff();
                let (model, par) = parallelize(TwoStreams::new(false, &device), &plan, &ctx)?;
                let got = par.pipeline()?.forward(&model, &batch(&device))?;
                Ok::<_, ParallelError>(got.map(|(memory, stream, NoGrad(keep))| {
                    [memory, stream, keep].map(|t| t.into_data().try_to_vec::<f32>().unwrap())
                }))
            })
            .unwrap_or_else(|e| panic!("{mesh}: {e}"));
        let last: Vec<_> = out.into_iter().flatten().collect();
        assert_eq!(
            last.len(),
            1,
            "{mesh}: only the last stage holds the output"
        );
        for (got, want) in last[0].iter().zip(&expected) {
            assert!(
                max_scaled(got, want) < 1e-6,
                "{mesh}: {}",
                max_scaled(got, want)
            );
        }
    }
}
