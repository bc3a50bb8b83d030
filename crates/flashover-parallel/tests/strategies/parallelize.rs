//! A user's own Burn models parallelized by a plan, against the same model's plain
//! single-rank Burn loop: losses, gradient norms (clipping active) and every weight within
//! 1e-5. The classifier has nothing from Flashover in it (fully sharded, data parallel); the
//! MLP declares its linear layers as `flashover_parallel::nn::Linear` (split over `tp`).

use crate::common::max_scaled;
pub(crate) use crate::plan_loops::{
    GLOBAL_BATCH, LR, MAX_NORM, Run, STEPS, differences, max_rel, plan_loop, plan_loop_on,
    reference_loop,
};
use burn::module::{Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{LayerNorm, LayerNormConfig, Linear};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover_parallel::activation_checkpointing::{CheckpointPolicy, checkpoint};
use flashover_parallel::data_parallel::{GradientBuckets, GradientRows};
use flashover_parallel::nn;
use flashover_parallel::parallelize::{
    ParallelizePlan, PipelineModel, PipelineRule, TensorParallelRule, parallelize,
};
use flashover_parallel::params::{ParamLayout, flatten_params};
use flashover_parallel::pipeline::ScheduleKind;
use flashover_parallel::zero::RowAdamW;
use flashover_parallel::{FlatAdamWConfig, ParallelError};
use flashover_runtime::{Axis, FaultPlan, Launch, OpKind};
use std::cell::RefCell;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const FEATURES: usize = 6;
/// Odd on purpose: the last layer's rows do not split evenly over two ranks.
const HIDDEN: usize = 15;
const CLASSES: usize = 5;

/// A model the tests train: deterministic weights, `[batch, FEATURES]` -> `[batch, CLASSES]`.
trait Net: Module + Sized {
    /// The same weights on every call (Burn's random init shares one generator between the
    /// rank threads; `parallelize` would make the ranks agree, but not with the reference).
    fn new(device: &Device) -> Self;
    fn forward(&self, x: Tensor<2>) -> Tensor<2>;
}

#[derive(Module, Debug)]
struct Classifier {
    input: Linear,
    norm: LayerNorm,
    hidden: Linear,
    head: Linear,
}

impl Net for Classifier {
    fn new(device: &Device) -> Self {
        Classifier {
            input: linear(FEATURES, HIDDEN, 0.1, device),
            norm: LayerNormConfig::new(HIDDEN).init(device),
            hidden: linear(HIDDEN, HIDDEN, 0.5, device),
            head: linear(HIDDEN, CLASSES, 0.9, device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self.norm.forward(gelu(self.input.forward(x)));
        self.head.forward(gelu(self.hidden.forward(h)))
    }
}

/// Two column-then-row pairs around a LayerNorm, the second pair without biases: the shape of
/// a transformer's MLP and attention projections.
#[derive(Module, Debug)]
struct SplitMlp {
    up: nn::Linear,
    down: nn::Linear,
    norm: LayerNorm,
    gate: nn::Linear,
    head: nn::Linear,
}

/// Widths of `SplitMlp`'s split layers: divisible by 2 and 4.
const WIDE: usize = 12;
const NARROW: usize = 8;

impl Net for SplitMlp {
    fn new(device: &Device) -> Self {
        let unbiased = |d_in, d_out, salt, device| nn::Linear {
            bias: None,
            ..linear(d_in, d_out, salt, device).into()
        };
        SplitMlp {
            up: linear(FEATURES, WIDE, 0.1, device).into(),
            down: linear(WIDE, HIDDEN, 0.5, device).into(),
            norm: LayerNormConfig::new(HIDDEN).init(device),
            gate: unbiased(HIDDEN, NARROW, 0.7, device),
            head: unbiased(NARROW, CLASSES, 0.9, device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self.down.forward(gelu(self.up.forward(x)));
        let h = self.norm.forward(h);
        self.head.forward(gelu(self.gate.forward(h)))
    }
}

/// `SplitMlp` with its first pair recomputed in backward by the user's own `checkpoint` call.
#[derive(Module, Debug)]
struct RecomputedMlp {
    pair: Pair,
    norm: LayerNorm,
    gate: nn::Linear,
    head: nn::Linear,
}

#[derive(Module, Debug)]
struct Pair {
    up: nn::Linear,
    down: nn::Linear,
}

impl Net for RecomputedMlp {
    fn new(device: &Device) -> Self {
        let SplitMlp {
            up,
            down,
            norm,
            gate,
            head,
        } = SplitMlp::new(device);
        RecomputedMlp {
            pair: Pair { up, down },
            norm,
            gate,
            head,
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = checkpoint(&self.pair, x, |p: &Pair, x| {
            p.down.forward(gelu(p.up.forward(x)))
        });
        let h = self.norm.forward(h);
        self.head.forward(gelu(self.gate.forward(h)))
    }
}

#[test]
fn a_users_own_checkpoint_call_recomputes_placed_parameters() {
    let reference = single_rank::<RecomputedMlp>();
    let plan = ParallelizePlan::new()
        .tensor_parallel(TensorParallelRule::colwise(&["pair.up", "gate"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["pair.down", "head"]))
        .fully_shard("");
    for mesh in ["fsdp=2", "tp=2", "fsdp=2,tp=2"] {
        let (run, _) = parallel::<RecomputedMlp>(mesh, plan.clone());
        let (loss, norm, weights) = differences(&run, &reference);
        assert!(
            loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
            "{mesh}: losses {loss:e}, norms {norm:e}, weights {weights:e}"
        );
    }
    // In units, with backward inside the scope too (as a burn-train TrainStep runs it): the
    // recomputed pair gathers its own parameters, in forward and again in backward.
    let (run, _) = plan_loop(
        "fsdp=2",
        &plan,
        RecomputedMlp::new,
        |model, par, step, ctx, device| {
            let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, step)?, device);
            let (loss, grads) = par.forward(model, |m| {
                let loss = loss(m, x, y);
                let grads = loss.backward();
                (loss, grads)
            })?;
            let mean = par.data().mean_loss(loss.into_scalar::<f32>())?;
            let (grads, norm) = par.gradients(model, grads, Some(MAX_NORM), ctx)?;
            Ok((grads, mean, norm.value()))
        },
    );
    let (loss, norm, weights) = differences(&run, &reference);
    assert!(
        loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
        "fsdp=2 in units: losses {loss:e}, norms {norm:e}, weights {weights:e}"
    );
}

/// Three column-wise layers reading one input, into a row-wise one: attention's shape.
#[derive(Module, Debug)]
struct SharedInput {
    query: nn::Linear,
    key: nn::Linear,
    value: nn::Linear,
    out: nn::Linear,
}

impl SharedInput {
    fn forward_with(&self, x: Tensor<2>, shared: bool) -> Tensor<2> {
        let [q, k, v] = if shared {
            nn::Linear::forward_shared([&self.query, &self.key, &self.value], x)
        } else {
            [&self.query, &self.key, &self.value].map(|l| l.forward(x.clone()))
        };
        self.out.forward(gelu(q) * k + v)
    }
}

impl Net for SharedInput {
    fn new(device: &Device) -> Self {
        SharedInput {
            query: linear(FEATURES, WIDE, 0.1, device).into(),
            key: linear(FEATURES, WIDE, 0.2, device).into(),
            value: linear(FEATURES, WIDE, 0.3, device).into(),
            out: linear(WIDE, CLASSES, 0.4, device).into(),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.forward_with(x, true)
    }
}

#[test]
fn column_wise_layers_sharing_an_input_enter_the_region_once() {
    let plan = ParallelizePlan::new()
        .tensor_parallel(TensorParallelRule::colwise(&["query", "key", "value"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["out"]));
    let reference = single_rank::<SharedInput>();
    for mesh in ["tp=2", "fsdp=2,tp=2"] {
        let plan = plan.clone().fully_shard("");
        let (run, _) = parallel::<SharedInput>(mesh, plan);
        let (loss, norm, weights) = differences(&run, &reference);
        assert!(
            loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
            "{mesh}: losses {loss:e}, norms {norm:e}, weights {weights:e}"
        );
    }
    // One step's collectives over tp: backward all-reduces x's gradient once per region entry,
    // forward all-reduces `out`'s partial products once.
    for (shared, expected) in [(false, 4), (true, 2)] {
        let calls = Launch::new("tp=2")
            .unwrap()
            .run(|ctx| {
                let device = Device::flex().autodiff();
                let (model, _) = parallelize(SharedInput::new(&device), &plan, &ctx)?;
                let tp = ctx.group(flashover_runtime::Axis::Tp);
                let before = tp.stats();
                let (x, y) = batch(0..GLOBAL_BATCH, &device);
                // An activation, as a normed hidden state is: its gradient is computed.
                let x = x.require_grad();
                let loss = CrossEntropyLossConfig::new()
                    .init(&device)
                    .forward(model.forward_with(x, shared), y);
                let _ = loss.backward();
                Ok::<_, ParallelError>(tp.stats().since(&before).total().calls)
            })
            .unwrap();
        assert_eq!(calls[0], expected, "shared {shared}");
    }
}

/// `SplitMlp`'s tensor-parallel plan: each pair split column-wise, then row-wise.
fn split_mlp_plan() -> ParallelizePlan {
    ParallelizePlan::new()
        .tensor_parallel(TensorParallelRule::colwise(&["up", "gate"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["down", "head"]))
}

/// A biased linear layer with deterministic weights.
fn linear(d_in: usize, d_out: usize, salt: f32, device: &Device) -> Linear {
    let values = |n: usize, k: f32| -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 * 0.37 + salt) * k).sin() * 0.4)
            .collect()
    };
    Linear {
        weight: Param::from_data(
            TensorData::new(values(d_in * d_out, 1.0), [d_in, d_out]),
            device,
        ),
        bias: Some(Param::from_data(
            TensorData::new(values(d_out, 1.7), [d_out]),
            device,
        )),
    }
}

/// Samples `range` of an endless deterministic data set.
pub(crate) fn batch(range: std::ops::Range<usize>, device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
    let n = range.len();
    let x: Vec<f32> = range
        .clone()
        .flat_map(|s| (0..FEATURES).map(move |f| ((s * 7 + f * 3) as f32 * 0.41).sin()))
        .collect();
    let y: Vec<i64> = range.map(|s| ((s * 5 + 2) % CLASSES) as i64).collect();
    (
        Tensor::from_data(TensorData::new(x, [n, FEATURES]), device),
        Tensor::from_data(TensorData::new(y, [n]), device),
    )
}

fn loss<M: Net>(model: &M, x: Tensor<2>, y: Tensor<1, Int>) -> Tensor<1> {
    CrossEntropyLossConfig::new()
        .init(&x.device())
        .forward(model.forward(x), y)
}

/// The plain Burn loop on one device, with global-norm clipping written out.
fn single_rank<M: Net>() -> Run {
    let device = Device::flex().autodiff();
    reference_loop(M::new(&device), |model, samples| {
        let (x, y) = batch(samples, &device);
        loss(model, x, y)
    })
}

/// The same loop under `plan` on `mesh`: rank 0's run, and every rank's stored parameter
/// elements.
fn parallel<M: Net>(mesh: &str, plan: ParallelizePlan) -> (Run, Vec<usize>) {
    plan_loop(mesh, &plan, M::new, |model, par, step, ctx, device| {
        let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, step)?, device);
        let loss = loss(model, x, y);
        let mean = par.data().mean_loss(loss.clone().into_scalar::<f32>())?;
        let (grads, norm) = par.gradients(model, loss.backward(), Some(MAX_NORM), ctx)?;
        Ok((grads, mean, norm.value()))
    })
}

#[test]
fn a_users_model_fully_sharded_by_a_plan_trains_as_one_rank() {
    let reference = single_rank::<Classifier>();
    assert!(
        reference.1.iter().filter(|n| **n > MAX_NORM).count() >= STEPS / 2,
        "clipping must be active: {:?}",
        reference.1
    );
    let whole = reference.2.len();
    let cases = [
        ("fsdp=2", ParallelizePlan::new().fully_shard("")),
        ("dp=2,fsdp=2", ParallelizePlan::new().fully_shard("")),
        (
            "fsdp=2",
            ParallelizePlan::new()
                .fully_shard("hidden")
                .fully_shard("head"),
        ),
        ("dp=4", ParallelizePlan::new()),
        ("fsdp=4", ParallelizePlan::new().fully_shard("")),
    ];
    for (mesh, plan) in cases {
        let (run, held) = parallel::<Classifier>(mesh, plan.clone());
        let (loss, norm, weights) = (
            max_rel(&run.0, &reference.0),
            max_rel(&run.1, &reference.1),
            max_rel(&run.2, &reference.2),
        );
        assert!(
            loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
            "{mesh} {plan:?}: losses {loss:e}, norms {norm:e}, weights {weights:e}"
        );
        // What each rank stores: whole parameters outside the plan's paths, its rows inside.
        if plan == ParallelizePlan::new().fully_shard("") {
            let fsdp: usize = mesh
                .split(',')
                .find_map(|a| a.strip_prefix("fsdp="))
                .unwrap()
                .parse()
                .unwrap();
            // Each parameter's rows split over fsdp, the last ranks padded to equal shares.
            let shards: usize = ParamLayout::of(&Classifier::new(&Device::flex()))
                .slots
                .iter()
                .map(|s| s.shape[0].div_ceil(fsdp) * s.numel / s.shape[0])
                .sum();
            assert!(
                held.iter().all(|h| *h == shards),
                "{mesh}: {held:?} vs {shards}"
            );
            assert!(
                shards * fsdp < whole * 6 / 5,
                "{shards} x {fsdp} vs {whole}"
            );
        } else if plan.fully_shard.is_empty() {
            assert!(held.iter().all(|h| *h == whole));
        } else {
            assert!(
                held.iter().all(|h| *h < whole && *h > whole / 2),
                "{held:?}"
            );
        }
    }
}

#[test]
fn a_models_linear_layers_split_over_tp_by_a_plan_train_as_one_rank() {
    let reference = single_rank::<SplitMlp>();
    assert!(
        reference.1.iter().filter(|n| **n > MAX_NORM).count() >= STEPS / 2,
        "clipping must be active: {:?}",
        reference.1
    );
    // SplitMlp's parameters: shape, and the dimension the plan splits over tp.
    let params: [(&[usize], Option<usize>); 8] = [
        (&[FEATURES, WIDE], Some(1)), // up: columns
        (&[WIDE], Some(0)),           // up's bias, with its columns
        (&[WIDE, HIDDEN], Some(0)),   // down: rows
        (&[HIDDEN], None),            // down's bias: whole, added after the sum
        (&[HIDDEN], None),            // norm
        (&[HIDDEN], None),
        (&[HIDDEN, NARROW], Some(1)),  // gate: columns
        (&[NARROW, CLASSES], Some(0)), // head: rows
    ];
    let stored = |tp: usize, fsdp: usize| -> usize {
        params
            .iter()
            .map(|(shape, dim)| {
                let mut local = shape.to_vec();
                if let Some(d) = dim {
                    local[*d] /= tp;
                }
                local[0] = local[0].div_ceil(fsdp);
                local.iter().product::<usize>()
            })
            .sum()
    };
    assert_eq!(stored(1, 1), reference.2.len());
    let cases = [
        ("tp=2", split_mlp_plan(), 2, 1),
        ("tp=4", split_mlp_plan(), 4, 1),
        ("dp=2,tp=2", split_mlp_plan(), 2, 1),
        ("fsdp=2,tp=2", split_mlp_plan().fully_shard(""), 2, 2),
        ("dp=2,fsdp=2,tp=2", split_mlp_plan().fully_shard(""), 2, 2),
    ];
    for (mesh, plan, tp, fsdp) in cases {
        let (run, held) = parallel::<SplitMlp>(mesh, plan.clone());
        let (loss, norm, weights) = differences(&run, &reference);
        assert!(
            loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
            "{mesh}: losses {loss:e}, norms {norm:e}, weights {weights:e}"
        );
        assert!(
            held.iter().all(|h| *h == stored(tp, fsdp)),
            "{mesh}: stored {held:?}, expected {}",
            stored(tp, fsdp)
        );
    }
}

/// A residual stack for pipelines: an input projection whose weight is also the output
/// head (tied, as an embedding and LM head are), four layers (LayerNorm, a column-then-row
/// pair), a final norm.
#[derive(Module, Debug)]
pub(crate) struct Stack {
    input: nn::Linear,
    pub(crate) layers: Vec<StackLayer>,
    norm: LayerNorm,
}

#[derive(Module, Debug)]
pub(crate) struct StackLayer {
    norm: LayerNorm,
    pub(crate) up: nn::Linear,
    down: nn::Linear,
}

const LAYERS: usize = 4;

impl Stack {
    pub(crate) fn new(device: &Device) -> Self {
        let layer = |i: usize| StackLayer {
            norm: LayerNormConfig::new(NARROW).init(device),
            up: linear(NARROW, WIDE, 0.3 + i as f32, device).into(),
            down: linear(WIDE, NARROW, 0.6 + i as f32, device).into(),
        };
        Stack {
            input: linear(FEATURES, NARROW, 0.2, device).into(),
            layers: (0..LAYERS).map(layer).collect(),
            norm: LayerNormConfig::new(NARROW).init(device),
        }
    }

    /// The single-device loss: the pipeline's three parts in a row.
    pub(crate) fn loss(&self, batch: &(Tensor<2>, Tensor<1, Int>)) -> Tensor<1> {
        let x = (0..LAYERS).fold(self.embed(batch), |x, i| self.layer(i, x));
        self.head_loss(x, batch)
    }

    /// [`Stack::loss`] with each layer's forward checkpointed: run again in backward.
    pub(crate) fn loss_recomputed(&self, batch: &(Tensor<2>, Tensor<1, Int>)) -> Tensor<1> {
        let x = self.layers.iter().fold(self.embed(batch), |x, layer| {
            checkpoint(layer, x, |l: &StackLayer, x| l.forward(x))
        });
        self.head_loss(x, batch)
    }
}

impl StackLayer {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        x.clone()
            + self
                .down
                .forward(gelu(self.up.forward(self.norm.forward(x))))
    }
}

impl PipelineModel for Stack {
    type Activation = Tensor<2>;
    type Batch = (Tensor<2>, Tensor<1, Int>);

    fn embed(&self, (x, _): &Self::Batch) -> Tensor<2> {
        self.input.forward(x.clone())
    }

    fn layer(&self, index: usize, x: Tensor<2>) -> Tensor<2> {
        self.layers[index].forward(x)
    }

    fn head_loss(&self, x: Tensor<2>, (_, y): &Self::Batch) -> Tensor<1> {
        // The input projection transposed: logits over FEATURES >= CLASSES classes.
        let logits = self
            .norm
            .forward(x)
            .matmul(self.input.weight.val().transpose());
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, y.clone())
    }
}

/// `Stack`'s plain single-rank loop.
pub(crate) fn stack_single_rank() -> Run {
    let device = Device::flex().autodiff();
    reference_loop(Stack::new(&device), |model, samples| {
        model.loss(&batch(samples, &device))
    })
}

/// `Stack` under a pipelined `plan` on `mesh`: rank 0's run, every rank's stored elements and
/// the layer forwards each rank ran again in backward.
fn stack_pipelined(mesh: &str, plan: ParallelizePlan) -> (Run, Vec<usize>, Vec<usize>) {
    stack_pipelined_on(mesh, plan, || Device::flex().autodiff())
}

/// [`stack_pipelined`] with the model on the autodiff device `device` makes (the inputs cast
/// to the plan's compute dtype).
pub(crate) fn stack_pipelined_on(
    mesh: &str,
    plan: ParallelizePlan,
    device: impl Fn() -> Device + Sync,
) -> (Run, Vec<usize>, Vec<usize>) {
    let out = Launch::new(mesh)
        .unwrap()
        .run(|ctx| {
            let device = device();
            let (mut model, par) = parallelize(Stack::new(&device), &plan, &ctx)?;
            let held = ParamLayout::of(&model).numel;
            let mut optim = AdamWConfig::new().init();
            let (mut losses, mut norms, mut recomputed) = (vec![], vec![], 0);
            let dtype = par.precision().policy().param_dtype.float_dtype();
            let micro_batch = |samples| {
                let (x, y) = batch(samples, &device);
                (x.cast(dtype), y)
            };
            for step in 0..STEPS {
                let out = par.pipeline()?.step(
                    &model,
                    GLOBAL_BATCH,
                    step,
                    &micro_batch,
                    Some(MAX_NORM),
                    &ctx,
                )?;
                let values = out.scalars.read();
                losses.push(values.loss);
                norms.push(values.norm);
                recomputed += out.recomputed;
                model = optim.step(LR, model, out.grads);
            }
            let whole = flatten_params(&par.sharded().whole(model)?);
            Ok::<_, ParallelError>(((losses, norms, whole), held, recomputed))
        })
        .unwrap();
    let held = out.iter().map(|(_, h, _)| *h).collect();
    let recomputed = out.iter().map(|(_, _, r)| *r).collect();
    (out.into_iter().next().unwrap().0, held, recomputed)
}

#[test]
fn a_models_layers_cut_into_pipeline_stages_by_a_plan_train_as_one_rank() {
    let reference = stack_single_rank();
    assert!(
        reference.1.iter().filter(|n| **n > MAX_NORM).count() >= STEPS / 2,
        "clipping must be active: {:?}",
        reference.1
    );
    let whole = reference.2.len();
    let rule = |kind, micro| {
        PipelineRule::new("layers", kind, micro)
            .first(&["input"])
            .last(&["norm", "input"])
    };
    let plan = |rule| ParallelizePlan::new().pipeline(rule);
    let split = |rule| {
        plan(rule)
            .tensor_parallel(TensorParallelRule::colwise(&["layers.*.up"]))
            .tensor_parallel(TensorParallelRule::rowwise(&["layers.*.down"]))
            .fully_shard("")
    };
    let cases = [
        ("pp=2", plan(rule(ScheduleKind::OneFOneB, 4))),
        ("pp=2", plan(rule(ScheduleKind::GPipe, 2))),
        ("pp=4", plan(rule(ScheduleKind::OneFOneB, 4))),
        ("dp=2,pp=2", plan(rule(ScheduleKind::OneFOneB, 4))),
        (
            "pp=2",
            plan(rule(ScheduleKind::Interleaved1F1B, 4).chunks(2)),
        ),
        ("pp=1", plan(rule(ScheduleKind::OneFOneB, 2))),
        ("fsdp=2,tp=2,pp=2", split(rule(ScheduleKind::OneFOneB, 2))),
        // Zero-bubble: the layers' nn::Linear weight gradients wait for the weight actions
        // (a step that deferred none is refused, so passing means they were deferred).
        ("pp=2", plan(rule(ScheduleKind::ZeroBubbleH1, 4))),
        // Recomputed layers defer their weight gradients in the backward that reruns them.
        (
            "pp=2",
            plan(rule(ScheduleKind::ZeroBubbleH1, 4))
                .activation_checkpointing(CheckpointPolicy::Full),
        ),
        (
            "dp=2,tp=2,pp=2",
            plan(rule(ScheduleKind::ZeroBubbleH1, 2))
                .tensor_parallel(TensorParallelRule::colwise(&["layers.*.up"]))
                .tensor_parallel(TensorParallelRule::rowwise(&["layers.*.down"])),
        ),
    ];
    for (mesh, plan) in cases {
        let (run, held, _) = stack_pipelined(mesh, plan.clone());
        let (loss, norm, weights) = differences(&run, &reference);
        let schedule = plan.pipeline.as_ref().unwrap().schedule;
        assert!(
            loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
            "{mesh} {schedule}: losses {loss:e}, norms {norm:e}, weights {weights:e}"
        );
        if mesh != "pp=1" {
            assert!(
                held.iter().all(|h| *h < whole * 3 / 4),
                "{mesh} {schedule}: every rank holds only its stages: {held:?} of {whole}"
            );
        }
    }
}

/// ZeRO-1/2 (and ZeRO-3 by rows) of a user's model: the plan reduces the gradients to each
/// rank's rows (`gradient_buckets.rows`: all-reduced or reduce-scattered buckets) and the
/// library's `RowAdamW` steps AdamW on those rows, then gathers them back.
#[test]
fn a_users_model_stepped_by_rows_trains_as_one_rank() {
    let reference = stack_single_rank();
    let rule = PipelineRule::new("layers", ScheduleKind::OneFOneB, 2)
        .first(&["input"])
        .last(&["norm", "input"]);
    let cases = [
        ("fsdp=2", GradientRows::AllReduce, true),
        ("dp=2", GradientRows::ReduceScatter, true),
        ("fsdp=2,pp=2", GradientRows::ReduceScatter, true),
        ("dp=2,fsdp=2", GradientRows::ReduceScatter, false),
    ];
    for (mesh, rows, keep_params) in cases {
        let buckets = GradientBuckets::default().rows(rows);
        let plan = ParallelizePlan::new()
            .pipeline(rule.clone())
            .gradient_buckets(buckets);
        let out = Launch::new(mesh)
            .unwrap()
            .run(|ctx| {
                let device = Device::flex().autodiff();
                let (model, par) = parallelize(Stack::new(&device), &plan, &ctx)?;
                let config = FlatAdamWConfig::new();
                let mut optim = RowAdamW::new(&par, &model, &config, keep_params, &ctx)?;
                let mut model = optim.between_steps(model);
                let micro_batch = |samples| batch(samples, &device);
                let (mut losses, mut norms) = (vec![], vec![]);
                for step in 0..STEPS {
                    model = optim.for_step(model)?;
                    let out = par.pipeline()?.step(
                        &model,
                        GLOBAL_BATCH,
                        step,
                        &micro_batch,
                        Some(MAX_NORM),
                        &ctx,
                    )?;
                    assert!(out.grads.is_empty(), "rows come in `rows`, not `grads`");
                    let values = out.scalars.read();
                    losses.push(values.loss);
                    norms.push(values.norm);
                    model = optim.step(LR, model, out.rows, !out.skipped)?;
                }
                let whole = flatten_params(&par.sharded().whole(optim.for_step(model)?)?);
                let (params, moments) = optim.held_elements();
                Ok::<_, ParallelError>(((losses, norms, whole), params, moments))
            })
            .unwrap();
        let whole = reference.2.len();
        let (run, params, moments) = out.into_iter().next().unwrap();
        let (loss, norm, weights) = differences(&run, &reference);
        assert!(
            loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
            "{mesh} {rows:?}: losses {loss:e}, norms {norm:e}, weights {weights:e}"
        );
        // Each rank steps (and keeps moments of) only its rows; ZeRO-3 by rows keeps no more.
        assert!(
            moments < whole * 3 / 4,
            "{mesh}: moments of {moments} of {whole} elements"
        );
        if !keep_params {
            assert_eq!(
                params, moments,
                "{mesh}: ZeRO-3 by rows keeps only its rows"
            );
        }
    }
}

/// ZeRO-1/2 in a loop of one's own: `Parallelized::row_gradients` hands each rank its rows of
/// the reduced gradients and `RowAdamW` steps them.
#[test]
fn a_users_own_loop_stepped_by_rows_trains_as_one_rank() {
    let reference = single_rank::<SplitMlp>();
    let cases = [
        ("dp=2", GradientRows::AllReduce),
        ("fsdp=2", GradientRows::ReduceScatter),
        ("dp=2,fsdp=2", GradientRows::ReduceScatter),
        ("fsdp=2,tp=2", GradientRows::ReduceScatter),
    ];
    for (mesh, rows) in cases {
        let plan = split_mlp_plan().gradient_buckets(GradientBuckets::default().rows(rows));
        let run = Launch::new(mesh)
            .unwrap()
            .run(|ctx| {
                let device = Device::flex().autodiff();
                let (model, par) = parallelize(SplitMlp::new(&device), &plan, &ctx)?;
                let config = FlatAdamWConfig::new();
                let mut optim = RowAdamW::new(&par, &model, &config, true, &ctx)?;
                let mut model = optim.between_steps(model);
                let (mut losses, mut norms) = (vec![], vec![]);
                for step in 0..STEPS {
                    model = optim.for_step(model)?;
                    let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, step)?, &device);
                    let loss = par.forward(&model, |m| loss(m, x, y))?;
                    losses.push(par.data().mean_loss(loss.clone().into_scalar::<f32>())?);
                    let (rows, norm) =
                        par.row_gradients(&model, par.backward(loss), Some(MAX_NORM), &ctx)?;
                    norms.push(norm.value());
                    let update = rows.dims()[0] > 0;
                    model = optim.step(LR, model, rows, update)?;
                }
                // Whole gradients are refused while the plan keeps rows, with what to call.
                let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, 0)?, &device);
                let loss = par.forward(&model, |m| loss(m, x, y))?;
                let refused = par
                    .gradients(&model, par.backward(loss), None, &ctx)
                    .unwrap_err()
                    .to_string();
                assert!(refused.contains("row_gradients"), "{refused}");
                let whole = flatten_params(&par.sharded().whole(model)?);
                Ok::<_, ParallelError>((losses, norms, whole))
            })
            .unwrap()
            .into_iter()
            .next()
            .unwrap();
        let (loss, norm, weights) = differences(&run, &reference);
        assert!(
            loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
            "{mesh} {rows:?}: losses {loss:e}, norms {norm:e}, weights {weights:e}"
        );
    }
}

#[test]
fn a_plan_cuts_layers_unevenly_where_it_says_how_many_each_stage_runs() {
    let reference = stack_single_rank();
    let rule = PipelineRule::new("layers", ScheduleKind::OneFOneB, 4)
        .first(&["input"])
        .last(&["norm", "input"]);
    let even = ParallelizePlan::new().pipeline(rule.clone());
    let uneven = ParallelizePlan::new().pipeline(rule.clone().layers_per_stage(&[1, 3]));
    let (run, held, _) = stack_pipelined("pp=2", uneven);
    let (loss, norm, weights) = differences(&run, &reference);
    assert!(
        loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
        "layers 1 + 3: losses {loss:e}, norms {norm:e}, weights {weights:e}"
    );
    // The cut took effect: the last stage holds a layer more than under the even cut, the
    // first one fewer (a layer another rank holds is a one-element placeholder per parameter).
    let (_, even_held, _) = stack_pipelined("pp=2", even);
    let layer = {
        let layout = ParamLayout::of(&Stack::new(&Device::flex()).layers[0]);
        layout.numel - layout.slots.len()
    };
    assert_eq!(held[0] + layer, even_held[0], "{held:?} vs {even_held:?}");
    assert_eq!(held[1], even_held[1] + layer, "{held:?} vs {even_held:?}");
    // Interleaved: 4 stages over 2 ranks, rank 0 running stages 0 and 2.
    let interleaved = ParallelizePlan::new().pipeline(
        PipelineRule::new("layers", ScheduleKind::Interleaved1F1B, 4)
            .chunks(2)
            .layers_per_stage(&[1, 1, 1, 1])
            .first(&["input"])
            .last(&["norm", "input"]),
    );
    let (run, _, _) = stack_pipelined("pp=2", interleaved);
    let (loss, norm, weights) = differences(&run, &reference);
    assert!(
        loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
        "interleaved 1 each: losses {loss:e}, norms {norm:e}, weights {weights:e}"
    );
}

#[test]
fn layers_a_plan_recomputes_in_backward_train_as_one_rank() {
    let reference = stack_single_rank();
    let rule = |micro| {
        PipelineRule::new("layers", ScheduleKind::OneFOneB, micro)
            .first(&["input"])
            .last(&["norm", "input"])
    };
    let split = ParallelizePlan::new()
        .tensor_parallel(TensorParallelRule::colwise(&["layers.*.up"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["layers.*.down"]))
        .fully_shard("");
    let policy = |p: &str| p.parse::<CheckpointPolicy>().unwrap();
    // (mesh, plan, layer forwards each rank runs again per step)
    let cases = [
        // 2 layers per stage x 4 micro-batches.
        (
            "pp=2",
            ParallelizePlan::new().pipeline(rule(4)),
            policy("full"),
            8,
        ),
        // Layers 0 and 2 of the 4, each over 2 micro-batches, on every rank.
        (
            "dp=2",
            ParallelizePlan::new().pipeline(rule(2)),
            policy("every:2"),
            4,
        ),
        (
            "fsdp=2,tp=2",
            split.clone().pipeline(rule(2)),
            policy("blocks:3"),
            2,
        ),
        (
            "fsdp=2,tp=2,pp=2",
            split.pipeline(rule(2)),
            policy("full"),
            4,
        ),
    ];
    // Burn's balanced checkpointing: a property of the model's device, which the step uses.
    let selective = || Device::flex().autodiff().gradient_checkpointing();
    let (run, _, _) =
        stack_pipelined_on("pp=2", ParallelizePlan::new().pipeline(rule(4)), selective);
    let (loss, norm, weights) = differences(&run, &reference);
    assert!(
        loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
        "pp=2 selective: losses {loss:e}, norms {norm:e}, weights {weights:e}"
    );
    for (mesh, plan, policy, per_step) in cases {
        let plan = plan.activation_checkpointing(policy.clone());
        let (run, _, recomputed) = stack_pipelined(mesh, plan);
        let (loss, norm, weights) = differences(&run, &reference);
        assert!(
            loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
            "{mesh} {policy}: losses {loss:e}, norms {norm:e}, weights {weights:e}"
        );
        assert!(
            recomputed.iter().all(|r| *r == per_step * STEPS),
            "{mesh} {policy}: layers recomputed per rank {recomputed:?}, expected {}",
            per_step * STEPS
        );
    }
}

#[test]
fn a_pipelines_fully_sharded_layers_gather_once_per_layer() {
    // The stack at fsdp=2 with a pipeline rule (on a mesh without pp): its layers are units.
    let plan = ParallelizePlan::new().fully_shard("").pipeline(
        PipelineRule::new("layers", ScheduleKind::OneFOneB, 2)
            .first(&["input"])
            .last(&["norm", "input"]),
    );
    let recomputed = plan
        .clone()
        .activation_checkpointing(CheckpointPolicy::Full);
    let step_counts = |plan: &ParallelizePlan| {
        Launch::new("fsdp=2")
            .unwrap()
            .run(|ctx| {
                let device = Device::flex().autodiff();
                let (model, par) = parallelize(Stack::new(&device), plan, &ctx)?;
                let fsdp = ctx.group(flashover_runtime::Axis::Fsdp);
                let micro_batch = |samples| batch(samples, &device);
                // The first step also runs the first stage's embed once, to learn the shape.
                par.pipeline()?
                    .step(&model, GLOBAL_BATCH, 0, &micro_batch, None, &ctx)?;
                let before = fsdp.stats();
                let prefetches = par
                    .sharded()
                    .unit_stats()
                    .expect("sharded")
                    .snapshot()
                    .prefetches;
                par.pipeline()?
                    .step(&model, GLOBAL_BATCH, 1, &micro_batch, None, &ctx)?;
                let ops = fsdp.stats().since(&before).ops;
                let calls = |op| ops.get(&op).map_or(0, |s| s.calls);
                let prefetched =
                    par.sharded().unit_stats().unwrap().snapshot().prefetches - prefetches;
                let counts = (calls(OpKind::AllGather), calls(OpKind::ReduceScatter));
                Ok::<_, ParallelError>((counts, prefetched))
            })
            .unwrap()
            .remove(0)
    };
    // Per micro-batch (2): one all-gather per layer (4; each has 6 parameters, which read one by
    // one would make 24), each but the first submitted while the layer before computes, and
    // one for the parameters outside the layers (the root unit: the input projection's weight
    // and bias, the final norm's two parameters, the tied head's weight, which read one by one
    // would make 5). The reduce-scatters pair with them.
    let (layers, root) = (LAYERS as u64, 1);
    let expected = 2 * (layers + root);
    let forward_prefetches = 2 * (LAYERS - 1);
    assert_eq!(
        step_counts(&plan),
        ((expected, expected), forward_prefetches)
    );
    // Recomputed layers gather again in backward, each rerun prefetching the layer that reruns
    // after it, and their gradients are reduce-scattered from the rerun only.
    let gathers = 2 * (2 * layers + root);
    assert_eq!(
        step_counts(&recomputed),
        ((gathers, expected), 2 * forward_prefetches)
    );
}

/// `Stack` parallelized by `plan` on each of `meshes`, its `loss` run inside
/// `Parallelized::forward` (units), against its plain one-rank loop within 1e-5.
fn units_train_as_one_rank(
    plan: &ParallelizePlan,
    meshes: &[&str],
    loss: fn(&Stack, &(Tensor<2>, Tensor<1, Int>)) -> Tensor<1>,
) {
    units_train_as_one_rank_on(&Device::flex().autodiff(), plan, meshes, loss)
}

/// [`units_train_as_one_rank`] with the model on `device` (an autodiff device).
fn units_train_as_one_rank_on(
    device: &Device,
    plan: &ParallelizePlan,
    meshes: &[&str],
    loss: fn(&Stack, &(Tensor<2>, Tensor<1, Int>)) -> Tensor<1>,
) {
    let reference = stack_single_rank();
    for mesh in meshes {
        let (run, _) = plan_loop_on(
            device,
            mesh,
            plan,
            Stack::new,
            |model, par, step, ctx, device| {
                let samples = par.data().batch_share(GLOBAL_BATCH, step)?;
                let loss = par.forward(model, |m| loss(m, &batch(samples, device)))?;
                let mean = par.data().mean_loss(loss.clone().into_scalar::<f32>())?;
                let (grads, norm) = par.gradients(model, loss.backward(), Some(MAX_NORM), ctx)?;
                Ok((grads, mean, norm.value()))
            },
        );
        let (loss, norm, weights) = differences(&run, &reference);
        assert!(
            loss < 1e-5 && norm < 1e-5 && weights < 1e-5,
            "{mesh}: losses {loss:e}, norms {norm:e}, weights {weights:e}"
        );
    }
}

#[test]
fn fully_sharded_units_train_as_one_rank_with_one_gather_each() {
    // `fully_shard("")` on the stack: each of its layers is a unit, the rest (the input
    // projection, tied as the head, and the final norm) one more.
    let plan = ParallelizePlan::new().fully_shard("");
    units_train_as_one_rank(&plan, &["fsdp=2", "dp=2,fsdp=2", "fsdp=4"], Stack::loss);
    let counts = Launch::new("fsdp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (model, par) = parallelize(Stack::new(&device), &plan, &ctx)?;
            assert_eq!(
                par.sharded().units(),
                ["", "layers.0", "layers.1", "layers.2", "layers.3"]
            );
            let fsdp = ctx.group(Axis::Fsdp);
            let calls = |before: &_| {
                let ops = fsdp.stats().since(before).ops;
                let calls = |op| ops.get(&op).map_or(0, |s| s.calls);
                (calls(OpKind::AllGather), calls(OpKind::ReduceScatter))
            };
            let units = par.sharded().unit_stats().expect("sharded over fsdp=2");
            let (before, prefetches) = (fsdp.stats(), units.snapshot().prefetches);
            let loss = par.forward(&model, |m| m.loss(&batch(0..4, &device)))?;
            let _ = loss.backward();
            let in_units = calls(&before);
            let prefetched = units.snapshot().prefetches - prefetches;
            // The same step with each parameter gathered where it is read.
            let before = fsdp.stats();
            let _ = model.loss(&batch(0..4, &device)).backward();
            Ok::<_, ParallelError>((in_units, prefetched, calls(&before)))
        })
        .unwrap();
    // One all-gather per unit (5), all but the first prefetched, one reduce-scatter each;
    // read one by one: the input projection's two parameters, six per layer, the final
    // norm's two and the tied head's weight again.
    let per_read = 2 + 6 * LAYERS as u64 + 2 + 1;
    for (in_units, prefetched, read_one_by_one) in counts {
        assert_eq!(in_units, (LAYERS as u64 + 1, LAYERS as u64 + 1));
        assert_eq!(prefetched, LAYERS);
        assert_eq!(read_one_by_one, (per_read, per_read));
    }
}

#[test]
fn checkpointed_units_reshard_after_forward_and_gather_again_in_backward() {
    // Each layer's forward checkpointed inside the scope: FSDP's reshard_after_forward.
    let plan = ParallelizePlan::new().fully_shard("");
    units_train_as_one_rank(&plan, &["fsdp=2", "dp=2,fsdp=2"], Stack::loss_recomputed);
    let counts = Launch::new("fsdp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (model, par) = parallelize(Stack::new(&device), &plan, &ctx)?;
            let fsdp = ctx.group(Axis::Fsdp);
            let units = par.sharded().unit_stats().expect("sharded over fsdp=2");
            let step = |recompute: bool| {
                let (before, counts) = (fsdp.stats(), units.snapshot());
                units.reset_peak();
                let x = batch(0..4, &device);
                let loss = par.forward(&model, |m| match recompute {
                    true => m.loss_recomputed(&x),
                    false => m.loss(&x),
                })?;
                let after_forward = units.snapshot();
                let _ = loss.backward();
                let ops = fsdp.stats().since(&before).ops;
                let calls = |op| ops.get(&op).map_or(0, |s| s.calls);
                let after = units.snapshot();
                Ok::<_, ParallelError>((
                    (calls(OpKind::AllGather), calls(OpKind::ReduceScatter)),
                    after.prefetches - counts.prefetches,
                    (after_forward.live_bytes, after_forward.peak_bytes),
                    after.live_bytes,
                ))
            };
            Ok::<_, ParallelError>((step(false)?, step(true)?))
        })
        .unwrap();
    let (layers, units) = (LAYERS as u64, LAYERS as u64 + 1);
    for (kept, resharded) in counts {
        // Kept: one all-gather per unit, all but the first prefetched. Resharded: each layer
        // gathered again in backward, each rerun but the first prefetched by the one after
        // it, its gradients reduce-scattered from the rerun only.
        assert_eq!((kept.0, kept.1), ((units, units), LAYERS));
        assert_eq!(
            (resharded.0, resharded.1),
            ((units + layers, units), 2 * LAYERS - 1)
        );
        // Gathered bytes (both ranks' rows of each parameter, f32): the root unit holds the
        // input projection's 3 rows of 8 and 4 of its bias, and the final norm's 4 + 4; a
        // layer its norm's 4 + 4, `up`'s 4 rows of 12 and 6 of its bias, `down`'s 6 rows of 8
        // and 4 of its bias.
        let (root, layer) = (
            2 * 4 * (3 * 8 + 4 + 4 + 4),
            2 * 4 * (4 + 4 + 4 * 12 + 6 + 6 * 8 + 4),
        );
        // After forward, kept units hold every layer gathered; resharded ones only the root,
        // having held at most one layer besides it and the next one's prefetch.
        assert_eq!(kept.2, (root + LAYERS * layer, root + LAYERS * layer));
        assert_eq!(resharded.2, (root, root + 2 * layer));
        // Everything gathered is released by the end of backward.
        assert_eq!((kept.3, resharded.3), (0, 0));
    }
}

#[test]
fn units_under_balanced_checkpointing_gather_again_in_backward_without_recomputing() {
    // On a device with Burn's balanced gradient checkpointing no backward state keeps a
    // unit's gathered parameters: the backward ops that need them gather the unit again.
    let device = Device::flex().autodiff().gradient_checkpointing();
    let plan = ParallelizePlan::new().fully_shard("");
    let meshes = ["fsdp=2", "dp=2,fsdp=2", "fsdp=4"];
    units_train_as_one_rank_on(&device, &plan, &meshes, Stack::loss);
    let counts = Launch::new("fsdp=2")
        .unwrap()
        .run(|ctx| {
            let (model, par) = parallelize(Stack::new(&device), &plan, &ctx)?;
            let fsdp = ctx.group(Axis::Fsdp);
            let units = par.sharded().unit_stats().expect("sharded over fsdp=2");
            let (before, prefetches) = (fsdp.stats(), units.snapshot().prefetches);
            let loss = par.forward(&model, |m| m.loss(&batch(0..4, &device)))?;
            let after_forward = units.snapshot();
            units.reset_peak();
            let _ = loss.backward();
            let ops = fsdp.stats().since(&before).ops;
            let calls = |op| ops.get(&op).map_or(0, |s| s.calls);
            let gathers = (calls(OpKind::AllGather), calls(OpKind::ReduceScatter));
            let prefetched = units.snapshot().prefetches - prefetches;
            let live = (after_forward.live_bytes, units.snapshot().live_bytes);
            Ok::<_, ParallelError>((gathers, prefetched, live, units.snapshot().peak_bytes))
        })
        .unwrap();
    let units = LAYERS as u64 + 1;
    // Gathered bytes of a layer (see the test above).
    let layer = 2 * 4 * (4 + 4 + 4 * 12 + 6 + 6 * 8 + 4);
    for (gathers, prefetched, (after_forward, after_backward), peak) in counts {
        // Backward holds at most the layer whose matrices' backward runs and the one prefetched
        // before it (a unit's gathered values go when its last matrix takes its rows; vectors
        // stay in the backward states), never every layer at once.
        assert_eq!(peak, 2 * layer);
        // Every unit gathered in forward and again in backward (each holds a value some
        // backward op needs: a norm's scale, a matrix), reduce-scattered once.
        assert_eq!(gathers, (2 * units, units));
        // In forward each layer prefetched by the unit before it; in backward, which needs
        // the root unit first (the tied head), each layer by the unit backward reached before.
        assert_eq!(prefetched, 2 * LAYERS);
        // Nothing gathered is held between forward and backward, nor after.
        assert_eq!((after_forward, after_backward), (0, 0));
    }
}

#[test]
fn a_pipelined_units_reduce_scatter_follows_its_layers_backward_not_the_whole_backward() {
    // Burn runs backward by depth: a unit's reduce-scatter op placed as deep as its layer's
    // input runs right after that layer's backward, before the layers below it gather again.
    let device = Device::flex().autodiff().gradient_checkpointing();
    let rule = PipelineRule::new("layers", ScheduleKind::OneFOneB, 1)
        .first(&["input"])
        .last(&["norm", "input"]);
    let plan = ParallelizePlan::new().pipeline(rule).fully_shard("");
    let orders = Launch::new("fsdp=2")
        .unwrap()
        .run(|ctx| {
            let (model, par) = parallelize(Stack::new(&device), &plan, &ctx)?;
            let micro_batch = |samples| batch(samples, &device);
            par.pipeline()?
                .step(&model, GLOBAL_BATCH, 0, &micro_batch, None, &ctx)?;
            let entries = ctx.flight_recorder().expect("launched").dump_data().entries;
            let ops: Vec<OpKind> = (entries.into_iter())
                .filter(|e| e.group.starts_with("fsdp"))
                .map(|e| e.op)
                .filter(|op| matches!(op, OpKind::AllGather | OpKind::ReduceScatter))
                .collect();
            Ok::<_, ParallelError>(ops)
        })
        .unwrap();
    for ops in orders {
        let first_scatter = ops.iter().position(|op| *op == OpKind::ReduceScatter);
        let last_gather = ops.iter().rposition(|op| *op == OpKind::AllGather);
        let (Some(first_scatter), Some(last_gather)) = (first_scatter, last_gather) else {
            panic!("no fsdp gathers or reduce-scatters recorded: {ops:?}");
        };
        assert!(first_scatter < last_gather, "{ops:?}");
    }
}

thread_local! {
    /// Called at each forward of [`Probed`]'s layer 0 on this thread (a rank's).
    static LAYER_ZERO_PROBE: RefCell<Option<Box<dyn FnMut()>>> = const { RefCell::new(None) };
}

/// [`Stack`] whose layer 0 calls this thread's [`LAYER_ZERO_PROBE`] each time it runs.
#[derive(Module, Debug)]
struct Probed {
    stack: Stack,
}

impl PipelineModel for Probed {
    type Activation = Tensor<2>;
    type Batch = (Tensor<2>, Tensor<1, Int>);

    fn embed(&self, batch: &Self::Batch) -> Tensor<2> {
        self.stack.embed(batch)
    }

    fn layer(&self, index: usize, x: Tensor<2>) -> Tensor<2> {
        if index == 0 {
            LAYER_ZERO_PROBE.with(|p| p.borrow_mut().as_mut().map(|probe| probe()));
        }
        self.stack.layer(index, x)
    }

    fn head_loss(&self, x: Tensor<2>, batch: &Self::Batch) -> Tensor<1> {
        self.stack.head_loss(x, batch)
    }
}

impl Probed {
    /// The loss of a loop of one's own, layer 0 checkpointed (run again in backward).
    fn loss_recomputing_layer_zero(&self, batch: &(Tensor<2>, Tensor<1, Int>)) -> Tensor<1> {
        let x = checkpoint(&self.stack.layers[0], self.embed(batch), |layer, x| {
            LAYER_ZERO_PROBE.with(|p| p.borrow_mut().as_mut().map(|probe| probe()));
            layer.forward(x)
        });
        let x = (1..LAYERS).fold(x, |x, i| self.stack.layer(i, x));
        self.head_loss(x, batch)
    }
}

/// How a test steps [`Probed`].
#[derive(Debug, Clone, Copy)]
enum Stepping {
    /// Through the plan's pipeline (which recomputes layer 0).
    Pipeline,
    /// A loop of one's own: `Parallelized::forward` of
    /// [`Probed::loss_recomputing_layer_zero`], then `Parallelized::gradients`.
    OwnLoop,
}

/// Two steps of [`Probed`] under `plan` on `mesh`, with `faults`: per rank, what `probe`
/// returned when layer 0 ran again in backward in the second step. `probe` is made after the
/// first step from the rank's flight recorder (the first step reduces buckets in layout order,
/// then replans them in the order the gradients arrived, as DDP does).
fn at_layer_zero_rerun<T, P>(
    stepping: Stepping,
    mesh: &str,
    faults: FaultPlan,
    plan: &ParallelizePlan,
    probe: impl Fn(Arc<flashover_comm::FlightRecorder>) -> P + Sync,
) -> Vec<Option<T>>
where
    T: Send + 'static,
    P: FnMut() -> T + 'static,
{
    let device = Device::flex().autodiff();
    Launch::new(mesh)
        .unwrap()
        .faults(faults)
        .run(|ctx| {
            let probed = Probed {
                stack: Stack::new(&device),
            };
            let (model, par) = parallelize(probed, plan, &ctx)?;
            let micro_batch = |samples| batch(samples, &device);
            let step = || -> Result<(), ParallelError> {
                match stepping {
                    Stepping::Pipeline => (par.pipeline()?)
                        .step(&model, GLOBAL_BATCH, 0, &micro_batch, None, &ctx)
                        .map(|_| ()),
                    Stepping::OwnLoop => {
                        let samples = micro_batch(par.data().batch_share(GLOBAL_BATCH, 0)?);
                        let loss =
                            par.forward(&model, |m| m.loss_recomputing_layer_zero(&samples))?;
                        par.gradients(&model, loss.backward(), None, &ctx)
                            .map(|_| ())
                    }
                }
            };
            step()?;
            let mut probe = probe(ctx.flight_recorder().expect("launched").clone());
            let seen = Arc::new(Mutex::new(None));
            let (mut forwards, saw) = (0, seen.clone());
            let at_forward = move || {
                forwards += 1;
                // The first run is the forward; the second, the rerun in backward.
                if forwards == 2 {
                    *saw.lock().unwrap() = Some(probe());
                }
            };
            LAYER_ZERO_PROBE.with(|p| *p.borrow_mut() = Some(Box::new(at_forward)));
            let stepped = step();
            LAYER_ZERO_PROBE.with(|p| p.borrow_mut().take());
            stepped?;
            let seen = seen.lock().unwrap().take();
            Ok::<_, ParallelError>(seen)
        })
        .unwrap()
}

/// [`Stack`]'s pipeline rule for [`Probed`].
fn probed_rule() -> PipelineRule {
    PipelineRule::new("stack.layers", ScheduleKind::OneFOneB, 1)
        .first(&["stack.input"])
        .last(&["stack.norm"])
}

/// A probe for [`at_layer_zero_rerun`]: waits (at most 20 s) for a gradient bucket's
/// all-reduce on dp to end, and says whether one did.
fn waits_for_a_bucket(
    recorder: Arc<flashover_comm::FlightRecorder>,
    group: &'static str,
) -> impl FnMut() -> bool + 'static {
    let buckets_done = move || {
        let entries = recorder.dump_data().entries.into_iter();
        entries
            .filter(|e| e.group.starts_with(group) && e.op == OpKind::AllReduce)
            .filter(|e| e.end_us.is_some())
            .count()
    };
    let before = buckets_done();
    move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        while buckets_done() == before && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        buckets_done() > before
    }
}

/// A gradient bucket of one parameter.
fn tiny_buckets() -> GradientBuckets {
    GradientBuckets::default().bucket_mb(4.0 / (1 << 20) as f64)
}

#[test]
fn a_pipelined_layers_gradient_buckets_are_reduced_before_the_layers_below_run_backward() {
    // Layer 0 is recomputed: its forward runs again in backward, once the layers above it are
    // done. There the probe waits for a gradient bucket's all-reduce on dp. The hooks of
    // layers 1-3, placed after their layer's input, have filled buckets by then (one
    // parameter per bucket); hooks on the parameters alone run at the end of backward, after
    // it, and no bucket could be reduced.
    let plan = (ParallelizePlan::new().pipeline(probed_rule()))
        .activation_checkpointing(CheckpointPolicy::Blocks(vec![0]))
        .gradient_buckets(tiny_buckets());
    a_bucket_is_reduced_before_layer_zeros_rerun(Stepping::Pipeline, &plan);
}

/// Asserts that on `dp=2`, stepping by `stepping` under `plan`, every rank saw a gradient
/// bucket reduced before layer 0 ran again in backward.
fn a_bucket_is_reduced_before_layer_zeros_rerun(stepping: Stepping, plan: &ParallelizePlan) {
    let reduced = at_layer_zero_rerun(stepping, "dp=2", FaultPlan::new(), plan, |recorder| {
        waits_for_a_bucket(recorder, "dp[")
    });
    for seen in reduced {
        let message = "no bucket was reduced before layer 0's backward";
        assert_eq!(seen, Some(true), "{stepping:?}: {message}");
    }
}

#[test]
fn a_loops_gradient_buckets_are_reduced_before_the_first_layer_runs_backward() {
    // The same probe in a loop of one's own, whose forward the plan sees only as parameter
    // reads: each hook is placed by its parameter's read, so layers 1-3's run as their
    // backward ends and fill buckets before layer 0's rerun. Hooks on the parameters alone
    // run at the end of backward, after it.
    let plan = ParallelizePlan::new().gradient_buckets(tiny_buckets());
    a_bucket_is_reduced_before_layer_zeros_rerun(Stepping::OwnLoop, &plan);
}

#[test]
fn a_pipelines_head_hands_its_gradients_to_their_buckets_before_the_layers_run_backward() {
    // Every layer is a fully sharded unit (reduce-scattered, in no bucket); the parameters
    // outside the layers are replicated over fsdp and all-reduced in buckets of one parameter.
    // Layer 0 is recomputed, and at its rerun in backward the probe waits for an all-reduce
    // of this step on fsdp: only the final norm's buckets can have filled by then, their hooks
    // made at the norm's read after the layers and placed after the last layer's output (the
    // input projection's gradient is final only at the end). Hooked at the end of backward, as
    // before, none has, and the probe times out at 20 s.
    let sharded = (0..LAYERS).fold(ParallelizePlan::new().pipeline(probed_rule()), |plan, i| {
        plan.fully_shard(&format!("stack.layers.{i}"))
    });
    let plan = (sharded.gradient_buckets(tiny_buckets()))
        .activation_checkpointing(CheckpointPolicy::Blocks(vec![0]));
    let pipelined = Stepping::Pipeline;
    let reduced = at_layer_zero_rerun(pipelined, "fsdp=2", FaultPlan::new(), &plan, |recorder| {
        waits_for_a_bucket(recorder, "fsdp")
    });
    for seen in reduced {
        let message = "no bucket of the final norm was reduced before layer 0's backward";
        assert_eq!(seen, Some(true), "{message}");
    }
}

#[test]
fn under_hsdp_backward_goes_on_while_a_units_reduce_scatter_runs() {
    // Layers 1-3 are fully sharded units over fsdp, reduced over dp by gradient buckets
    // (HSDP); layer 0 is replicated and recomputed. Every rank's reduce-scatters are 300 ms
    // late. The bucket takes each unit's reduce-scatter unwaited, so backward reaches layer
    // 0's rerun before any reduce-scatter of the step is done; waiting for each in backward,
    // it would get there after all three.
    let plan = (ParallelizePlan::new().pipeline(probed_rule()))
        .fully_shard("stack.layers.1")
        .fully_shard("stack.layers.2")
        .fully_shard("stack.layers.3")
        .activation_checkpointing(CheckpointPolicy::Blocks(vec![0]));
    let slow = (0..4).fold(FaultPlan::new(), |plan, rank| {
        plan.delay_every(rank, OpKind::ReduceScatter, Duration::from_millis(300))
    });
    let pipelined = Stepping::Pipeline;
    let done_at_rerun = at_layer_zero_rerun(pipelined, "dp=2,fsdp=2", slow, &plan, |recorder| {
        let scatters_done = move || {
            let entries = recorder.dump_data().entries.into_iter();
            entries
                .filter(|e| e.op == OpKind::ReduceScatter && e.end_us.is_some())
                .count()
        };
        let before = scatters_done();
        assert_eq!(
            before,
            LAYERS - 1,
            "the first step reduce-scatters each unit"
        );
        move || scatters_done() - before
    });
    for done in done_at_rerun {
        let message = "reduce-scatters done when layer 0's backward began";
        assert_eq!(done, Some(0), "{message}");
    }
}

#[test]
fn a_forward_scope_refuses_nesting_and_pipelined_plans_and_survives_a_panic() {
    let plan = ParallelizePlan::new().fully_shard("");
    let errors = Launch::new("fsdp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (model, par) = parallelize(Stack::new(&device), &plan, &ctx)?;
            let nested = par.forward(&model, |m| {
                let x = batch(0..2, &device);
                par.forward(m, |m| m.loss(&x)).map(|_| ())
            })?;
            // A forward that panics ends its scope all the same: the next one runs.
            let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                par.forward(&model, |_| panic!("a failing forward"))
            }));
            assert!(panicked.is_err());
            par.forward(&model, |m| m.loss(&batch(0..2, &device)))?;
            Ok::<_, ParallelError>(nested.unwrap_err().to_string())
        })
        .unwrap();
    assert!(errors[0].contains("already running"), "{}", errors[0]);
    let pipelined = plan.pipeline(
        PipelineRule::new("layers", ScheduleKind::OneFOneB, 2)
            .first(&["input"])
            .last(&["norm", "input"]),
    );
    let error = Launch::new("pp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (model, par) = parallelize(Stack::new(&device), &pipelined, &ctx)?;
            Ok::<_, ParallelError>(par.forward(&model, |_| ()).unwrap_err().to_string())
        })
        .unwrap();
    assert!(error[0].contains("pipeline()?.step"), "{}", error[0]);
}

/// The error `parallelize` refuses `plan` with on `mesh`, for the model `new` builds.
fn refusal<M: Module>(mesh: &str, plan: &ParallelizePlan, new: fn(&Device) -> M) -> String {
    Launch::new(mesh)
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            parallelize(new(&device), plan, &ctx).map(|_| ())
        })
        .unwrap_err()
        .to_string()
}

#[test]
fn plans_that_do_not_fit_the_model_or_mesh_are_refused_with_the_reason() {
    let refused = |mesh: &str, plan: ParallelizePlan| refusal(mesh, &plan, Classifier::new);
    let err = refused("fsdp=2", ParallelizePlan::new().fully_shard("blocks"));
    assert!(
        err.contains("`blocks`") && err.contains("input.weight"),
        "{err}"
    );
    let err = refused("dp=2,tp=2", ParallelizePlan::new());
    assert!(err.contains("tp=2") && err.contains("no layer"), "{err}");
    let recompute = |p: &str| ParallelizePlan::new().activation_checkpointing(p.parse().unwrap());
    let err = refused("dp=2", recompute("full"));
    assert!(err.contains("no") && err.contains("pipeline rule"), "{err}");
    let err = refused("dp=2", recompute("selective"));
    assert!(err.contains("gradient_checkpointing()"), "{err}");
    let stack = PipelineRule::new("layers", ScheduleKind::OneFOneB, 2)
        .first(&["input"])
        .last(&["norm", "input"]);
    let err = refusal("dp=2", &recompute("blocks:1,4").pipeline(stack), Stack::new);
    assert!(
        err.contains("names layer 4") && err.contains("has 4 layers"),
        "{err}"
    );
}

#[test]
fn tensor_parallel_rules_that_do_not_fit_the_model_are_refused_with_the_path() {
    let refused = |plan: ParallelizePlan| refusal("tp=2", &plan, SplitMlp::new);
    let colwise =
        |paths: &[&str]| ParallelizePlan::new().tensor_parallel(TensorParallelRule::colwise(paths));
    let cases = [
        (
            colwise(&["norm"]),
            vec!["`norm` (colwise)", "not a linear layer", "norm.gamma"],
        ),
        (
            colwise(&["upp"]),
            vec!["`upp`", "names no module", "up.weight"],
        ),
        (colwise(&[""]), vec!["not a linear layer", "up.weight"]),
        (
            ParallelizePlan::new()
                .tensor_parallel(TensorParallelRule::colwise(&["up"]).in_units(5)),
            vec!["`up` (colwise)", "12 output features", "units of 5"],
        ),
        (
            colwise(&["up"]).tensor_parallel(TensorParallelRule::rowwise(&["up"])),
            vec!["`up` (rowwise)", "already splits"],
        ),
        (
            ParallelizePlan::new().tensor_parallel(TensorParallelRule::vocab(&["up"])),
            vec!["`up` (vocab)", "not an embedding table", "bias"],
        ),
        (
            split_mlp_plan().sequence_parallel("norm"),
            vec!["sequence_parallel", "add a `vocab` rule"],
        ),
        (
            split_mlp_plan().sequence_parallel("up"),
            vec!["`up` (sequence_parallel)", "up.weight", "splits"],
        ),
        (
            ParallelizePlan::new().tensor_parallel(TensorParallelRule::rowwise(&["down"]).padded()),
            vec!["`down` (rowwise)", "is padded", "column-wise"],
        ),
    ];
    for (plan, want) in cases {
        let err = refused(plan);
        assert!(want.iter().all(|w| err.contains(w)), "{want:?}: {err}");
    }
    // The same checks without a mesh: every one with the widths, the paths and styles alone
    // without them (what a model of the same structure and other widths can check).
    let model = SplitMlp::new(&Device::flex());
    let units_of_5 = ParallelizePlan::new()
        .tensor_parallel(TensorParallelRule::colwise(&["up"]).in_units(5))
        .tensor_parallel(TensorParallelRule::rowwise(&["down"]));
    let err = units_of_5.check(&model, 2).unwrap_err().to_string();
    assert!(err.contains("units of 5"), "{err}");
    units_of_5.check_paths(&model).unwrap();
    let err = colwise(&["upp"])
        .check_paths(&model)
        .unwrap_err()
        .to_string();
    assert!(err.contains("names no module"), "{err}");
}

#[test]
fn a_column_wise_layer_beside_whole_twins_feeding_a_row_wise_one_is_refused_before_any_step() {
    // A query split by heads with a whole key and value: attention's classic mistake, which
    // would otherwise end in a shape mismatch inside the forward of the first step.
    let plan = ParallelizePlan::new()
        .tensor_parallel(TensorParallelRule::colwise(&["query"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["out"]));
    let err = refusal("tp=2", &plan, SharedInput::new);
    for want in [
        "`query` (colwise)",
        "`out` (rowwise)",
        "`key`, `value`",
        "same shape",
    ] {
        assert!(err.contains(want), "{want}: {err}");
    }
    let model = SharedInput::new(&Device::flex());
    let err = plan.check_paths(&model).unwrap_err().to_string();
    assert!(err.contains("`key`, `value`"), "{err}");
    // Split alike, the plan is accepted; at tp=1 no layer is split at all.
    let alike = ParallelizePlan::new()
        .tensor_parallel(TensorParallelRule::colwise(&["query", "key", "value"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["out"]));
    alike.check(&model, 2).unwrap();
    plan.check(&model, 1).unwrap();
}

#[test]
fn a_padded_column_wise_head_splits_any_width_and_gathers_back_whole() {
    // `head` has 5 output features: padded to 3 per rank at tp=2, the whole width on `whole`.
    let plan = |padded: bool| {
        let head = TensorParallelRule::colwise(&["head"]);
        ParallelizePlan::new().tensor_parallel(if padded { head.padded() } else { head })
    };
    let err = refusal("tp=2", &plan(false), SplitMlp::new);
    assert!(err.contains("5 output features"), "{err}");
    let out = Launch::new("tp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (model, par) = parallelize(SplitMlp::new(&device), &plan(true), &ctx)?;
            let local = model.head.d_output();
            let whole = par.sharded().whole(model)?;
            Ok::<_, ParallelError>((local, flatten_params(&whole)))
        })
        .unwrap();
    let reference = flatten_params(&SplitMlp::new(&Device::flex()));
    for (local, whole) in out {
        assert_eq!(local, 3);
        assert_eq!(whole, reference);
    }
}

#[test]
fn a_split_weight_read_by_burns_own_linear_fails_naming_it() {
    // The classifier keeps Burn's Linear, which reads its weight whole: under a split it
    // would run the unsplit layer on every tp rank, so the read panics instead.
    let plan = ParallelizePlan::new().tensor_parallel(TensorParallelRule::rowwise(&["input"]));
    let err = Launch::new("tp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (model, _) = parallelize(Classifier::new(&device), &plan, &ctx)?;
            let (x, _) = batch(0..2, &device);
            model.forward(x);
            Ok::<_, ParallelError>(())
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`input.weight`") && err.contains("flashover::nn::Linear"),
        "{err}"
    );
}

#[test]
fn pipeline_rules_that_do_not_fit_are_refused_with_the_reason() {
    let refused = |mesh: &str, plan: ParallelizePlan| refusal(mesh, &plan, Stack::new);
    let rule = |kind| {
        PipelineRule::new("layers", kind, 4)
            .first(&["input"])
            .last(&["norm", "input"])
    };
    let plan = |rule| ParallelizePlan::new().pipeline(rule);
    let cases = [
        ("pp=2", ParallelizePlan::new(), vec!["pp=2", "no pipeline"]),
        (
            "pp=2",
            plan(rule(ScheduleKind::OneFOneB).chunks(2)),
            vec!["chunks = 2", "interleaved"],
        ),
        (
            "fsdp=2,pp=2",
            plan(rule(ScheduleKind::ZeroBubbleH1)).fully_shard(""),
            vec!["zb-h1", "fully sharded", "1f1b"],
        ),
        (
            "pp=4",
            plan(rule(ScheduleKind::Interleaved1F1B).chunks(2)),
            vec!["4 layers cannot fill 8 stages"],
        ),
        (
            "pp=2",
            plan(rule(ScheduleKind::OneFOneB).last(&["input"])),
            vec!["`norm.gamma` is in no pipeline stage"],
        ),
        (
            "pp=2",
            plan(PipelineRule::new("norm", ScheduleKind::OneFOneB, 4)),
            vec!["`norm` must name a Vec of layers", "norm.gamma"],
        ),
        (
            "pp=2",
            plan(rule(ScheduleKind::OneFOneB).layers_per_stage(&[1, 2])),
            vec![
                "layers_per_stage = [1, 2]",
                "4 layers for 2 stages",
                "summing to 4",
            ],
        ),
        (
            "pp=2",
            plan(rule(ScheduleKind::OneFOneB).layers_per_stage(&[4, 0])),
            vec!["layers_per_stage = [4, 0]", "at least 1"],
        ),
        (
            "pp=2",
            plan(rule(ScheduleKind::OneFOneB).layers_per_stage(&[2, 1, 1])),
            vec!["[2, 1, 1]", "2 stages (pp = 2 x chunks = 1)"],
        ),
        // A mistyped `first` or `last` path is named as the typo, with the model's names.
        (
            "pp=2",
            plan(rule(ScheduleKind::OneFOneB).last(&["nrom"])),
            vec!["`nrom` (pipeline last) names no module", "norm.gamma"],
        ),
        (
            "pp=2",
            plan(rule(ScheduleKind::OneFOneB).first(&["inptu"])),
            vec!["`inptu` (pipeline first) names no module"],
        ),
    ];
    for (mesh, plan, want) in cases {
        let err = refused(mesh, plan);
        assert!(want.iter().all(|w| err.contains(w)), "{want:?}: {err}");
    }
    // Its plain forward reads other stages' placeholders: refused naming one and the way.
    let err = Launch::new("pp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let plan = plan(rule(ScheduleKind::GPipe));
            let (model, _) = parallelize(Stack::new(&device), &plan, &ctx)?;
            model.loss(&batch(0..2, &device));
            Ok::<_, ParallelError>(())
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("another rank holds") && err.contains("pipeline()?.step"),
        "{err}"
    );
    // A pipelined model's forward is a stage's: the plain loop's calls are refused.
    let err = Launch::new("pp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let plan = plan(rule(ScheduleKind::GPipe));
            let (_, par) = parallelize(Stack::new(&device), &plan, &ctx)?;
            par.data().batch_share(GLOBAL_BATCH, 0).map(|_| ())
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("pipeline()?.step"), "{err}");
    let err = Launch::new("pp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (model, par) =
                parallelize(Stack::new(&device), &plan(rule(ScheduleKind::GPipe)), &ctx)?;
            let loss = Tensor::<1>::ones([1], &device).require_grad();
            par.gradients(&model, loss.backward(), None, &ctx)
                .map(|_| ())
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("pipeline()?.step"), "{err}");
}

/// A model with an RMS norm between two linear layers: Flashover's drop-in for Burn's
/// `RmsNorm` (which checks its input against its scale's stored shape).
#[derive(Module, Debug)]
struct RmsNormed {
    input: Linear,
    norm: nn::RmsNorm,
    head: Linear,
}

impl Net for RmsNormed {
    fn new(device: &Device) -> Self {
        RmsNormed {
            input: linear(FEATURES, HIDDEN, 0.2, device),
            norm: burn::nn::RmsNormConfig::new(HIDDEN).init(device).into(),
            head: linear(HIDDEN, CLASSES, 0.4, device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.head
            .forward(self.norm.forward(gelu(self.input.forward(x))))
    }
}

/// The same model with Burn's own `RmsNorm`.
#[derive(Module, Debug)]
struct BurnRmsNormed {
    input: Linear,
    norm: burn::nn::RmsNorm,
    head: Linear,
}

impl Net for BurnRmsNormed {
    fn new(device: &Device) -> Self {
        BurnRmsNormed {
            input: linear(FEATURES, HIDDEN, 0.2, device),
            norm: burn::nn::RmsNormConfig::new(HIDDEN).init(device),
            head: linear(HIDDEN, CLASSES, 0.4, device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.head
            .forward(self.norm.forward(gelu(self.input.forward(x))))
    }
}

/// Trains `M` under `plan` at fsdp=2 against one rank (1e-5), and returns the parameters the
/// plan kept whole and the parameter elements each rank stored.
fn trains_as_one_rank_keeping_whole<M: Net>(plan: &ParallelizePlan) -> (Vec<String>, Vec<usize>) {
    let reference = single_rank::<M>();
    let (run, held) = parallel::<M>("fsdp=2", plan.clone());
    let (loss, weights) = (
        max_rel(&run.0, &reference.0),
        max_scaled(&run.2, &reference.2),
    );
    assert!(
        loss < 1e-5 && weights < 1e-5,
        "losses {loss:e}, weights {weights:e}"
    );
    let kept = Launch::new("fsdp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (_, par) = parallelize(M::new(&device), plan, &ctx)?;
            Ok::<_, ParallelError>(par.sharded().kept_whole().clone())
        })
        .unwrap();
    (kept[0].iter().cloned().collect(), held)
}

#[test]
fn fully_shard_shards_every_parameter_of_flashovers_rms_norm() {
    let (kept, held) =
        trains_as_one_rank_keeping_whole::<RmsNormed>(&ParallelizePlan::new().fully_shard(""));
    assert!(kept.is_empty(), "{kept:?}");
    // Every parameter is cut into two shards of ceil(rows / 2) rows: within a row per
    // parameter of half the model.
    let whole = ParamLayout::of(&RmsNormed::new(&Device::flex())).numel;
    let row_slack = HIDDEN + CLASSES + 1;
    for h in held {
        assert!(h <= whole / 2 + row_slack, "a rank holds {h} of {whole}");
    }
}

#[test]
fn burns_own_rms_norm_under_fully_shard_fails_loudly_in_its_first_forward() {
    // No layer is recognised by its type: Burn's RmsNorm, sharded like everything else,
    // checks its input against the shard's stored shape and panics. Never silently wrong.
    let err = Launch::new("fsdp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let plan = ParallelizePlan::new().fully_shard("");
            let (model, par) = parallelize(BurnRmsNormed::new(&device), &plan, &ctx)?;
            let (x, _) = batch(par.data().batch_share(GLOBAL_BATCH, 0)?, &device);
            Ok::<_, ParallelError>(model.forward(x).into_data())
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("assert_shape"), "{err}");
    // Named in the plan's keep_whole, it stays whole and trains as one rank.
    let plan = ParallelizePlan::new().fully_shard("").keep_whole("norm");
    let (kept, _) = trains_as_one_rank_keeping_whole::<BurnRmsNormed>(&plan);
    assert_eq!(kept, ["norm.gamma"]);
}

/// A scale of one's own whose forward reads its stored shape, as Burn's `RmsNorm` does: a
/// shard would answer with its own rows.
#[derive(Module, Debug)]
struct OwnScale {
    gamma: Param<Tensor<1>>,
}

/// [`OwnScale`] between two linear layers.
#[derive(Module, Debug)]
struct OwnScaled {
    input: Linear,
    scale: OwnScale,
    head: Linear,
}

impl Net for OwnScaled {
    fn new(device: &Device) -> Self {
        let gamma: Vec<f32> = (0..HIDDEN).map(|i| 1.0 + 0.05 * i as f32).collect();
        OwnScaled {
            input: linear(FEATURES, HIDDEN, 0.2, device),
            scale: OwnScale {
                gamma: Param::from_tensor(Tensor::from_data(
                    TensorData::new(gamma, [HIDDEN]),
                    device,
                )),
            },
            head: linear(HIDDEN, CLASSES, 0.4, device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let [width] = self.scale.gamma.shape().dims();
        let scale = self.scale.gamma.val().reshape([1, width]);
        self.head.forward(gelu(self.input.forward(x)) * scale)
    }
}

#[test]
fn a_layer_of_ones_own_that_reads_its_stored_shape_stays_whole_by_the_plans_rule() {
    let plan = ParallelizePlan::new().fully_shard("").keep_whole("scale");
    let (kept, _) = trains_as_one_rank_keeping_whole::<OwnScaled>(&plan);
    assert_eq!(kept, ["scale.gamma"]);
    // A rule that would keep whole what no fully_shard path shards does nothing: refused.
    let idle = ParallelizePlan::new()
        .fully_shard("input")
        .keep_whole("scale");
    let err = refusal("fsdp=2", &idle, OwnScaled::new);
    assert!(
        err.contains("`scale` (keep_whole)") && err.contains("inside no fully_shard path"),
        "{err}"
    );
}

/// A language model whose token table (7 rows: not a multiple of tp) is also its output head,
/// with a normed residual MLP between.
#[derive(Module, Debug)]
struct TiedLm {
    embed: nn::Embedding,
    norm: LayerNorm,
    up: nn::Linear,
    down: nn::Linear,
    out_norm: LayerNorm,
}

const TOKENS: usize = 7;

/// A next-token model of `[batch, 5]` token sequences.
trait Lm: Module + Sized {
    fn new(device: &Device) -> Self;
    fn loss(&self, tokens: Tensor<2, Int>) -> Tensor<1>;
}

/// Inputs and next tokens of `[batch, 5]` sequences (4 positions each).
fn shifted(tokens: Tensor<2, Int>) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let seq = tokens.dims()[1];
    (
        tokens.clone().narrow(1, 0, seq - 1),
        tokens.narrow(1, 1, seq - 1),
    )
}

impl Lm for TiedLm {
    fn new(device: &Device) -> Self {
        TiedLm {
            embed: nn::Embedding {
                weight: linear(TOKENS, NARROW, 0.8, device).weight,
            },
            norm: LayerNormConfig::new(NARROW).init(device),
            up: linear(NARROW, WIDE, 0.4, device).into(),
            down: linear(WIDE, NARROW, 0.5, device).into(),
            out_norm: LayerNormConfig::new(NARROW).init(device),
        }
    }

    fn loss(&self, tokens: Tensor<2, Int>) -> Tensor<1> {
        let (inputs, targets) = shifted(tokens);
        let x = self.embed.forward(inputs);
        let x = x.clone()
            + self
                .down
                .forward(gelu(self.up.forward(self.norm.forward(x))));
        let x = self.out_norm.forward(x);
        self.embed.cross_entropy(self.embed.logits(x), targets)
    }
}

fn token_batch(samples: std::ops::Range<usize>, device: &Device) -> Tensor<2, Int> {
    let n = samples.len();
    let t: Vec<i64> = samples
        .flat_map(|s| (0..5).map(move |p| ((s * 3 + p * p + p) % TOKENS) as i64))
        .collect();
    Tensor::from_data(TensorData::new(t, [n, 5]), device)
}

/// An output head of its own (8 outputs: split column-wise over tp), fed by the table.
#[derive(Module, Debug)]
struct UntiedLm {
    embed: nn::Embedding,
    head: nn::Linear,
}

impl Lm for UntiedLm {
    fn new(device: &Device) -> Self {
        UntiedLm {
            embed: nn::Embedding {
                weight: linear(TOKENS, NARROW, 0.8, device).weight,
            },
            head: linear(NARROW, NARROW, 0.6, device).into(),
        }
    }

    fn loss(&self, tokens: Tensor<2, Int>) -> Tensor<1> {
        let (inputs, targets) = shifted(tokens);
        let logits = self.head.forward(self.embed.forward(inputs));
        self.head.cross_entropy(logits, targets)
    }
}

/// `M`'s losses and final weights, on one device (`mesh` None) or under `plan`.
fn train_lm<M: Lm>(mesh: Option<&str>, plan: &ParallelizePlan) -> (Vec<f32>, Vec<f32>) {
    let Some(mesh) = mesh else {
        let device = Device::flex().autodiff();
        let mut model = M::new(&device);
        let mut optim = AdamWConfig::new().init();
        let mut losses = vec![];
        for step in 0..STEPS {
            let loss = model.loss(token_batch(
                step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH,
                &device,
            ));
            losses.push(loss.clone().into_scalar::<f32>());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(LR, model, grads);
        }
        return (losses, flatten_params(&model));
    };
    let out = Launch::new(mesh)
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (mut model, par) = parallelize(M::new(&device), plan, &ctx)?;
            let mut optim = AdamWConfig::new().init();
            let mut losses = vec![];
            for step in 0..STEPS {
                let loss = model.loss(token_batch(
                    par.data().batch_share(GLOBAL_BATCH, step)?,
                    &device,
                ));
                losses.push(par.data().mean_loss(loss.clone().into_scalar::<f32>())?);
                let (grads, _) = par.gradients(&model, loss.backward(), None, &ctx)?;
                model = optim.step(LR, model, grads);
            }
            Ok::<_, ParallelError>((losses, flatten_params(&par.sharded().whole(model)?)))
        })
        .unwrap();
    out.into_iter().next().unwrap()
}

#[test]
fn vocabulary_and_sequence_parallel_models_train_as_one_rank() {
    let vocab = ParallelizePlan::new().tensor_parallel(TensorParallelRule::vocab(&["embed"]));
    let head = vocab
        .clone()
        .tensor_parallel(TensorParallelRule::colwise(&["head"]));
    let mlp = vocab
        .clone()
        .tensor_parallel(TensorParallelRule::colwise(&["up"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["down"]));
    // Sequence parallel: the norms (and the row-wise bias) on this rank's positions.
    let sequence = mlp
        .clone()
        .sequence_parallel("norm")
        .sequence_parallel("out_norm");
    let tied = train_lm::<TiedLm>(None, &ParallelizePlan::new());
    let untied = train_lm::<UntiedLm>(None, &ParallelizePlan::new());
    for (mesh, plan, reference) in [
        ("tp=2", vocab.clone(), &tied),
        ("tp=4", vocab.clone(), &tied),
        ("dp=2,fsdp=2,tp=2", vocab.fully_shard(""), &tied),
        ("tp=2", mlp, &tied),
        ("tp=2", sequence.clone(), &tied),
        ("tp=4", sequence.clone(), &tied),
        ("dp=2,fsdp=2,tp=2", sequence.fully_shard(""), &tied),
        ("tp=2", head.clone(), &untied),
        ("fsdp=2,tp=2", head.fully_shard(""), &untied),
    ] {
        let run = if std::ptr::eq(reference, &tied) {
            train_lm::<TiedLm>(Some(mesh), &plan)
        } else {
            train_lm::<UntiedLm>(Some(mesh), &plan)
        };
        let (loss, weights) = (
            max_rel(&run.0, &reference.0),
            max_scaled(&run.1, &reference.1),
        );
        assert!(
            loss < 1e-5 && weights < 1e-5,
            "{mesh}: losses {loss:e}, weights {weights:e}"
        );
    }
}

#[test]
fn a_whole_module_left_out_of_sequence_parallel_is_named_on_the_first_step() {
    let plan = ParallelizePlan::new()
        .tensor_parallel(TensorParallelRule::vocab(&["embed"]))
        .tensor_parallel(TensorParallelRule::colwise(&["up"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["down"]))
        .sequence_parallel("norm");
    let err = Launch::new("tp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (model, par) = parallelize(TiedLm::new(&device), &plan, &ctx)?;
            let loss = model.loss(token_batch(
                par.data().batch_share(GLOBAL_BATCH, 0)?,
                &device,
            ));
            par.gradients(&model, loss.backward(), None, &ctx)
                .map(|_| ())
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`out_norm.") && err.contains("sequence_parallel"),
        "{err}"
    );
}

/// Layers of Burn's own `Linear`, which compute their weight gradients with the input
/// gradients.
#[derive(Module, Debug)]
struct BurnLayers {
    layers: Vec<Linear>,
}

impl PipelineModel for BurnLayers {
    type Activation = Tensor<2>;
    type Batch = (Tensor<2>, Tensor<1, Int>);

    fn embed(&self, (x, _): &Self::Batch) -> Tensor<2> {
        x.clone()
    }

    fn layer(&self, index: usize, x: Tensor<2>) -> Tensor<2> {
        self.layers[index].forward(x)
    }

    fn head_loss(&self, x: Tensor<2>, (_, y): &Self::Batch) -> Tensor<1> {
        CrossEntropyLossConfig::new()
            .init(&x.device())
            .forward(x, y.clone())
    }
}

#[test]
fn zero_bubble_refuses_layers_whose_weight_gradients_it_cannot_defer() {
    let err = Launch::new("pp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let model = BurnLayers {
                layers: (0..2)
                    .map(|i| linear(FEATURES, FEATURES, i as f32, &device))
                    .collect(),
            };
            let rule = PipelineRule::new("layers", ScheduleKind::ZeroBubbleH1, 2);
            let plan = ParallelizePlan::new().pipeline(rule);
            let (model, par) = parallelize(model, &plan, &ctx)?;
            let micro_batch = |samples| batch(samples, &device);
            par.pipeline()?
                .step(&model, GLOBAL_BATCH, 0, &micro_batch, None, &ctx)?;
            Ok::<_, ParallelError>(())
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("zb-h1 deferred no weight gradient") && err.contains("flashover::nn::Linear"),
        "{err}"
    );
}
