//! Data parallel (a plan's gradient buckets) under injected faults: delays never change results; a rank that dies mid-training makes
//! the others fail fast with an error naming it.

use crate::common::{Net, assert_caused_by};
use burn::optim::AdamWConfig;
use burn::tensor::{Device, Tensor, TensorData};
use flashover_parallel::ParallelError;
use flashover_parallel::data_parallel::GradientBuckets;
use flashover_parallel::parallelize::{ParallelizePlan, parallelize};
use flashover_runtime::{FaultPlan, Launch, LaunchError, OpKind};
use std::time::{Duration, Instant};

/// Three ranks, five steps, two micro-batches, tiny buckets; returns every rank's final weights.
fn train(faults: FaultPlan) -> Result<Vec<Vec<f32>>, LaunchError> {
    Launch::new(3)?
        .timeout(Duration::from_secs(20))
        .faults(faults)
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let buckets = GradientBuckets::default().bucket_mb(64.0 / (1 << 20) as f64);
            let plan = ParallelizePlan::new().gradient_buckets(buckets);
            let (mut net, par) = parallelize(Net::new(&device), &plan, &ctx)?;
            let mut optim = AdamWConfig::new().init();
            for step in 0..5 {
                let mut total: Option<Tensor<1>> = None;
                for micro in 0..2 {
                    let seed = (step * 10 + micro * 3 + ctx.rank()) as f32;
                    let x: Vec<f32> = (0..4 * 6).map(|i| (i as f32 * 0.11 + seed).cos()).collect();
                    let x = Tensor::<2>::from_data(TensorData::new(x, [4, 6]), &device);
                    let loss = net.forward(x).powi_scalar(2).mean();
                    total = Some(total.map_or(loss.clone(), |t| t + loss));
                }
                let loss = total.expect("two micro-batches") / 2.0;
                let (grads, _) = par.gradients(&net, loss.backward(), Some(1.0), &ctx)?;
                net = optim.step(1e-2, net, grads);
            }
            Ok::<_, ParallelError>(net.a.weight.val().into_data().try_to_vec::<f32>().unwrap())
        })
}

#[test]
fn injected_delays_before_all_reduces_do_not_change_results() {
    let plain = train(FaultPlan::new()).unwrap();
    assert!(
        plain.iter().all(|w| w == &plain[0]),
        "replicas must stay identical"
    );
    let delayed = train(
        FaultPlan::new()
            .delay_every(0, OpKind::AllReduce, Duration::from_millis(2))
            .delay_every(2, OpKind::AllReduce, Duration::from_millis(1)),
    )
    .unwrap();
    assert_eq!(plain, delayed);
}

#[test]
fn a_rank_dying_during_gradient_reduction_fails_the_others_fast() {
    let start = Instant::now();
    let err = train(FaultPlan::new().panic_at(1, OpKind::AllReduce, 3)).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "must not wait for the 20 s timeout"
    );
    // The fault fires on rank 1's gradient communication thread; the training thread turns
    // it into an error, leaves, and the peers fail at once naming rank 1.
    let fragments = ["communication thread panicked: injected fault"];
    assert_caused_by(&err, 1, &fragments, 3);
}
