//! Checkpoints of a user's own model parallelized by a plan: saved under one layout, resumed
//! under another (tensor-parallel, fully sharded and pipelined to plain data parallel and
//! back), training continues as the uninterrupted single-rank run does (fp32, 1e-5); a
//! checkpoint of another model is refused naming the parameter.

use super::Scratch;
use burn::module::{Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover::nn::Linear;
use flashover::plan_checkpoint::Checkpoints;
use flashover::prelude::*;
use flashover_parallel::params::flatten_params;

const WIDTH: usize = 8;
const HIDDEN: usize = 12;
const VOCAB: usize = 6;
const BLOCKS: usize = 2;
pub(super) const BATCH: usize = 8;
pub(super) const STEPS: usize = 6;
pub(super) const SAVED_AT: usize = 3;
const LR: f64 = 2e-2;

/// Residual blocks between an input projection whose weight is also the output head (tied).
#[derive(Module, Debug)]
struct Tower {
    input: Linear,
    blocks: Vec<Block>,
}

#[derive(Module, Debug)]
struct Block {
    up: Linear,
    down: Linear,
    /// Unused by this sequence-free forward: its parameter has no elements, and must travel
    /// through save, resume and export like any other (a context-parallel model has one per
    /// attention layer).
    core: flashover::nn::CausalAttention,
}

fn linear(d_in: usize, d_out: usize, salt: f32, device: &Device) -> Linear {
    let values = |n: usize| {
        (0..n)
            .map(|i| ((i as f32 + salt) * 0.77).sin() * 0.5)
            .collect()
    };
    Linear {
        weight: Param::from_data(TensorData::new(values(d_in * d_out), [d_in, d_out]), device),
        bias: Some(Param::from_data(
            TensorData::new(values(d_out), [d_out]),
            device,
        )),
    }
}

impl Tower {
    fn new(device: &Device) -> Self {
        let block = |i: usize| Block {
            up: linear(WIDTH, HIDDEN, 1.0 + i as f32, device),
            down: linear(HIDDEN, WIDTH, 2.5 + i as f32, device),
            core: flashover::nn::CausalAttention::new(device),
        };
        Tower {
            input: linear(VOCAB, WIDTH, 0.3, device),
            blocks: (0..BLOCKS).map(block).collect(),
        }
    }

    fn loss(&self, batch: &Batch) -> Tensor<1> {
        let x = (0..BLOCKS).fold(self.embed(batch), |x, i| self.layer(i, x));
        self.head_loss(x, batch)
    }
}

type Batch = (Tensor<2>, Tensor<1, Int>);

impl PipelineModel for Tower {
    type Activation = Tensor<2>;
    type Batch = Batch;

    fn embed(&self, (x, _): &Batch) -> Tensor<2> {
        self.input.forward(x.clone())
    }

    fn layer(&self, index: usize, x: Tensor<2>) -> Tensor<2> {
        let b = &self.blocks[index];
        x.clone() + b.down.forward(gelu(b.up.forward(x)))
    }

    fn head_loss(&self, x: Tensor<2>, (_, y): &Batch) -> Tensor<1> {
        let logits = x.matmul(self.input.weight.val().transpose());
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, y.clone())
    }
}

fn batch(samples: std::ops::Range<usize>, device: &Device) -> Batch {
    let n = samples.len();
    let x: Vec<f32> = samples
        .clone()
        .flat_map(|s| (0..VOCAB).map(move |f| ((s * 3 + f * 5) as f32 * 0.29).cos()))
        .collect();
    let y: Vec<i64> = samples.map(|s| ((s * 7 + 1) % VOCAB) as i64).collect();
    (
        Tensor::from_data(TensorData::new(x, [n, VOCAB]), device),
        Tensor::from_data(TensorData::new(y, [n]), device),
    )
}

/// Losses and final weights.
pub(super) type Run = (Vec<f32>, Vec<f32>);

/// The uninterrupted plain loop on one device (no clipping).
fn single_rank() -> Run {
    single_rank_of(Tower::new, |model, samples, device| {
        model.loss(&batch(samples, device))
    })
}

/// `STEPS` steps of AdamW on one device of the model `new` builds, `loss(model, samples,
/// device)` the mean loss of step `s`'s samples `s * BATCH..`: the losses and final weights.
pub(super) fn single_rank_of<M: Module>(
    new: fn(&Device) -> M,
    loss: impl Fn(&M, std::ops::Range<usize>, &Device) -> Tensor<1>,
) -> Run {
    let device = Device::flex().autodiff();
    let mut model = new(&device);
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
        let loss = loss(&model, step * BATCH..(step + 1) * BATCH, &device);
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    (losses, flatten_params(&model))
}

/// Steps `steps` under `plan` on `mesh`, resumed from the newest checkpoint in `dir` if there
/// is one, saving there after the last step: rank 0's losses and the whole final weights.
fn span(
    mesh: &str,
    plan: &ParallelizePlan,
    steps: std::ops::Range<usize>,
    dir: &std::path::Path,
) -> Run {
    span_of(
        mesh,
        plan,
        steps,
        dir,
        Tower::new,
        |model, par, step, ctx| {
            let device = ctx.device().clone().autodiff();
            match &plan.pipeline {
                None => {
                    let loss = model.loss(&batch(par.data().batch_share(BATCH, step)?, &device));
                    let mean = par.data().mean_loss(loss.clone().into_scalar::<f32>())?;
                    Ok((mean, par.gradients(model, loss.backward(), None, ctx)?.0))
                }
                Some(_) => {
                    let micro = |samples| batch(samples, &device);
                    let out = par
                        .pipeline()?
                        .step(model, BATCH, step, &micro, None, ctx)?;
                    Ok((out.scalars.read().loss, out.grads))
                }
            }
        },
    )
}

/// What one step computes: the whole batch's mean loss and this rank's reduced gradients.
pub(super) type Step = (f32, GradientsParams);

/// Steps `steps` of the model `new` builds, parallelized by `plan` on `mesh`, each computed by
/// `step(model, par, step, ctx)` and taken by AdamW; resumed from the newest checkpoint in
/// `dir` if there is one, saved there after the last step: rank 0's losses and the whole final
/// weights.
pub(super) fn span_of<M: Module + 'static>(
    mesh: &str,
    plan: &ParallelizePlan,
    steps: std::ops::Range<usize>,
    dir: &std::path::Path,
    new: fn(&Device) -> M,
    step: impl Fn(&M, &Parallelized, usize, &RankContext) -> Result<Step, ParallelError> + Sync,
) -> Run {
    let out = launch(mesh, |ctx| {
        let device = ctx.device().clone().autodiff();
        let (model, par) = parallelize(new(&device), plan, &ctx)?;
        let optim: ModuleOptimizer = AdamWConfig::new().init();
        let mut checkpoints = Checkpoints::new(dir, 2);
        let (mut model, mut optim, state) = match checkpoints.latest()? {
            Some(saved) => Checkpoints::resume(&par, &ctx, &saved, model, optim)?,
            None => (model, optim, RunState::default()),
        };
        assert_eq!(
            state.step as usize, steps.start,
            "resumed at the saved step"
        );
        let mut losses = vec![];
        for s in steps.clone() {
            let (loss, grads) = step(&model, &par, s, &ctx)?;
            losses.push(loss);
            model = optim.step(LR, model, grads);
        }
        let user = serde_json::json!({ "mesh": mesh });
        checkpoints.save_with(&par, &ctx, steps.end as u64, &model, &optim, &user)?;
        Ok::<_, ParallelError>((losses, flatten_params(&par.sharded().whole(model)?)))
    })
    .expect("training span");
    out.into_iter().next().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    flashover::check::relative_difference(b, a)
}

#[test]
fn a_plan_checkpoint_resumes_on_any_layout_as_the_uninterrupted_run() {
    let reference = single_rank();
    let pipelined = ParallelizePlan::new()
        .fully_shard("")
        .tensor_parallel(TensorParallelRule::colwise(&["blocks.*.up"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["blocks.*.down"]))
        .pipeline(
            PipelineRule::new("blocks", ScheduleKind::OneFOneB, 2)
                .first(&["input"])
                .last(&["input"]),
        );
    let plain = ParallelizePlan::new();
    let pp_only = ParallelizePlan::new().pipeline(
        PipelineRule::new("blocks", ScheduleKind::OneFOneB, 2)
            .first(&["input"])
            .last(&["input"]),
    );
    let tp_only = ParallelizePlan::new()
        .tensor_parallel(TensorParallelRule::colwise(&["blocks.*.up"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["blocks.*.down"]));
    let fsdp_only = ParallelizePlan::new().fully_shard("");
    // Every axis saved and resumed on another layout; each rank's optimizer state included
    // (a pipeline stage's too, though rank 0 writes the run state).
    let cases = [
        ("fsdp=2,tp=2,pp=2", &pipelined, "dp=2", &plain),
        ("dp=2", &plain, "fsdp=2,tp=2,pp=2", &pipelined),
        ("pp=2", &pp_only, "tp=2", &tp_only),
        ("fsdp=2", &fsdp_only, "pp=2", &pp_only),
    ];
    for (first_mesh, first, second_mesh, second) in cases {
        let dir = Scratch::new("plan");
        let (head, _) = span(first_mesh, first, 0..SAVED_AT, &dir.0);
        let (tail, weights) = span(second_mesh, second, SAVED_AT..STEPS, &dir.0);
        let losses: Vec<f32> = head.into_iter().chain(tail).collect();
        let (l, w) = (
            max_diff(&losses, &reference.0),
            max_diff(&weights, &reference.1),
        );
        assert!(
            l < 1e-5 && w < 1e-5,
            "{first_mesh} then {second_mesh}: losses {l:e}, weights {w:e}"
        );
    }
}

#[test]
fn a_plan_checkpoint_of_another_model_is_refused_naming_the_parameter() {
    let dir = Scratch::new("plan-foreign");
    span("dp=2", &ParallelizePlan::new(), 0..1, &dir.0);
    let err = launch("dp=1", |ctx| {
        let device = ctx.device().clone().autodiff();
        // The same model with a narrower first projection: another model.
        let mut tower = Tower::new(&device);
        tower.input = linear(VOCAB - 1, WIDTH, 0.3, &device);
        let (model, par) = parallelize(tower, &ParallelizePlan::new(), &ctx)?;
        let saved = Checkpoints::new(&dir.0, 2).latest()?.expect("saved");
        Checkpoints::resume(&par, &ctx, &saved, model, AdamWConfig::new().init()).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("input.weight"), "{err}");
    // `ckpt export` writes its parameters, whole and named as the model's, for plain Burn.
    let saved = Checkpoints::new(&dir.0, 2)
        .latest()
        .unwrap()
        .expect("saved");
    let ckpt = flashover_checkpoint::Checkpoint::open(&saved).unwrap();
    let exported = flashover::train::checkpoint::export(&ckpt, &dir.0.join("model.safetensors"));
    let params = flashover_parallel::params::ParamLayout::of(&Tower::new(&Device::flex()));
    assert_eq!(exported, Ok(params.slots.len()));
    // Offline resharding needs the job; a plan checkpoint reshards when resumed, and says so.
    let err =
        flashover::train::checkpoint::reshard(&saved, "dp=2", None, &dir.0.join("r")).unwrap_err();
    assert!(err.contains("Checkpoints::resume"), "{err}");
}
