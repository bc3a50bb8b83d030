//! ZeRO stages 1-3 and HSDP against a one-rank reference and against DDP: the same model, data
//! and seed, losses every step and final parameters compared. The model's 128 weights do not
//! divide by 3, so world 3 exercises padding.

use crate::common::{Net, assert_caused_by};
use burn::tensor::{Device, Tensor, TensorData};
use flashover_parallel::data_parallel::{GradientBuckets, GradientRows};
use flashover_parallel::parallelize::{ParallelizePlan, parallelize};
use flashover_parallel::params::flatten_params;
use flashover_parallel::zero::RowAdamW;
use flashover_parallel::{FlatAdamWConfig, ParallelError};
use flashover_runtime::{Axis, FaultPlan, Launch, LaunchError, OpKind, RankContext};

const GLOBAL_BATCH: usize = 24;
const STEPS: usize = 5;
const LR: f64 = 0.02;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    /// Burn's AdamW on whole gradients averaged by a plan (DDP; the reference at world 1).
    Ddp,
    /// ZeRO stage 1 or 2 over `dp`: a plan's gradient rows stepped by `RowAdamW`.
    Zero(usize),
    /// ZeRO-3 over `fsdp` (and HSDP when the mesh also has `dp`): a plan's `fully_shard("")`,
    /// Burn's AdamW on the shards.
    Fsdp,
}

struct Run {
    /// Mean loss over the global batch, per step.
    losses: Vec<f32>,
    /// Every rank's final parameters (layout order of `Net`).
    params: Vec<Vec<f32>>,
}

/// Rows of step `step`, micro-batch `micro` for data-parallel rank `rank` of `ranks`.
fn batch(
    step: usize,
    rank: usize,
    ranks: usize,
    micro: usize,
    micros: usize,
    device: &Device,
) -> Tensor<2> {
    let per = GLOBAL_BATCH / ranks / micros;
    let first = step * GLOBAL_BATCH + rank * per * micros + micro * per;
    let x: Vec<f32> = (first * 6..(first + per) * 6)
        .map(|i| (i as f32 * 0.13).cos() + 0.2)
        .collect();
    Tensor::from_data(TensorData::new(x, [per, 6]), device)
}

fn loss(y: Tensor<2>) -> Tensor<1> {
    (y - 0.3).powi_scalar(2).mean()
}

/// Buckets of 50 f32 gradients.
fn buckets() -> GradientBuckets {
    GradientBuckets::default().bucket_mb(200.0 / (1 << 20) as f64)
}

/// ZeRO-1 (all-reduced buckets, rows kept) or ZeRO-2 (reduce-scattered) in the DDP
/// reference's buckets.
fn zero_buckets(stage: usize) -> GradientBuckets {
    let rows = match stage {
        1 => GradientRows::AllReduce,
        _ => GradientRows::ReduceScatter,
    };
    buckets().rows(rows)
}

fn adamw() -> FlatAdamWConfig {
    FlatAdamWConfig::new().with_weight_decay(0.01)
}

/// Mean over the data-parallel ranks of each rank's per-step loss.
fn global_losses(ctx: &RankContext, mine: &[f32]) -> Result<Vec<f32>, ParallelError> {
    use flashover_runtime::CommunicatorExt;
    let all = ctx.world().all_gather_vec(mine)?;
    let ranks = ctx.world_size() as f32;
    Ok((0..mine.len())
        .map(|s| all.chunks(mine.len()).map(|r| r[s]).sum::<f32>() / ranks)
        .collect())
}

fn train(mesh: &str, layout: Layout, micros: usize, clip: Option<f32>, faults: FaultPlan) -> Run {
    try_train(mesh, layout, micros, clip, faults).unwrap()
}

fn try_train(
    mesh: &str,
    layout: Layout,
    micros: usize,
    clip: Option<f32>,
    faults: FaultPlan,
) -> Result<Run, LaunchError> {
    let out = Launch::new(mesh)?
        .timeout(std::time::Duration::from_secs(30))
        .faults(faults)
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let batch_group = ctx.subgroup(&[Axis::Dp, Axis::Fsdp])?;
            let (rank, ranks) = (batch_group.rank(), batch_group.size());
            let mut losses = vec![];
            // The micro-batches' mean loss, one backward: the plan reduces after it.
            let mean_loss = |net: &Net, step: usize| {
                let mut sum = 0.0;
                let mut total: Option<Tensor<1>> = None;
                for m in 0..micros {
                    let l = loss(net.forward(batch(step, rank, ranks, m, micros, &device)));
                    sum += l.clone().into_scalar::<f32>();
                    total = Some(total.map_or(l.clone(), |t| t + l));
                }
                (
                    sum / micros as f32,
                    total.expect("a micro-batch") / micros as f32,
                )
            };
            let params = match layout {
                Layout::Ddp | Layout::Fsdp => {
                    let plan = match layout {
                        Layout::Ddp => ParallelizePlan::new().gradient_buckets(buckets()),
                        _ => ParallelizePlan::new().fully_shard(""),
                    };
                    let (mut net, par) = parallelize(Net::new(&device), &plan, &ctx)?;
                    let mut optim = adamw().to_burn().init();
                    for step in 0..STEPS {
                        let (mean, total) = par.forward(&net, |n| mean_loss(n, step))?;
                        losses.push(mean);
                        let (grads, _) = par.gradients(&net, total.backward(), clip, &ctx)?;
                        net = optim.step(LR, net, grads);
                    }
                    if let Some(stats) = par.sharded().unit_stats() {
                        let live = stats.snapshot().live_bytes;
                        assert_eq!(live, 0, "every gathered unit must be released");
                    }
                    flatten_params(&par.sharded().whole(net)?)
                }
                Layout::Zero(stage) => {
                    let plan = ParallelizePlan::new().gradient_buckets(zero_buckets(stage));
                    let (net, par) = parallelize(Net::new(&device), &plan, &ctx)?;
                    let mut optim = RowAdamW::new(&par, &net, &adamw(), true, &ctx)?;
                    let mut net = optim.between_steps(net);
                    for step in 0..STEPS {
                        let (mean, total) = mean_loss(&net, step);
                        losses.push(mean);
                        let (rows, _) = par.row_gradients(&net, total.backward(), clip, &ctx)?;
                        net = optim.step(LR, net, rows, true)?;
                    }
                    flatten_params(&net)
                }
            };
            Ok::<_, ParallelError>((global_losses(&ctx, &losses)?, params))
        })?;
    Ok(Run {
        losses: out[0].0.clone(),
        params: out.into_iter().map(|(_, p)| p).collect(),
    })
}

/// Largest difference relative to the largest magnitude of the reference.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn assert_matches(run: &Run, reference: &Run, what: &str) {
    assert!(
        run.params.iter().all(|p| p == &run.params[0]),
        "{what}: every rank must end with the same parameters"
    );
    let dl = rel_diff(&run.losses, &reference.losses);
    let dp = rel_diff(&run.params[0], &reference.params[0]);
    assert!(
        dl <= 1e-5 && dp <= 1e-5,
        "{what}: loss diff {dl:e}, param diff {dp:e}"
    );
}

fn reference(micros: usize, clip: Option<f32>) -> Run {
    train("dp=1", Layout::Ddp, micros, clip, FaultPlan::new())
}

#[test]
fn zero1_and_zero2_equal_ddp_bit_for_bit_without_accumulation() {
    for world in [2, 3] {
        let mesh = format!("dp={world}");
        let ddp = train(&mesh, Layout::Ddp, 1, Some(1.0), FaultPlan::new());
        for stage in [1, 2] {
            let zero = train(&mesh, Layout::Zero(stage), 1, Some(1.0), FaultPlan::new());
            assert_eq!(zero.params, ddp.params, "ZeRO-{stage} at world {world}");
            assert_eq!(zero.losses, ddp.losses, "ZeRO-{stage} at world {world}");
        }
    }
}

#[test]
fn zero_stages_match_one_rank_with_accumulation_and_clipping() {
    let reference = reference(1, Some(0.5));
    for world in [2, 3, 4] {
        let mesh = format!("dp={world}");
        for stage in [1, 2] {
            let run = train(&mesh, Layout::Zero(stage), 2, Some(0.5), FaultPlan::new());
            assert_matches(&run, &reference, &format!("ZeRO-{stage}, world {world}"));
        }
        let mesh = format!("fsdp={world}");
        let run = train(&mesh, Layout::Fsdp, 2, Some(0.5), FaultPlan::new());
        assert_matches(&run, &reference, &format!("ZeRO-3, world {world}"));
    }
}

#[test]
fn zero3_equals_ddp_and_hsdp_matches_one_rank() {
    let ddp = train("dp=3", Layout::Ddp, 1, None, FaultPlan::new());
    let fsdp = train("fsdp=3", Layout::Fsdp, 1, None, FaultPlan::new());
    // Same sums in the same rank order, AdamW bit-identical: only clipping could differ.
    assert_matches(&fsdp, &ddp, "ZeRO-3 vs DDP at world 3");
    let reference = reference(1, Some(0.5));
    for mesh in ["dp=2,fsdp=2", "dp=2,fsdp=3", "dp=3,fsdp=2"] {
        let run = train(mesh, Layout::Fsdp, 1, Some(0.5), FaultPlan::new());
        assert_matches(&run, &reference, &format!("HSDP {mesh}"));
    }
}

#[test]
fn injected_delays_before_gathers_and_reduce_scatters_do_not_change_results() {
    let delays = || {
        FaultPlan::new()
            .delay_every(0, OpKind::AllGather, std::time::Duration::from_millis(2))
            .delay_every(
                2,
                OpKind::ReduceScatter,
                std::time::Duration::from_millis(2),
            )
            .delay_every(1, OpKind::AllReduce, std::time::Duration::from_millis(1))
    };
    for layout in [Layout::Zero(2), Layout::Fsdp] {
        let mesh = if layout == Layout::Zero(2) {
            "dp=3"
        } else {
            "fsdp=3"
        };
        let plain = train(mesh, layout, 2, Some(0.5), FaultPlan::new());
        let delayed = train(mesh, layout, 2, Some(0.5), delays());
        assert_eq!(plain.params, delayed.params, "{layout:?}");
        assert_eq!(plain.losses, delayed.losses, "{layout:?}");
    }
}

#[test]
fn zero_shards_optimizer_state_and_gradients() {
    let out = flashover_runtime::launch(3, |ctx| {
        let device = Device::flex().autodiff();
        let dp = ctx.group(Axis::Dp);
        let mut seen = vec![];
        for stage in [1, 2] {
            let plan = ParallelizePlan::new().gradient_buckets(zero_buckets(stage));
            let (net, par) = parallelize(Net::new(&device), &plan, &ctx)?;
            let mut optim = RowAdamW::new(&par, &net, &adamw(), true, &ctx)?;
            let l = loss(net.forward(batch(0, dp.rank(), 3, 0, 1, &device)));
            let (rows, _) = par.row_gradients(&net, l.backward(), None, &ctx)?;
            let rows_len = rows.dims()[0];
            let _ = optim.step(LR, net, rows, true)?;
            seen.push((optim.held_elements(), rows_len));
        }
        Ok::<_, ParallelError>(seen)
    })
    .unwrap();
    // Rows over 3 ranks: a [6, 16] 2 rows (32 elements), b [16, 2] 6 rows (12, the last rank's
    // 2 of them padding): 44 per rank of the 128 weights.
    for (rank, seen) in out.iter().enumerate() {
        for ((params, moments), grads) in seen {
            assert_eq!(
                (*params, *moments, *grads),
                (128, 44, 44),
                "rank {rank}: whole parameters, moments and gradients of its rows only"
            );
        }
    }
}

#[test]
fn a_rank_dying_in_a_backward_reduce_scatter_fails_the_others_fast() {
    let start = std::time::Instant::now();
    let faults = FaultPlan::new().panic_at(1, OpKind::ReduceScatter, 3);
    let layout = Layout::Fsdp;
    let err = try_train("fsdp=3", layout, 1, None, faults)
        .err()
        .expect("training must fail");
    assert!(
        start.elapsed() < std::time::Duration::from_secs(20),
        "must not wait for the 30 s timeout"
    );
    let fragments = ["injected fault", "sharding communication thread"];
    assert_caused_by(&err, 1, &fragments, 3);
}
