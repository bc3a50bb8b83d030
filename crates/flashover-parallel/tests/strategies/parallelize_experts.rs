//! A user's mixture-of-experts language model (`flashover_parallel::moe::Moe` layers: 4 experts, top-2,
//! capacity-limited, with load-balancing and z-losses) whose experts a plan spreads over `ep`,
//! alone and with dp, fsdp, tp (with and without sequence parallelism) and cp, against the
//! same model's plain single-rank Burn loop: losses and every weight within 1e-5.

use crate::common::{assert_matches, max_scaled};
use burn::module::{Module, Param};
use burn::nn::{LayerNorm, LayerNormConfig, Linear};
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
use flashover_parallel::pipeline::ScheduleKind;
use flashover_runtime::Launch;

const VOCAB: usize = 11;
const WIDTH: usize = 8;
const HEADS: usize = 2;
const HEAD_DIM: usize = WIDTH / HEADS;
const EXPERTS: usize = 4;
const SEQ: usize = 8;
const GLOBAL_BATCH: usize = 4;
const STEPS: usize = 5;
const LR: f64 = 1e-2;

/// Token embedding (tied head), two blocks of causal attention and a mixture of experts.
#[derive(Module, Debug)]
struct MoeLm {
    embed: nn::Embedding,
    blocks: Vec<MoeBlock>,
    out_norm: LayerNorm,
}

#[derive(Module, Debug)]
struct MoeBlock {
    attn_norm: LayerNorm,
    query: nn::Linear,
    key: nn::Linear,
    value: nn::Linear,
    core: nn::CausalAttention,
    out: nn::Linear,
    moe_norm: LayerNorm,
    moe: Moe,
}

/// Deterministic values, well spread (a hash of the index), scaled by `scale`.
fn values(n: usize, salt: f32, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = ((i as f32 * 12.9898 + salt * 78.233).sin() * 43758.547).fract();
            (h - 0.5) * 2.0 * scale
        })
        .collect()
}

fn matrix(rows: usize, cols: usize, salt: f32, device: &Device) -> Param<Tensor<2>> {
    Param::from_data(
        TensorData::new(values(rows * cols, salt, 0.3), [rows, cols]),
        device,
    )
}

fn burn_linear(d_in: usize, d_out: usize, salt: f32, device: &Device) -> Linear {
    Linear {
        weight: matrix(d_in, d_out, salt, device),
        bias: None,
    }
}

fn linear(salt: f32, device: &Device) -> nn::Linear {
    burn_linear(WIDTH, WIDTH, salt, device).into()
}

impl MoeLm {
    fn new(device: &Device) -> Self {
        let mut config = MoeConfig::new(EXPERTS, 2, 6);
        config.capacity_factor = Some(1.0);
        config.z_loss_coef = 1e-3;
        let block = |i: usize| {
            let salt = 10.0 * i as f32;
            let expert = |e: usize| {
                let salt = salt + 1.0 + e as f32;
                SwiGlu {
                    w_gate: burn_linear(WIDTH, 6, salt + 0.1, device).into(),
                    w_up: burn_linear(WIDTH, 6, salt + 0.2, device).into(),
                    w_down: burn_linear(6, WIDTH, salt + 0.3, device).into(),
                }
            };
            MoeBlock {
                attn_norm: LayerNormConfig::new(WIDTH).init(device),
                query: linear(salt + 0.1, device),
                key: linear(salt + 0.2, device),
                value: linear(salt + 0.3, device),
                core: nn::CausalAttention::new(device),
                out: linear(salt + 0.4, device),
                moe_norm: LayerNormConfig::new(WIDTH).init(device),
                moe: Moe {
                    router: burn_linear(WIDTH, EXPERTS, salt + 0.5, device),
                    experts: (0..EXPERTS).map(expert).collect(),
                    shared: None,
                    first_expert: 0,
                    config: config.clone(),
                    expert_bias: vec![],
                },
            }
        };
        MoeLm {
            embed: nn::Embedding {
                weight: matrix(VOCAB, WIDTH, 0.7, device),
            },
            blocks: (0..2).map(block).collect(),
            out_norm: LayerNormConfig::new(WIDTH).init(device),
        }
    }

    /// The next-token loss and the experts' auxiliary losses: the pipeline's parts in a row.
    fn losses(&self, batch: &Batch) -> (Tensor<1>, Tensor<1>) {
        let mut x = self.embed(batch);
        let mut aux = vec![];
        for i in 0..self.blocks.len() {
            let (y, layer_aux) = self.layer_with_aux(i, x);
            x = y;
            aux.extend(layer_aux);
        }
        let aux = aux
            .into_iter()
            .reduce(|a, b| a + b)
            .expect("two MoE layers");
        (self.head_loss(x, batch), aux)
    }

    /// Next-token loss plus the experts' auxiliary losses.
    fn loss(&self, batch: &Batch) -> Tensor<1> {
        let (loss, aux) = self.losses(batch);
        loss + aux
    }
}

/// Inputs and next tokens, `[batch, SEQ]` each.
type Batch = (Tensor<2, Int>, Tensor<2, Int>);

impl PipelineModel for MoeLm {
    type Activation = Tensor<3>;
    type Batch = Batch;

    fn embed(&self, (inputs, _): &Batch) -> Tensor<3> {
        self.embed.forward(inputs.clone())
    }

    fn layer(&self, index: usize, x: Tensor<3>) -> Tensor<3> {
        self.layer_with_aux(index, x).0
    }

    fn layer_with_aux(&self, index: usize, x: Tensor<3>) -> (Tensor<3>, Option<Tensor<1>>) {
        let block = &self.blocks[index];
        let x = x.clone() + block.attention(block.attn_norm.forward(x));
        let (y, aux) = block.moe.forward(block.moe_norm.forward(x.clone()));
        (x + y, aux)
    }

    fn head_loss(&self, x: Tensor<3>, (_, targets): &Batch) -> Tensor<1> {
        let logits = self.embed.logits(self.out_norm.forward(x));
        self.embed.cross_entropy(logits, targets.clone())
    }
}

impl MoeBlock {
    fn attention(&self, x: Tensor<3>) -> Tensor<3> {
        let q = self.query.forward(x.clone());
        let [batch, seq, width] = q.dims();
        let heads = width / HEAD_DIM;
        let split = |y: Tensor<3>| y.reshape([batch, seq, heads, HEAD_DIM]).swap_dims(1, 2);
        let k = split(self.key.forward(x.clone()));
        let v = split(self.value.forward(x));
        let y = self.core.forward(split(q), k, v).swap_dims(1, 2);
        self.out.forward(y.reshape([batch, seq, width]))
    }
}

/// `[batch, SEQ + 1]` token sequences of samples `samples`, as inputs and next tokens.
fn batch(samples: std::ops::Range<usize>, device: &Device) -> Batch {
    let n = samples.len();
    let t: Vec<i64> = samples
        .flat_map(|s| (0..=SEQ).map(move |p| ((s * 5 + p * p + 2 * p) % VOCAB) as i64))
        .collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(t, [n, SEQ + 1]), device);
    (tokens.clone().narrow(1, 0, SEQ), tokens.narrow(1, 1, SEQ))
}

/// One device: the losses (next-token and auxiliary) and the final weights.
fn single_rank() -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let mut model = MoeLm::new(&device);
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
        let loss = model.loss(&batch(
            step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH,
            &device,
        ));
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    (losses, flatten_params(&model))
}

/// The loop under `plan` on `mesh`: rank 0's losses and the gathered weights; `in_units`: the
/// forward in `Parallelized::forward` (fully sharded blocks gathered a unit at a time).
fn parallel(
    mesh: &str,
    plan: &ParallelizePlan,
    in_units: bool,
) -> Result<(Vec<f32>, Vec<f32>), String> {
    let (losses, weights, _) = parallel_counting(mesh, plan, in_units)?;
    Ok((losses, weights))
}

/// [`parallel`], with the token rows rank 0's expert dispatch sent to other ranks after the
/// first step (which has no loads to choose hot experts from).
fn parallel_counting(
    mesh: &str,
    plan: &ParallelizePlan,
    in_units: bool,
) -> Result<(Vec<f32>, Vec<f32>, u64), String> {
    let out = Launch::new(mesh)
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (mut model, par) = parallelize(MoeLm::new(&device), plan, &ctx)?;
            let mut optim = AdamWConfig::new().init();
            let (mut losses, mut rows_sent) = (vec![], 0);
            let share = |(x, y): Batch| -> Batch {
                let share = |t| {
                    par.sequences()
                        .share(t, 1)
                        .expect("SEQ cuts into cp chunks")
                };
                (share(x), share(y))
            };
            for step in 0..STEPS {
                let grads = if plan.pipeline.is_some() {
                    let micro = |samples| share(batch(samples, &device));
                    let out =
                        par.pipeline()?
                            .step(&model, GLOBAL_BATCH, step, &micro, None, &ctx)?;
                    // The objective trained: the next-token loss and the auxiliary losses.
                    let values = out.scalars.read();
                    losses.push(values.loss + values.aux_loss);
                    out.grads
                } else {
                    let samples =
                        share(batch(par.data().batch_share(GLOBAL_BATCH, step)?, &device));
                    let loss = match in_units {
                        true => par.forward(&model, |m| m.loss(&samples))?,
                        false => model.loss(&samples),
                    };
                    losses.push(par.data().mean_loss(loss.clone().into_scalar::<f32>())?);
                    par.gradients(&model, loss.backward(), None, &ctx)?.0
                };
                model = optim.step(LR, model, grads);
                let sent = par.experts().rows_sent();
                rows_sent += if step > 0 { sent } else { 0 };
            }
            let weights = flatten_params(&par.sharded().whole(model)?);
            Ok::<_, ParallelError>((losses, weights, rows_sent))
        })
        .map_err(|e| e.to_string())?;
    Ok(out.into_iter().next().unwrap())
}

fn experts() -> ParallelizePlan {
    ParallelizePlan::new().expert_parallel("blocks.*.moe")
}

fn with_tp(plan: ParallelizePlan) -> ParallelizePlan {
    plan.tensor_parallel(TensorParallelRule::vocab(&["embed"]))
        .tensor_parallel(
            TensorParallelRule::colwise(&["blocks.*.query", "blocks.*.key", "blocks.*.value"])
                .in_units(HEAD_DIM),
        )
        .tensor_parallel(TensorParallelRule::rowwise(&["blocks.*.out"]).in_units(HEAD_DIM))
}

/// `plan` with sequence parallelism: the norms on tp's positions; the experts route the
/// gathered sequences.
fn sequence_parallel(plan: ParallelizePlan) -> ParallelizePlan {
    plan.sequence_parallel("blocks.*.attn_norm")
        .sequence_parallel("blocks.*.moe_norm")
        .sequence_parallel("out_norm")
}

fn with_cp(plan: ParallelizePlan) -> ParallelizePlan {
    plan.context_parallel(ContextParallelRule::ring(&["blocks.*.core"]))
}

/// `plan` with the blocks cut into stages (1F1B over two micro-batches), the token table
/// tied to the head.
fn pipelined(plan: ParallelizePlan) -> ParallelizePlan {
    plan.pipeline(
        PipelineRule::new("blocks", ScheduleKind::OneFOneB, 2)
            .first(&["embed"])
            .last(&["out_norm", "embed"]),
    )
}

#[test]
fn experts_spread_over_ep_by_a_plan_train_as_one_rank() {
    let reference = single_rank();
    for (mesh, plan) in [
        ("ep=2", experts()),
        ("ep=4", experts()),
        ("dp=2,ep=2", experts()),
        ("fsdp=2", experts().fully_shard("")),
        ("fsdp=2,ep=2", experts().fully_shard("")),
        ("ep=2,tp=2", with_tp(experts())),
        ("ep=2,tp=2", sequence_parallel(with_tp(experts()))),
        (
            "ep=2,tp=2,cp=2",
            with_cp(sequence_parallel(with_tp(experts()))),
        ),
        ("cp=2", with_cp(ParallelizePlan::new())),
        ("ep=2,cp=2", with_cp(experts())),
        ("fsdp=2,ep=2,cp=2", with_cp(experts()).fully_shard("")),
        ("pp=2,ep=2", pipelined(experts())),
        ("dp=2,pp=2", pipelined(experts())),
        (
            "pp=2,ep=2",
            pipelined(experts()).activation_checkpointing(CheckpointPolicy::Full),
        ),
        ("pp=2,ep=2,cp=2", with_cp(pipelined(experts()))),
        ("pp=2,fsdp=2", pipelined(experts()).fully_shard("")),
    ] {
        // Fully sharded layouts without a pipeline run both ways: per read and in units.
        let units = !plan.fully_shard.is_empty() && plan.pipeline.is_none();
        for in_units in [false, true].into_iter().take(1 + units as usize) {
            let run = parallel(mesh, &plan, in_units).unwrap_or_else(|e| panic!("{mesh}: {e}"));
            let what = match plan.pipeline {
                Some(_) => format!("{mesh} ({})", plan.activation_checkpointing),
                None => format!("{mesh} (units: {in_units})"),
            };
            assert_matches(&what, &run, &reference);
        }
    }
}

/// Hot-expert copies: each step's hottest experts (by the previous step's assignments) copied
/// to every ep rank, whose tokens for them stay home; the copies' gradients are summed over
/// ep and added to their owners'. The same training as one rank, fewer token rows sent.
#[test]
fn hot_experts_copied_by_a_plan_train_as_one_rank_with_fewer_rows_sent() {
    let reference = single_rank();
    for (mesh, plan) in [
        ("ep=4", experts()),
        ("dp=2,ep=2", experts()),
        ("ep=2,tp=2", sequence_parallel(with_tp(experts()))),
        ("pp=2,ep=2", pipelined(experts())),
        (
            "pp=2,ep=2",
            pipelined(experts()).activation_checkpointing(CheckpointPolicy::Full),
        ),
        ("pp=2,ep=2,cp=2", with_cp(pipelined(experts()))),
    ] {
        let (.., spread) = parallel_counting(mesh, &plan, false).unwrap();
        let what = format!("{mesh} ({})", plan.activation_checkpointing);
        let hot = plan.replicate_hot_experts(1);
        let (losses, weights, copied) =
            parallel_counting(mesh, &hot, false).unwrap_or_else(|e| panic!("{what}: {e}"));
        let what = format!("{what}, rows sent {copied} (uncopied {spread})");
        assert_matches(&what, &(losses, weights), &reference);
        assert!(
            copied < spread,
            "{what}: tokens for a copied expert stay on their rank: {copied} rows vs {spread}"
        );
    }
}

#[test]
fn hot_expert_copies_that_cannot_be_made_are_refused_with_the_reason() {
    let refusal = |mesh: &str, plan: ParallelizePlan| parallel(mesh, &plan, false).unwrap_err();
    let err = refusal("dp=2", ParallelizePlan::new().replicate_hot_experts(1));
    assert!(
        err.contains("replicate_hot_experts = 1") && err.contains("names none"),
        "{err}"
    );
    let err = refusal("ep=2", experts().replicate_hot_experts(5));
    assert!(
        err.contains("exceeds the 4 experts of `blocks.0.moe`"),
        "{err}"
    );
    let err = refusal(
        "fsdp=2,ep=2",
        experts().fully_shard("").replicate_hot_experts(1),
    );
    assert!(
        err.contains("fully_shard rule shards `blocks.0.moe.experts.0.w_gate.weight`"),
        "{err}"
    );
    // A backward that kept the copies' gradients from the plan: the step is refused.
    let err = Launch::new("ep=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let plan = experts().replicate_hot_experts(1);
            let (model, par) = parallelize(MoeLm::new(&device), &plan, &ctx)?;
            for step in 0..2 {
                let samples = batch(par.data().batch_share(GLOBAL_BATCH, step)?, &device);
                let grads = GradientsParams::from_grads(model.loss(&samples).backward(), &model);
                par.reduce_gradients(&model, grads, None, &ctx)?;
            }
            Ok::<_, ParallelError>(())
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("Parallelized::backward"), "{err}");
}

#[test]
fn routed_experts_are_sharded_over_fsdp_within_their_ep_rank() {
    // An expert's gate is [WIDTH, 6] whole: each of ep rank 0's two experts keeps half its
    // rows on each fsdp rank; the other ep rank's are one-element placeholders.
    let gates = Launch::new("fsdp=2,ep=2")
        .unwrap()
        .run(|ctx| {
            let plan = experts().fully_shard("");
            let (model, _) = parallelize(MoeLm::new(&Device::flex().autodiff()), &plan, &ctx)?;
            let experts = &model.blocks[0].moe.experts;
            Ok::<_, ParallelError>(
                experts
                    .iter()
                    .map(|e| e.w_gate.weight.base().dims())
                    .collect::<Vec<_>>(),
            )
        })
        .unwrap();
    assert_eq!(gates[0], [[WIDTH / 2, 6], [WIDTH / 2, 6], [1, 1], [1, 1]]);
}

#[test]
fn expert_parallel_plans_that_do_not_fit_are_refused_with_the_reason() {
    let err = parallel("ep=2", &ParallelizePlan::new(), false).unwrap_err();
    assert!(
        err.contains("ep=2") && err.contains("expert_parallel"),
        "{err}"
    );
    let err = parallel(
        "ep=2",
        &ParallelizePlan::new().expert_parallel("blocks.*.query"),
        false,
    )
    .unwrap_err();
    assert!(
        err.contains("`blocks.*.query`") && err.contains("names no mixture-of-experts layer"),
        "{err}"
    );
    let err = parallel("ep=8", &experts(), false).unwrap_err();
    assert!(
        err.contains("4 experts, which do not divide over ep = 8"),
        "{err}"
    );
}

/// A single mixture-of-experts layer of two experts (top 1) whose router reads the first two
/// features as the experts' scores: a token `[1, -1, ..]` goes to expert 0, `[-1, 1, ..]` to
/// expert 1.
#[derive(Module, Debug)]
struct Routed {
    moe: Moe,
}

impl Routed {
    fn new(device: &Device) -> Self {
        let mut router = vec![0.0; 4 * 2];
        (router[0], router[3]) = (1.0, 1.0);
        let expert = |salt: f32| SwiGlu {
            w_gate: burn_linear(4, 3, salt + 0.1, device).into(),
            w_up: burn_linear(4, 3, salt + 0.2, device).into(),
            w_down: burn_linear(3, 4, salt + 0.3, device).into(),
        };
        Routed {
            moe: Moe {
                router: Linear {
                    weight: Param::from_data(TensorData::new(router, [4, 2]), device),
                    bias: None,
                },
                experts: vec![expert(1.0), expert(2.0)],
                shared: None,
                first_expert: 0,
                config: MoeConfig::new(2, 1, 3),
                expert_bias: vec![],
            },
        }
    }

    /// The mean output plus the balancing loss.
    fn loss(&self, x: Tensor<3>) -> Tensor<1> {
        let (y, aux) = self.moe.forward(x);
        y.mean() + aux.expect("a balancing loss")
    }
}

/// Samples `range` of `[batch, 4 tokens, 4 features]`: samples 0 and 1 send every token to
/// expert 0, samples 2 and 3 half their tokens to each.
fn routed_batch(range: std::ops::Range<usize>, device: &Device) -> Tensor<3> {
    let n = range.len();
    let token = |s: usize, t: usize| {
        let to_one = s >= 2 && t % 2 == 1;
        let (a, b) = if to_one { (-1.0, 1.0) } else { (1.0, -1.0) };
        [a, b, 0.1 * (s + t) as f32, -0.2 * t as f32]
    };
    let values: Vec<f32> = range
        .flat_map(|s| (0..4).flat_map(move |t| token(s, t)))
        .collect();
    Tensor::from_data(TensorData::new(values, [n, 4, 4]), device)
}

/// At `dp=2,ep=2` and `fsdp=2,ep=2`, the samples of one `ep` group send every token to
/// expert 0, so its other rank runs no expert: the way back from the experts must still run
/// in backward there (the layer reads the data directly, so its input is not tracked), and
/// under `fsdp` the experts' gather too, whose rows that rank shares with a rank of the other
/// group that does run expert 1. Both once hung until the collective deadline.
#[test]
fn a_rank_whose_tokens_reach_none_of_its_experts_still_joins_their_collectives() {
    let device = Device::flex().autodiff();
    let mut reference = Routed::new(&device);
    let mut optim = AdamWConfig::new().init();
    for _ in 0..2 {
        let loss = reference.loss(routed_batch(0..4, &device));
        let grads = GradientsParams::from_grads(loss.backward(), &reference);
        reference = optim.step(LR, reference, grads);
    }
    let reference = flatten_params(&reference);
    let spread = ParallelizePlan::new().expert_parallel("moe");
    for (mesh, plan) in [
        ("dp=2,ep=2", spread.clone()),
        ("fsdp=2,ep=2", spread.fully_shard("")),
    ] {
        let weights = Launch::new(mesh)
            .unwrap()
            .timeout(std::time::Duration::from_secs(20))
            .run(|ctx| {
                let device = Device::flex().autodiff();
                let (mut model, par) = parallelize(Routed::new(&device), &plan, &ctx)?;
                let mut optim = AdamWConfig::new().init();
                for _ in 0..2 {
                    let loss = model.loss(routed_batch(par.data().batch_share(4, 0)?, &device));
                    let (grads, _) = par.gradients(&model, loss.backward(), None, &ctx)?;
                    model = optim.step(LR, model, grads);
                }
                Ok::<_, ParallelError>(flatten_params(&par.sharded().whole(model)?))
            })
            .unwrap_or_else(|e| panic!("{mesh}: {e}"));
        let diff = max_scaled(&weights[0], &reference);
        assert!(diff < 1e-5, "{mesh}: weights {diff:.2e} from one rank");
    }
}
