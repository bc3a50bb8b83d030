//! The loops the plan tests share: the plain single-rank Burn loop with clipping written out,
//! the same loop under a plan, and their differences. One file for two test binaries: the
//! library's strategy tests (a user's models) and the root crate's equivalence tests (the
//! reference transformer, which lives above the library), which include it by path.

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor};
use flashover_parallel::ParallelError;
use flashover_parallel::clip_global_norm;
use flashover_parallel::parallelize::{ParallelizePlan, Parallelized, parallelize};
use flashover_parallel::params::{
    ParamLayout, accumulate_grads, flatten_params, grads_from_flat, zero_grads,
};
use flashover_runtime::{Launch, RankContext};

pub(crate) const GLOBAL_BATCH: usize = 8;
pub(crate) const STEPS: usize = 6;
pub(crate) const LR: f64 = 2e-2;
/// Tight enough that clipping is active.
pub(crate) const MAX_NORM: f32 = 0.5;

/// Losses, gradient norms before clipping, and the final weights.
pub(crate) type Run = (Vec<f32>, Vec<f32>, Vec<f32>);

/// The plain Burn loop on one device over `model`, `loss(model, samples)` the loss of step
/// `s`'s samples `s * GLOBAL_BATCH..`, with global-norm clipping written out.
pub(crate) fn reference_loop<M: Module>(
    mut model: M,
    loss: impl Fn(&mut M, std::ops::Range<usize>) -> Tensor<1>,
) -> Run {
    let mut optim = AdamWConfig::new().init();
    let (mut losses, mut norms) = (vec![], vec![]);
    for step in 0..STEPS {
        let loss = loss(&mut model, step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH);
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let device = model.devices()[0].clone().inner();
        let (flat, _) = accumulate_grads(&model, &grads, zero_grads(&model, &device), &[]);
        let (flat, norm) = clip_global_norm(flat, Some(MAX_NORM)).expect("one device");
        norms.push(norm.value());
        let grads = grads_from_flat(&model, &flat);
        model = optim.step(LR, model, grads);
    }
    (losses, norms, flatten_params(&model))
}

/// What one step of [`plan_loop`] computed: the gradients to step, the whole batch's mean
/// loss and the gradient norm before clipping.
pub(crate) type Step = Result<(GradientsParams, f32, f32), ParallelError>;

/// `STEPS` steps of Burn's AdamW on the model `new` builds, parallelized by `plan` on `mesh`,
/// each step's gradients from `step(model, par, step, ctx, device)`: rank 0's run, and every
/// rank's stored parameter elements.
pub(crate) fn plan_loop<M: Module>(
    mesh: &str,
    plan: &ParallelizePlan,
    new: impl Fn(&Device) -> M + Sync,
    step: impl Fn(&mut M, &Parallelized, usize, &RankContext, &Device) -> Step + Sync,
) -> (Run, Vec<usize>) {
    plan_loop_on(&Device::flex().autodiff(), mesh, plan, new, step)
}

/// [`plan_loop`] with the model and batches on `device` (an autodiff device).
pub(crate) fn plan_loop_on<M: Module>(
    device: &Device,
    mesh: &str,
    plan: &ParallelizePlan,
    new: impl Fn(&Device) -> M + Sync,
    step: impl Fn(&mut M, &Parallelized, usize, &RankContext, &Device) -> Step + Sync,
) -> (Run, Vec<usize>) {
    let out = Launch::new(mesh)
        .unwrap()
        .run(|ctx| {
            let device = device.clone();
            let (mut model, par) = parallelize(new(&device), plan, &ctx)?;
            let held = ParamLayout::of(&model).numel;
            let mut optim = AdamWConfig::new().init();
            let (mut losses, mut norms) = (vec![], vec![]);
            for s in 0..STEPS {
                let (grads, loss, norm) = step(&mut model, &par, s, &ctx, &device)?;
                losses.push(loss);
                norms.push(norm);
                model = optim.step(LR, model, grads);
            }
            let whole = flatten_params(&par.sharded().whole(model)?);
            Ok::<_, ParallelError>(((losses, norms, whole), held))
        })
        .unwrap();
    let held = out.iter().map(|(_, h)| *h).collect();
    (out.into_iter().next().unwrap().0, held)
}

/// The largest relative differences of `run` from `reference`: losses, gradient norms, and
/// weights (relative to the largest weight, see [`max_scaled`]).
pub(crate) fn differences(run: &Run, reference: &Run) -> (f32, f32, f32) {
    (
        max_rel(&run.0, &reference.0),
        max_rel(&run.1, &reference.1),
        max_scaled(&run.2, &reference.2),
    )
}

pub(crate) fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-3))
        .fold(0.0, f32::max)
}

/// The largest difference between `a` and `b` relative to `b`'s largest value: layouts add the
/// same products in another order, and Adam's normalised steps carry that rounding into weights
/// near zero, where an element-wise relative difference would measure it against ~0.
pub(crate) fn max_scaled(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    // `f32::max` passes over NaN: a diverged run would compare as equal.
    assert!(
        a.iter().chain(b).all(|x| x.is_finite()),
        "non-finite values"
    );
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / scale)
        .fold(0.0, f32::max)
}
