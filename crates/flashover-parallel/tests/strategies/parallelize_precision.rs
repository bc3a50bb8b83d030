//! Mixed precision under a plan (`ParallelizePlan::mixed_precision`, FSDP2's policy): the
//! user's `Stack` computing in bf16 or f16 on f32 parameters, its units gathered and its
//! gradients reduced in the policy's dtypes, with and without pipeline stages, against the
//! same computation on one rank (within the compute dtype's rounding: 1e-2 for bf16, 5e-2
//! for f16) and against f32 (from which it must differ).

use crate::parallelize::{
    GLOBAL_BATCH, LR, MAX_NORM, Run, STEPS, Stack, batch, differences, plan_loop, reference_loop,
    stack_pipelined_on, stack_single_rank,
};
use burn::optim::AdamWConfig;
use burn::tensor::{DType, Device, Int, Tensor};
use flashover_parallel::ParallelError;
use flashover_parallel::activation_checkpointing::CheckpointPolicy;
use flashover_parallel::parallelize::{ParallelizePlan, PipelineModel, PipelineRule, parallelize};
use flashover_parallel::params::flatten_params;
use flashover_parallel::pipeline::ScheduleKind;
use flashover_parallel::precision::{LossScale, MixedPrecision, Precision};
use flashover_runtime::{Launch, OpKind};

#[test]
fn a_pipelined_plan_computes_in_a_precision_policys_dtype() {
    // bf16 stages: the first step's loss (one forward of the same weights) is the same plan's
    // on a mesh without pp, bit for bit, and more than 1e-4 from f32's (about 2.9: a
    // pipeline in f32 matches the f32 loop to 1e-5 relative, 3e-5 here); the whole run stays within bf16's rounding of the plain bf16 loop
    // (the view of the whole model on the whole batch). Its weights do not match the cut on
    // one rank to 1e-5: the head reads the input projection again, and those two reads'
    // gradients add in bf16 on one rank's cast weight but in f32 across the two ranks.
    let policy = MixedPrecision::new(Precision::BF16);
    let bf16_one_rank = bf16_single_rank();
    let f32_one_rank = stack_single_rank();
    let rule = PipelineRule::new("layers", ScheduleKind::OneFOneB, 4)
        .first(&["input"])
        .last(&["norm", "input"]);
    let plan = ParallelizePlan::new()
        .pipeline(rule)
        .mixed_precision(policy);
    let device = || Device::flex().autodiff();
    let run = |mesh: &str, plan: &ParallelizePlan| stack_pipelined_on(mesh, plan.clone(), device).0;
    let recomputed = plan
        .clone()
        .activation_checkpointing(CheckpointPolicy::Full);
    let sharded = plan.clone().fully_shard("");
    // (mesh, plan, the mesh without pp that reads the same micro-batches)
    let cases = [
        ("pp=2", &plan, "pp=1"),
        ("pp=2", &recomputed, "pp=1"),
        ("fsdp=2,pp=2", &sharded, "dp=2"),
    ];
    for (mesh, plan, unpiped) in cases {
        let pipelined = run(mesh, plan);
        let what = format!("{mesh} {}", plan.activation_checkpointing);
        let first = pipelined.0[0];
        assert_eq!(first, run(unpiped, plan).0[0], "{what}: first loss");
        let from_f32 = (first - f32_one_rank.0[0]).abs();
        assert!(from_f32 > 1e-4, "{what}: computed as f32 ({from_f32:e})");
        let (loss, norm, weights) = differences(&pipelined, &bf16_one_rank);
        assert!(
            loss < 1e-2 && norm < 1e-2 && weights < 1e-2,
            "{what}: against the bf16 loop: losses {loss:e}, norms {norm:e}, weights {weights:e}"
        );
    }
}

#[test]
fn a_pipelined_plan_scales_the_loss_and_skips_overflowing_steps() {
    let rule = PipelineRule::new("layers", ScheduleKind::OneFOneB, 4)
        .first(&["input"])
        .last(&["norm", "input"]);
    let plan = ParallelizePlan::new().pipeline(rule);
    let device = || Device::flex().autodiff();
    // f16 with a fixed scale: the first loss is the same plan's without pp, bit for bit; the
    // run tracks f32 within f16's rounding.
    let fixed = MixedPrecision {
        loss_scale: LossScale::Static(1024.0),
        ..MixedPrecision::new(Precision::F16)
    };
    let run = |mesh: &str| stack_pipelined_on(mesh, plan.clone().mixed_precision(fixed), device).0;
    let pipelined = run("pp=2");
    assert_eq!(pipelined.0[0], run("pp=1").0[0]);
    let f32_one_rank = stack_single_rank();
    let (loss, norm, weights) = differences(&pipelined, &f32_one_rank);
    assert!(
        loss < 5e-2 && norm < 5e-2 && weights < 5e-2,
        "f16: losses {loss:e}, norms {norm:e}, weights {weights:e}"
    );
    assert!(loss > 1e-5, "f16: computed as f32 ({loss:e})");
    // A dynamic scale that overflows f16 (2^24 x a loss of about 3): the first steps are
    // skipped on every rank alike, leaving the weights as they were, and the scale halves
    // until the gradients are finite; then the steps apply.
    let overflowing = MixedPrecision {
        loss_scale: LossScale::Dynamic {
            initial: 16_777_216.0,
            growth_interval: 1000,
        },
        ..MixedPrecision::new(Precision::F16)
    };
    // Through `pipeline_step`, and through `pipeline_gradients` with `reduce_gradients`,
    // which decides the overflow from the reduced norm: the same steps.
    let run = |separately: bool| {
        Launch::new("dp=2,pp=2")
            .unwrap()
            .run(|ctx| {
                let device = device();
                let plan = plan.clone().mixed_precision(overflowing);
                let (mut model, par) = parallelize(Stack::new(&device), &plan, &ctx)?;
                let mut optim = AdamWConfig::new().init();
                let micro_batch = |samples| {
                    let (x, y) = batch(samples, &device);
                    (x.cast(Precision::F16.float_dtype()), y)
                };
                let head = |m: &Stack, x, b: &(Tensor<2>, Tensor<1, Int>), _| m.head_loss(x, b);
                let mut steps = vec![];
                for step in 0..12 {
                    let before = flatten_params(&model);
                    let (grads, norm, scale) = match separately {
                        false => {
                            let out = par.pipeline()?.step(
                                &model,
                                GLOBAL_BATCH,
                                step,
                                &micro_batch,
                                None,
                                &ctx,
                            )?;
                            (out.grads, out.scalars.read().norm, out.loss_scale)
                        }
                        true => {
                            let share = GLOBAL_BATCH / par.data().ranks().size();
                            let first = step * GLOBAL_BATCH + par.data().ranks().rank() * share;
                            let mine = |s: std::ops::Range<usize>| {
                                micro_batch(first + s.start..first + s.end)
                            };
                            let out = par
                                .pipeline()?
                                .gradients(&model, share, &mine, &head, &ctx)?;
                            let (grads, norm) =
                                par.reduce_gradients(&model, out.grads, None, &ctx)?;
                            (grads, norm.value(), out.loss_scale)
                        }
                    };
                    model = optim.step(LR, model, grads);
                    let unchanged = flatten_params(&model) == before;
                    steps.push((!norm.is_finite(), scale, unchanged));
                }
                assert_eq!(
                    par.precision().loss_scale_state().map(|(s, _)| s),
                    steps.last().unwrap().1
                );
                Ok::<_, ParallelError>(steps)
            })
            .unwrap()
    };
    let steps = run(false);
    skips_then_applies(&steps);
    assert_eq!(run(true), steps, "pipeline_gradients with reduce_gradients");
}

#[test]
fn a_compute_view_inside_the_scope_computes_in_its_dtype() {
    // `MixedPrecision::compute_view` inside `Parallelized::forward`: the gathered units are
    // read in the view's dtype (bf16), their gradients reach the f32 shards in f32. Against
    // the same view under plain data parallelism (each rank the same samples, the same bf16
    // compute, the gradients summed in f32): the same losses (a unit computed in f32 would
    // change them by about 3e-3), and gradients within bf16's rounding: the stack's input
    // projection is read twice (it is the head too), and the two reads' gradients add in
    // bf16 on the view's one cast weight but in f32 on a gathered unit's two reads.
    let policy = MixedPrecision::new(Precision::BF16);
    // The inputs in the compute dtype too.
    let bf16_batch = |samples, device: &Device| {
        let (x, y) = batch(samples, device);
        (x.cast(Precision::BF16.float_dtype()), y)
    };
    let run = |mesh: &str, plan: &ParallelizePlan, recompute: bool| {
        plan_loop(mesh, plan, Stack::new, |model, par, step, ctx, device| {
            let samples = par.data().batch_share(GLOBAL_BATCH, step)?;
            let (loss, dtype) = par.forward(model, |m| {
                let view = policy.compute_view(m.clone());
                let dtype = view.layers[0].up.weight.val().dtype();
                let x = bf16_batch(samples, device);
                let loss = match recompute {
                    true => view.loss_recomputed(&x),
                    false => view.loss(&x),
                };
                (loss, dtype)
            })?;
            assert_eq!(dtype, burn::tensor::DType::BF16);
            let mean = par.data().mean_loss(loss.clone().into_scalar::<f32>())?;
            let (grads, norm) = par.gradients(model, loss.backward(), Some(MAX_NORM), ctx)?;
            Ok((grads, mean, norm.value()))
        })
        .0
    };
    let f32_one_rank = stack_single_rank();
    let plan = ParallelizePlan::new().fully_shard("");
    for recompute in [false, true] {
        let data_parallel = run("dp=2", &ParallelizePlan::new(), recompute);
        let sharded = run("fsdp=2", &plan, recompute);
        let (loss, norm, weights) = differences(&sharded, &data_parallel);
        // Recomputed, both runs hand each gradient back through the view's bf16 leaves once:
        // data parallelism each rank's before the sum, a unit the reduce-scattered sum.
        let same_losses = if recompute { 1e-2 } else { 1e-5 };
        assert!(
            loss < same_losses && norm < 1e-2 && weights < 1e-2,
            "recompute {recompute}: losses {loss:e}, norms {norm:e}, weights {weights:e}"
        );
        let (from_f32, _, _) = differences(&sharded, &f32_one_rank);
        assert!(from_f32 > 1e-4, "recompute {recompute}: computed as f32");
    }
}

/// Bytes this rank's all-gathers and reduce-scatters moved.
type Moved = (u64, u64);

/// `Stack` trained under `plan` on `mesh`, every forward inside `Parallelized::forward` on the
/// bf16 inputs of `dtype`, every backward through `Parallelized::backward`; with
/// `users_view`, the forward computes on the user's own bf16 view of the model (what a plan
/// without `mixed_precision` needs). Rank 0's run and the bytes its unit collectives moved.
fn stack_loop(mesh: &str, plan: &ParallelizePlan, users_view: bool) -> (Run, Moved) {
    let out = Launch::new(mesh)
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (mut model, par) = parallelize(Stack::new(&device), plan, &ctx)?;
            let mut optim = AdamWConfig::new().init();
            let (mut losses, mut norms) = (vec![], vec![]);
            let before = ctx.comm_stats();
            for step in 0..STEPS {
                let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, step)?, &device);
                let x = (x.cast(Precision::BF16.float_dtype()), y);
                let loss = par.forward(&model, |m| match users_view {
                    true => MixedPrecision::new(Precision::BF16)
                        .compute_view(m.clone())
                        .loss(&x),
                    false => {
                        assert_eq!(m.layers[0].up.weight.val().dtype(), DType::BF16);
                        m.loss(&x)
                    }
                })?;
                losses.push(par.data().mean_loss(loss.clone().into_scalar::<f32>())?);
                let backward = par.backward(loss);
                let (grads, norm) = par.gradients(&model, backward, Some(MAX_NORM), &ctx)?;
                norms.push(norm.value());
                model = optim.step(LR, model, grads);
            }
            let moved = ctx.comm_stats().since(&before);
            let bytes = |op| moved.ops.get(&op).map_or(0, |s| s.bytes);
            let moved = (bytes(OpKind::AllGather), bytes(OpKind::ReduceScatter));
            let whole = flatten_params(&par.sharded().whole(model)?);
            Ok::<_, ParallelError>(((losses, norms, whole), moved))
        })
        .unwrap();
    out.into_iter().next().unwrap()
}

/// `Stack`'s plain loop on one device computing on the bf16 view of its weights.
fn bf16_single_rank() -> Run {
    let policy = MixedPrecision::new(Precision::BF16);
    let device = Device::flex().autodiff();
    reference_loop(Stack::new(&device), |model, samples| {
        let (x, y) = batch(samples, &device);
        let x = (x.cast(Precision::BF16.float_dtype()), y);
        policy.compute_view(model.clone()).loss(&x)
    })
}

#[test]
fn a_plans_mixed_precision_computes_gathers_and_reduces_in_its_dtypes() {
    let bf16 = MixedPrecision::new(Precision::BF16);
    let units = ParallelizePlan::new().fully_shard("");
    // The plan's policy needs nothing in the forward: the same run as the user's own view
    // inside the scope of a plan without one, bit for bit, its units gathered in half the
    // bytes (the values the view reads are bf16 either way).
    let (users, users_moved) = stack_loop("fsdp=2", &units, true);
    let (planned, planned_moved) =
        stack_loop("fsdp=2", &units.clone().mixed_precision(bf16), false);
    assert_eq!(planned, users, "the plan's bf16 against the user's view");
    assert!(users_moved.0 > 0, "units must be gathered: {users_moved:?}");
    assert_eq!(2 * planned_moved.0, users_moved.0, "all-gather bytes");
    assert_eq!(
        planned_moved.1, users_moved.1,
        "reduce-scatter bytes (f32 both)"
    );
    // It computed in bf16: within bf16's rounding of the one-rank bf16 loop, off f32's.
    let (loss, norm, weights) = differences(&planned, &bf16_single_rank());
    assert!(
        loss < 1e-2 && norm < 1e-2 && weights < 1e-2,
        "against the bf16 loop: losses {loss:e}, norms {norm:e}, weights {weights:e}"
    );
    let (from_f32, _, _) = differences(&planned, &stack_single_rank());
    assert!(from_f32 > 1e-4, "computed as f32 ({from_f32:e})");
    // A bf16 reduction: the units reduce-scatter in half the bytes, and the sums round, so
    // the run moves off the f32-reduced one while staying within bf16's rounding of one rank.
    let bf16_reduced = MixedPrecision {
        reduce_dtype: Precision::BF16,
        ..bf16
    };
    let (reduced, reduced_moved) = stack_loop(
        "fsdp=2",
        &units.clone().mixed_precision(bf16_reduced),
        false,
    );
    assert_eq!(2 * reduced_moved.1, planned_moved.1, "reduce-scatter bytes");
    let (loss, norm, weights) = differences(&reduced, &planned);
    assert!(
        norm > 0.0 && norm < 1e-2 && loss < 1e-2 && weights < 1e-2,
        "bf16 against f32 reduction: losses {loss:e}, norms {norm:e}, weights {weights:e}"
    );
    // Plain data parallelism reduces in the policy's dtype too.
    let ddp = |policy| {
        stack_loop(
            "dp=2",
            &ParallelizePlan::new().mixed_precision(policy),
            false,
        )
        .0
    };
    let (loss, norm, weights) = differences(&ddp(bf16_reduced), &ddp(bf16));
    assert!(
        norm > 0.0 && norm < 1e-2 && loss < 1e-2 && weights < 1e-2,
        "dp=2 bf16 against f32 reduction: losses {loss:e}, norms {norm:e}, weights {weights:e}"
    );
}

#[test]
fn a_plans_loss_scale_skips_overflowing_steps_and_forwards_outside_it_are_refused() {
    // f16 with a dynamic scale that overflows (2^24 x a loss of about 3), without pipeline:
    // `Parallelized::backward` scales, `gradients` unscales and skips alike on every rank,
    // the scale halving until the gradients are finite; then the steps apply.
    let overflowing = MixedPrecision {
        loss_scale: LossScale::Dynamic {
            initial: 16_777_216.0,
            growth_interval: 1000,
        },
        ..MixedPrecision::new(Precision::F16)
    };
    let plan = ParallelizePlan::new()
        .fully_shard("")
        .mixed_precision(overflowing);
    let steps = Launch::new("dp=2,fsdp=2")
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (mut model, par) = parallelize(Stack::new(&device), &plan, &ctx)?;
            let mut optim = AdamWConfig::new().init();
            let mut steps = vec![];
            for step in 0..12 {
                let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, step)?, &device);
                let x = (x.cast(Precision::F16.float_dtype()), y);
                let scale = par.precision().loss_scale();
                let loss = par.forward(&model, |m| m.loss(&x))?;
                let backward = par.backward(loss);
                let before = flatten_params(&par.sharded().whole(model.clone())?);
                let (grads, norm) = par.gradients(&model, backward, None, &ctx)?;
                model = optim.step(LR, model, grads);
                let unchanged = flatten_params(&par.sharded().whole(model.clone())?) == before;
                steps.push((!norm.value().is_finite(), scale, unchanged));
            }
            Ok::<_, ParallelError>(steps)
        })
        .unwrap();
    skips_then_applies(&steps);
    // A forward outside `Parallelized::forward` would compute in f32, a backward of the
    // unscaled loss would be divided by the scale: both are refused at the reduction.
    let refused = |plan: &ParallelizePlan, inside: bool, scaled: bool| {
        Launch::new("dp=2")
            .unwrap()
            .run(|ctx| {
                let device = Device::flex().autodiff();
                let (model, par) = parallelize(Stack::new(&device), plan, &ctx)?;
                let dtype = par.precision().policy().param_dtype.float_dtype();
                let (x, y) = batch(par.data().batch_share(GLOBAL_BATCH, 0)?, &device);
                let x = (x.cast(dtype), y);
                let loss = match inside {
                    true => par.forward(&model, |m| m.loss(&x))?,
                    false => par
                        .precision()
                        .policy()
                        .compute_view(model.clone())
                        .loss(&x),
                };
                let backward = match scaled {
                    true => par.backward(loss),
                    false => loss.backward(),
                };
                par.gradients(&model, backward, None, &ctx).map(|_| ())
            })
            .unwrap_err()
            .to_string()
    };
    let bf16 = ParallelizePlan::new().mixed_precision(MixedPrecision::new(Precision::BF16));
    let err = refused(&bf16, false, true);
    assert!(
        err.contains("Parallelized::forward") && err.contains("bf16"),
        "{err}"
    );
    let f16 = ParallelizePlan::new().mixed_precision(MixedPrecision::new(Precision::F16));
    let err = refused(&f16, true, false);
    assert!(err.contains("Parallelized::backward"), "{err}");
}

#[test]
fn a_pipelined_plan_reduces_in_its_policys_dtype() {
    let rule = PipelineRule::new("layers", ScheduleKind::OneFOneB, 4)
        .first(&["input"])
        .last(&["norm", "input"]);
    let bf16 = MixedPrecision::new(Precision::BF16);
    let bf16_reduced = MixedPrecision {
        reduce_dtype: Precision::BF16,
        ..bf16
    };
    let run = |policy| {
        let plan = ParallelizePlan::new()
            .pipeline(rule.clone())
            .mixed_precision(policy);
        stack_pipelined_on("dp=2,pp=2", plan, || Device::flex().autodiff()).0
    };
    let (reduced, plain) = (run(bf16_reduced), run(bf16));
    let (loss, norm, weights) = differences(&reduced, &plain);
    assert!(
        norm > 0.0 && norm < 1e-2 && loss < 1e-2 && weights < 1e-2,
        "bf16 against f32 reduction: losses {loss:e}, norms {norm:e}, weights {weights:e}"
    );
    let (loss, norm, weights) = differences(&reduced, &bf16_single_rank());
    assert!(
        loss < 1e-2 && norm < 1e-2 && weights < 1e-2,
        "against the bf16 loop: losses {loss:e}, norms {norm:e}, weights {weights:e}"
    );
}

/// Every rank's steps `(skipped, loss scale, weights unchanged)` under a dynamic scale of 2^24
/// that overflows f16: the same on every rank; the first steps skipped, leaving the weights as
/// they were, the scale halving each time; then every step applies.
fn skips_then_applies(ranks: &[Vec<(bool, Option<f32>, bool)>]) {
    assert!(
        ranks.iter().all(|s| *s == ranks[0]),
        "ranks disagree: {ranks:?}"
    );
    let steps = &ranks[0];
    let first_applied = steps.iter().position(|s| !s.0).expect("a step applies");
    assert!(
        first_applied > 0,
        "a scale of 2^24 must overflow f16: {steps:?}"
    );
    for (k, (skipped, scale, unchanged)) in steps.iter().enumerate() {
        assert_eq!(
            *skipped, *unchanged,
            "step {k}: a skipped step changes no weight"
        );
        let halvings = k.min(first_applied) as i32;
        assert_eq!(
            *scale,
            Some(16_777_216.0 * 0.5f32.powi(halvings)),
            "step {k}"
        );
        assert_eq!(*skipped, k < first_applied, "step {k}: {steps:?}");
    }
}
