//! A user's causal language model (learned and rotary positions) whose sequences a plan
//! splits over `cp` (context parallelism), alone and with dp, fsdp, tp, sequence parallelism
//! and pipelines, against the same model's plain single-rank Burn loop: losses and every
//! weight within 1e-5.

use crate::common::assert_matches;
use burn::module::{Module, Param};
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover_parallel::ParallelError;
use flashover_parallel::forward_context::rope_tables_at;
use flashover_parallel::nn;
use flashover_parallel::parallelize::{
    ContextParallelRule, ParallelizePlan, PipelineModel, PipelineRule, TensorParallelRule,
    parallelize,
};
use flashover_parallel::params::flatten_params;
use flashover_parallel::pipeline::ScheduleKind;
use flashover_runtime::Launch;

const VOCAB: usize = 11;
const WIDTH: usize = 8;
const HEADS: usize = 2;
const HEAD_DIM: usize = WIDTH / HEADS;
/// Positions per input sequence: cuts into 2 x cp chunks for cp = 2 and 4.
const SEQ: usize = 8;
const GLOBAL_BATCH: usize = 4;
const STEPS: usize = 5;
const LR: f64 = 2e-2;

/// Token and learned position embeddings, two pre-norm attention layers, a head tied to the
/// token table.
#[derive(Module, Debug)]
struct AttentionLm {
    embed: nn::Embedding,
    positions: nn::Embedding,
    layers: Vec<AttentionLayer>,
    out_norm: LayerNorm,
}

#[derive(Module, Debug)]
struct AttentionLayer {
    norm: LayerNorm,
    attn: SelfAttention,
}

#[derive(Module, Debug)]
struct SelfAttention {
    query: nn::Linear,
    key: nn::Linear,
    value: nn::Linear,
    core: nn::CausalAttention,
    out: nn::Linear,
}

const LAYERS: usize = 2;

fn table(rows: usize, cols: usize, salt: f32, device: &Device) -> Param<Tensor<2>> {
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| ((i as f32 * 0.37 + salt) * 1.3).sin() * 0.4)
        .collect();
    Param::from_data(TensorData::new(values, [rows, cols]), device)
}

fn linear(salt: f32, device: &Device) -> nn::Linear {
    let bias: Vec<f32> = (0..WIDTH).map(|i| (i as f32 + salt).cos() * 0.1).collect();
    nn::Linear {
        weight: table(WIDTH, WIDTH, salt, device),
        bias: Some(Param::from_data(TensorData::new(bias, [WIDTH]), device)),
    }
}

/// Inputs at their global positions, and their next tokens.
type Batch = (Tensor<2, Int>, Vec<usize>, Tensor<2, Int>);

impl AttentionLm {
    fn new(device: &Device) -> Self {
        let layer = |i: usize| {
            let salt = i as f32;
            AttentionLayer {
                norm: LayerNormConfig::new(WIDTH).init(device),
                attn: SelfAttention {
                    query: linear(0.1 + salt, device),
                    // No key bias: its gradient is zero in exact arithmetic (it shifts every
                    // score of a query alike), so Adam would amplify rounding noise.
                    key: nn::Linear {
                        bias: None,
                        ..linear(0.2 + salt, device)
                    },
                    value: linear(0.5 + salt, device),
                    core: nn::CausalAttention::new(device),
                    out: linear(0.9 + salt, device),
                },
            }
        };
        AttentionLm {
            embed: nn::Embedding {
                weight: table(VOCAB, WIDTH, 0.8, device),
            },
            positions: nn::Embedding {
                weight: table(SEQ, WIDTH, 0.3, device),
            },
            layers: (0..LAYERS).map(layer).collect(),
            out_norm: LayerNormConfig::new(WIDTH).init(device),
        }
    }

    /// The single-device loss: the pipeline's three parts in a row.
    fn loss(&self, batch: &Batch) -> Tensor<1> {
        let x = (0..LAYERS).fold(self.embed(batch), |x, i| self.layer(i, x));
        self.head_loss(x, batch)
    }
}

impl PipelineModel for AttentionLm {
    type Activation = Tensor<3>;
    type Batch = Batch;

    fn embed(&self, (inputs, positions, _): &Batch) -> Tensor<3> {
        let seq = inputs.dims()[1];
        // Under sequence parallelism the token embedding returns this tp rank's part.
        let at: Vec<i64> = positions[self.embed.local_positions(seq)]
            .iter()
            .map(|&p| p as i64)
            .collect();
        let at = Tensor::<2, Int>::from_data(
            TensorData::new(at.clone(), [1, at.len()]),
            &inputs.device(),
        );
        self.embed.forward(inputs.clone()) + self.positions.forward(at)
    }

    fn layer(&self, index: usize, x: Tensor<3>) -> Tensor<3> {
        let layer = &self.layers[index];
        x.clone() + layer.attn.forward(layer.norm.forward(x))
    }

    fn head_loss(&self, x: Tensor<3>, (_, _, targets): &Batch) -> Tensor<1> {
        let x = self.out_norm.forward(x);
        self.embed
            .cross_entropy(self.embed.logits(x), targets.clone())
    }
}

impl SelfAttention {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [q, k, v] = nn::Linear::forward_shared([&self.query, &self.key, &self.value], x);
        // Heads from the projection's width: a tensor-parallel rank holds HEADS / tp of them.
        let [batch, seq, width] = q.dims();
        let heads = width / HEAD_DIM;
        let split = |y: Tensor<3>| y.reshape([batch, seq, heads, HEAD_DIM]).swap_dims(1, 2);
        // Rotary embeddings at the positions the core holds (a pipeline stage's layer sees
        // only activations, so they come from the core, not the batch).
        let (cos, sin) = rope_tables_at(&self.core.positions(seq), HEAD_DIM, 10_000.0, &q.device());
        let q = rotate(split(q), &cos, &sin);
        let k = rotate(split(k), &cos, &sin);
        let v = split(v);
        let y = self.core.forward(q, k, v).swap_dims(1, 2);
        self.out.forward(y.reshape([batch, seq, width]))
    }
}

/// `x: [batch, heads, seq, head_dim]` rotated by the tables' angles ("rotate half").
fn rotate(x: Tensor<4>, cos: &Tensor<2>, sin: &Tensor<2>) -> Tensor<4> {
    let [b, h, t, d] = x.dims();
    let half = d / 2;
    let (x1, x2) = (x.clone().narrow(3, 0, half), x.narrow(3, half, half));
    let table = |t2: &Tensor<2>| t2.clone().reshape([1, 1, t, half]).expand([b, h, t, half]);
    let (cos, sin) = (table(cos), table(sin));
    Tensor::cat(
        vec![
            x1.clone() * cos.clone() - x2.clone() * sin.clone(),
            x1 * sin + x2 * cos,
        ],
        3,
    )
}

/// `[batch, SEQ + 1]` token sequences of samples `samples`.
fn tokens(samples: std::ops::Range<usize>, device: &Device) -> Tensor<2, Int> {
    let n = samples.len();
    let t: Vec<i64> = samples
        .flat_map(|s| (0..=SEQ).map(move |p| ((s * 5 + p * p + 2 * p) % VOCAB) as i64))
        .collect();
    Tensor::from_data(TensorData::new(t, [n, SEQ + 1]), device)
}

fn shifted(tokens: Tensor<2, Int>) -> (Tensor<2, Int>, Tensor<2, Int>) {
    (tokens.clone().narrow(1, 0, SEQ), tokens.narrow(1, 1, SEQ))
}

/// Losses and final weights on one device, in plain Burn.
fn single_rank() -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let mut model = AttentionLm::new(&device);
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    let positions: Vec<usize> = (0..SEQ).collect();
    for step in 0..STEPS {
        let samples = step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH;
        let (inputs, targets) = shifted(tokens(samples, &device));
        let loss = model.loss(&(inputs, positions.clone(), targets));
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    (losses, flatten_params(&model))
}

/// The same loop under `plan` on `mesh` (rank 0's losses and the gathered weights).
fn parallel(mesh: &str, plan: &ParallelizePlan) -> Result<(Vec<f32>, Vec<f32>), String> {
    let out = Launch::new(mesh)
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (mut model, par) = parallelize(AttentionLm::new(&device), plan, &ctx)?;
            let mut optim = AdamWConfig::new().init();
            let mut losses = vec![];
            let positions = par.sequences().positions(SEQ)?;
            let micro_batch = |samples| -> Batch {
                let (inputs, targets) = shifted(tokens(samples, &device));
                let share = |t| {
                    par.sequences()
                        .share(t, 1)
                        .expect("SEQ cuts into cp chunks")
                };
                (share(inputs), positions.clone(), share(targets))
            };
            for step in 0..STEPS {
                let (loss, grads) = if plan.pipeline.is_some() {
                    let out = par.pipeline()?.step(
                        &model,
                        GLOBAL_BATCH,
                        step,
                        &micro_batch,
                        None,
                        &ctx,
                    )?;
                    (out.scalars.read().loss, out.grads)
                } else {
                    let loss =
                        model.loss(&micro_batch(par.data().batch_share(GLOBAL_BATCH, step)?));
                    let mean = par.data().mean_loss(loss.clone().into_scalar::<f32>())?;
                    (mean, par.gradients(&model, loss.backward(), None, &ctx)?.0)
                };
                losses.push(loss);
                model = optim.step(LR, model, grads);
            }
            Ok::<_, ParallelError>((losses, flatten_params(&par.sharded().whole(model)?)))
        })
        .map_err(|e| e.to_string())?;
    Ok(out.into_iter().next().unwrap())
}

fn ring() -> ParallelizePlan {
    ParallelizePlan::new().context_parallel(ContextParallelRule::ring(&["layers.*.attn.core"]))
}

fn with_tp(plan: ParallelizePlan) -> ParallelizePlan {
    plan.tensor_parallel(TensorParallelRule::vocab(&["embed"]))
        .tensor_parallel(
            TensorParallelRule::colwise(&[
                "layers.*.attn.query",
                "layers.*.attn.key",
                "layers.*.attn.value",
            ])
            .in_units(HEAD_DIM),
        )
        .tensor_parallel(TensorParallelRule::rowwise(&["layers.*.attn.out"]).in_units(HEAD_DIM))
}

/// `plan` with the layers cut into stages (1F1B over two micro-batches), the token table
/// tied to the head.
fn pipelined(plan: ParallelizePlan) -> ParallelizePlan {
    plan.pipeline(
        PipelineRule::new("layers", ScheduleKind::OneFOneB, 2)
            .first(&["embed", "positions"])
            .last(&["out_norm", "embed"]),
    )
}

/// `plan` with sequence parallelism: the norms and the position table on tp's positions.
fn sequence_parallel(plan: ParallelizePlan) -> ParallelizePlan {
    plan.sequence_parallel("layers.*.norm")
        .sequence_parallel("out_norm")
        .sequence_parallel("positions")
}

#[test]
fn sequences_split_over_cp_by_a_plan_train_as_one_rank() {
    let reference = single_rank();
    let all_to_all = ParallelizePlan::new()
        .context_parallel(ContextParallelRule::all_to_all(&["layers.*.attn.core"]));
    let contiguous = ParallelizePlan::new()
        .context_parallel(ContextParallelRule::ring(&["layers.*.attn.core"]).contiguous());
    for (mesh, what, plan) in [
        ("cp=2", "ring", ring()),
        ("cp=4", "ring", ring()),
        ("cp=2", "all-to-all", all_to_all),
        ("cp=2", "ring, contiguous chunks", contiguous),
        ("dp=2,cp=2", "ring", ring()),
        ("fsdp=2,cp=2", "ring", ring().fully_shard("")),
        ("tp=2,cp=2", "ring", with_tp(ring())),
        ("fsdp=2,tp=2,cp=2", "ring", with_tp(ring()).fully_shard("")),
        (
            "tp=2,cp=2",
            "ring, sequence parallel",
            sequence_parallel(with_tp(ring())),
        ),
        ("pp=2,cp=2", "ring, 1F1B", pipelined(ring())),
        ("dp=2,pp=2,cp=2", "ring, 1F1B", pipelined(ring())),
        (
            "tp=2,pp=2,cp=2",
            "ring, sequence parallel, 1F1B",
            pipelined(sequence_parallel(with_tp(ring()))),
        ),
    ] {
        let what = format!("{mesh} ({what})");
        let run = parallel(mesh, &plan).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_matches(&what, &run, &reference);
    }
}

#[test]
fn context_parallel_plans_that_do_not_fit_are_refused_with_the_reason() {
    let no_rule = parallel("cp=2", &ParallelizePlan::new()).unwrap_err();
    assert!(
        no_rule.contains("cp=2") && no_rule.contains("context_parallel rule"),
        "{no_rule}"
    );
    let not_a_core = ParallelizePlan::new()
        .context_parallel(ContextParallelRule::ring(&["layers.*.attn.query"]));
    let err = parallel("cp=2", &not_a_core).unwrap_err();
    assert!(
        err.contains("`layers.*.attn.query`")
            && err.contains("not a flashover::nn::CausalAttention"),
        "{err}"
    );
    // All-to-all attention swaps positions for heads: one head per tp rank does not split
    // over cp = 2 (the heads are known once attention runs).
    let all_to_all = ParallelizePlan::new()
        .context_parallel(ContextParallelRule::all_to_all(&["layers.*.attn.core"]));
    let err = parallel("tp=2,cp=2", &with_tp(all_to_all)).unwrap_err();
    assert!(err.contains("a rank holds 1 heads"), "{err}");
    // A sequence of 8 does not cut into 2 x cp = 6 chunks.
    let err = parallel("cp=3", &ring()).unwrap_err();
    assert!(err.contains("sequence length 8"), "{err}");
}

#[test]
fn local_positions_makes_no_collective_so_one_rank_may_call_it_alone() {
    use flashover_runtime::Axis;
    let plan = sequence_parallel(with_tp(ParallelizePlan::new())).fully_shard("");
    let got = Launch::new("fsdp=2,tp=2")
        .unwrap()
        .timeout(std::time::Duration::from_secs(5))
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (model, _par) = parallelize(AttentionLm::new(&device), &plan, &ctx)?;
            // Only fsdp rank 0 asks: a collective inside (gathering the sharded table) would
            // leave it waiting for a peer that never comes.
            let asks = ctx.coord(Axis::Fsdp) == 0;
            let positions = asks.then(|| model.embed.local_positions(SEQ));
            ctx.world().barrier()?;
            Ok::<_, ParallelError>((ctx.coord(Axis::Tp), positions))
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let asked = got.iter().filter(|(_, p)| p.is_some()).count();
    assert_eq!(asked, 2, "fsdp rank 0 of each tp rank asked");
    for (tp, positions) in got {
        if let Some(p) = positions {
            assert_eq!(p, tp * SEQ / 2..(tp + 1) * SEQ / 2);
        }
    }
}

#[test]
fn sequence_lengths_that_do_not_split_are_refused_before_any_forward() {
    let sp = sequence_parallel(with_tp(ParallelizePlan::new()));
    let cp_sp = sequence_parallel(with_tp(ring()));
    let contiguous = ParallelizePlan::new()
        .context_parallel(ContextParallelRule::ring(&["layers.*.attn.core"]).contiguous());
    let contiguous_sp = sequence_parallel(with_tp(contiguous));
    for (mesh, plan, fits, short, axis) in [
        ("tp=2", sp, 8, 7, "does not divide by tp = 2"),
        // Load-balanced cp = 2 cuts 4 chunks: 12 does (a share of 6 splits over tp = 2); 10
        // cuts into no 4 equal chunks.
        ("tp=2,cp=2", cp_sp, 12, 10, "cp"),
        // Contiguous cp = 2 cuts 2 shares: 6 does, but a share of 3 does not split over tp.
        (
            "tp=2,cp=2",
            contiguous_sp,
            8,
            6,
            "does not divide by tp = 2",
        ),
    ] {
        let got = Launch::new(mesh)
            .unwrap()
            .run(|ctx| {
                let device = Device::flex().autodiff();
                let (_model, par) = parallelize(AttentionLm::new(&device), &plan, &ctx)?;
                Ok::<_, ParallelError>((par.sequences().check(fits), par.sequences().check(short)))
            })
            .unwrap_or_else(|e| panic!("{mesh}: {e}"));
        for (fits_ok, short_err) in got {
            assert!(fits_ok.is_ok(), "{mesh}: {fits}: {fits_ok:?}");
            let err = short_err
                .expect_err(&format!("{mesh}: {short} should not split"))
                .to_string();
            assert!(err.contains(axis), "{mesh}, {short}: {err}");
        }
    }
}
