//! A loop of one's own whose forwards run through `Parallelized::forward`: gradient hooks fill
//! the plan's buckets during backward, and from the second step the last micro-batch's
//! backward reduces them. The same bits as reducing after backward, for one micro-batch, for
//! micro-batches accumulated over several backwards, and for several losses of one backward;
//! a step that runs more micro-batches than the one before, or two forwards before one
//! backward under ZeRO-2, is refused with the reason.

use crate::common::Net;
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use flashover_parallel::ParallelError;
use flashover_parallel::data_parallel::{GradientBuckets, GradientRows, ReductionTiming};
use flashover_parallel::parallelize::{ParallelizePlan, parallelize};
use flashover_parallel::params::flatten_params;
use flashover_runtime::Launch;

const STEPS: usize = 4;

/// How a step computes its gradients.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Step {
    /// One forward, one backward.
    One,
    /// Two micro-batches, each a forward and its backward, gradients accumulated.
    Accumulated,
    /// Two forwards whose losses are summed, one backward.
    SummedLosses,
}

fn rows(step: usize, micro: usize, rank: usize, device: &Device) -> Tensor<2> {
    let seed = (step * 10 + micro * 3 + rank) as f32;
    let x: Vec<f32> = (0..4 * 6).map(|i| (i as f32 * 0.11 + seed).cos()).collect();
    Tensor::from_data(TensorData::new(x, [4, 6]), device)
}

/// Every rank's final parameters after `STEPS` steps at `dp=3` in tiny buckets, and whether
/// each step's buckets were reduced during backward.
fn train(overlap: bool, kind: Step) -> Vec<(Vec<f32>, Vec<bool>)> {
    let buckets = GradientBuckets::default()
        .bucket_mb(64.0 / (1 << 20) as f64)
        .overlap(overlap);
    let plan = ParallelizePlan::new().gradient_buckets(buckets);
    Launch::new(3)
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (mut net, par) = parallelize(Net::new(&device), &plan, &ctx)?;
            let timing = par.reducer().buckets(&device).1;
            assert_eq!(
                timing == ReductionTiming::DuringBackward,
                overlap,
                "{timing}"
            );
            let mut optim = AdamWConfig::new().init();
            let mut during = vec![];
            let loss = |net: &Net, step, micro| {
                let y = net.forward(rows(step, micro, ctx.rank(), &device));
                y.powi_scalar(2).mean()
            };
            for step in 0..STEPS {
                let grads = match kind {
                    Step::One => {
                        let l = par.forward(&net, |n| loss(n, step, 0))?;
                        par.gradients(&net, l.backward(), Some(1.0), &ctx)?.0
                    }
                    Step::Accumulated => {
                        let mut sum = GradientsAccumulator::new();
                        for micro in 0..2 {
                            let l = par.forward(&net, |n| loss(n, step, micro))? / 2.0;
                            sum.accumulate(&net, GradientsParams::from_grads(l.backward(), &net));
                        }
                        par.reduce_gradients(&net, sum.grads(), Some(1.0), &ctx)?.0
                    }
                    Step::SummedLosses => {
                        let a = par.forward(&net, |n| loss(n, step, 0))?;
                        let b = par.forward(&net, |n| loss(n, step, 1))?;
                        let l = (a + b) / 2.0;
                        par.gradients(&net, l.backward(), Some(1.0), &ctx)?.0
                    }
                };
                during.push(par.reducer().last_reduction().reduced_during_backward);
                net = optim.step(1e-2, net, grads);
            }
            Ok::<_, ParallelError>((flatten_params(&net), during))
        })
        .unwrap()
}

#[test]
fn a_loops_buckets_reduced_during_backward_give_the_bits_of_reducing_after_it() {
    for kind in [Step::One, Step::Accumulated, Step::SummedLosses] {
        let after = train(false, kind);
        let during = train(true, kind);
        for (rank, ((a, hooks_a), (d, hooks_d))) in after.iter().zip(&during).enumerate() {
            assert_eq!(a, d, "{kind:?}, rank {rank}: parameters");
            assert_eq!(hooks_a, &vec![false; STEPS], "{kind:?}: overlap off");
            // The first step learns how many micro-batches a step runs; two losses of one
            // backward wait for the step's gradients.
            let during: Vec<bool> = (0..STEPS)
                .map(|s| s > 0 && kind != Step::SummedLosses)
                .collect();
            assert_eq!(hooks_d, &during, "{kind:?}: steps reduced during backward");
        }
        assert!(
            after.iter().all(|(p, _)| p == &after[0].0),
            "replicas agree"
        );
    }
}

#[test]
fn a_step_with_more_micro_batches_than_the_last_or_two_forwards_under_zero2_is_refused() {
    let err = Launch::new(2)
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (net, par) = parallelize(Net::new(&device), &ParallelizePlan::new(), &ctx)?;
            for micro_batches in [1, 1, 2] {
                for micro in 0..micro_batches {
                    let x = rows(0, micro, ctx.rank(), &device);
                    let l = par.forward(&net, |n| n.forward(x).mean())?;
                    let _ = l.backward();
                }
                let zero = Tensor::<1>::zeros([1], &device).require_grad();
                par.gradients(&net, zero.backward(), None, &ctx)?;
            }
            Ok::<_, ParallelError>(())
        })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("more micro-batches than the step before (1)"),
        "{err}"
    );
    let rows = GradientBuckets::default().rows(GradientRows::ReduceScatter);
    let plan = ParallelizePlan::new().gradient_buckets(rows);
    let err = Launch::new(2)
        .unwrap()
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let (net, par) = parallelize(Net::new(&device), &plan, &ctx)?;
            let x = rows_of(&ctx, &device);
            let _ = par.forward(&net, |n| n.forward(x.clone()))?;
            let _ = par.forward(&net, |n| n.forward(x))?;
            Ok::<_, ParallelError>(())
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("ran twice before a backward"), "{err}");
}

fn rows_of(ctx: &flashover_runtime::RankContext, device: &Device) -> Tensor<2> {
    rows(0, 0, ctx.rank(), device)
}
