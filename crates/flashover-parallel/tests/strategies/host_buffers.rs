//! Tensors reach the engines only through the tensor adapter. Every rank's groups are
//! flight-recorded, and the recorder tallies each byte-level call on a host buffer by purpose:
//! a tensor's bytes staged by `TensorCollectives` (the one place allowed to stage), control
//! values (counts, flags, codes, scalar metrics), or neither; set to refuse the third kind, it
//! fails such a call as an engine of device memory would. Two steps and the whole-model gather
//! of every strategy, alone and composed, run so, make no call of the third kind, and their
//! control calls carry no more than a few floats: no strategy hands the engine a host buffer of
//! its own, so on an engine that takes device memory every tensor would go as device memory.

use crate::parallelize_streams::{Batch, GLOBAL_BATCH, LR, SEQ, TwoStreams, cut, tokens, with_tp};
use burn::optim::AdamWConfig;
use burn::tensor::Device;
use flashover_parallel::activation_checkpointing::CheckpointPolicy;
use flashover_parallel::data_parallel::{GradientBuckets, GradientRows};
use flashover_parallel::parallelize::{
    ContextParallelRule, ParallelizePlan, Parallelized, PipelineRule, parallelize,
};
use flashover_parallel::pipeline::ScheduleKind;
use flashover_parallel::precision::{MixedPrecision, Precision};
use flashover_parallel::zero::RowAdamW;
use flashover_parallel::{FlatAdamWConfig, ParallelError};
use flashover_runtime::{HostBuffers, Launch, RankContext};

/// Steps each layout runs: the first builds the buckets and learns the stage boundary, the
/// second runs as every later one.
const STEPS: usize = 2;
/// The most floating-point values one control call may carry (the step's losses, the norm).
const SCALARS: usize = 4;

/// The model's rule on a mesh without `pp`: its layers one stage, two micro-batches.
fn one_stage(rule: PipelineRule) -> PipelineRule {
    PipelineRule {
        layers_per_stage: None,
        micro_batches: 2,
        ..rule
    }
}

fn micro_batches<'a>(
    par: &'a Parallelized,
    device: &'a Device,
) -> Result<impl Fn(std::ops::Range<usize>) -> Batch + Sync + 'a, ParallelError> {
    let positions = par.sequences().positions(SEQ)?;
    Ok(move |samples| -> Batch {
        let share = |t| {
            par.sequences()
                .share(t, 1)
                .expect("SEQ cuts into cp chunks")
        };
        let [source, target, next] = tokens(samples, device).map(share);
        (source, target, positions.clone(), next)
    })
}

/// Every rank's host-buffer tally after [`STEPS`] steps of `plan` and the whole-model gather,
/// stepped by Burn's AdamW, or by rows (ZeRO-1/2) when `rows` says how buckets hand them.
fn tallies(
    mesh: &str,
    plan: &ParallelizePlan,
    experts: bool,
    rows: Option<GradientRows>,
) -> Vec<HostBuffers> {
    let plan = match rows {
        Some(rows) => plan
            .clone()
            .gradient_buckets(GradientBuckets::default().rows(rows)),
        None => plan.clone(),
    };
    let tally = |ctx: &RankContext| {
        ctx.host_buffers()
            .expect("the launcher records every group")
    };
    Launch::new(mesh)
        .unwrap()
        .run(|ctx| {
            // As an engine of device memory would: a host buffer of a strategy's own fails
            // its call, naming it.
            let recorder = ctx
                .flight_recorder()
                .expect("the launcher records every group");
            recorder.refuse_unmarked();
            let device = Device::flex().autodiff();
            let (mut model, par) = parallelize(TwoStreams::new(experts, &device), &plan, &ctx)?;
            let micro_batch = micro_batches(&par, &device)?;
            let step = |model: &TwoStreams, step| {
                par.pipeline()?
                    .step(model, GLOBAL_BATCH, step, &micro_batch, Some(1.0), &ctx)
            };
            if rows.is_some() {
                let mut optim = RowAdamW::new(&par, &model, &FlatAdamWConfig::new(), true, &ctx)?;
                model = optim.between_steps(model);
                for i in 0..STEPS {
                    model = optim.for_step(model)?;
                    let out = step(&model, i)?;
                    model = optim.step(LR, model, out.rows, !out.skipped)?;
                }
                par.sharded().whole(optim.for_step(model)?)?;
            } else {
                let mut optim = AdamWConfig::new().init();
                for i in 0..STEPS {
                    let out = step(&model, i)?;
                    model = optim.step(LR, model, out.grads);
                }
                par.sharded().whole(model)?;
            }
            Ok::<_, ParallelError>(tally(&ctx))
        })
        .unwrap_or_else(|e| panic!("{mesh}: {e}"))
}

#[test]
fn every_strategy_hands_the_engines_tensors_only_through_the_adapter() {
    let one_f = ScheduleKind::OneFOneB;
    let pipelined = |rule| ParallelizePlan::new().pipeline(rule);
    let alone = |plan: ParallelizePlan| plan.pipeline(one_stage(cut(one_f, &[4])));
    let attention = ["encoder.*.attn.core", "decoder.*.attn.core"];
    let ring = ContextParallelRule::ring(&attention);
    let experts = "decoder.*.experts";
    #[rustfmt::skip]
    let layouts: Vec<(&str, &str, ParallelizePlan, bool, Option<GradientRows>)> = vec![
        ("dp=2", "buckets", alone(ParallelizePlan::new()), false, None),
        ("fsdp=2", "ZeRO-1 by rows", alone(ParallelizePlan::new()), false, Some(GradientRows::AllReduce)),
        ("fsdp=2", "ZeRO-2 by rows", alone(ParallelizePlan::new()), false, Some(GradientRows::ReduceScatter)),
        ("fsdp=2", "ZeRO-3", alone(ParallelizePlan::new().fully_shard("")), false, None),
        ("dp=2,fsdp=2", "HSDP", alone(ParallelizePlan::new().fully_shard("")), false, None),
        ("tp=2", "sequence parallel", alone(with_tp(ParallelizePlan::new())), false, None),
        ("cp=2", "ring", alone(ParallelizePlan::new().context_parallel(ring.clone())), false, None),
        ("cp=2", "all-to-all", alone(ParallelizePlan::new().context_parallel(ContextParallelRule::all_to_all(&attention))), false, None),
        ("ep=2", "experts", alone(ParallelizePlan::new().expert_parallel(experts)), true, None),
        ("pp=2", "1F1B", pipelined(cut(one_f, &[3, 1])), false, None),
        ("pp=2", "zero-bubble", pipelined(cut(ScheduleKind::ZeroBubbleH1, &[3, 1])), false, None),
        ("pp=2", "interleaved", pipelined(cut(ScheduleKind::Interleaved1F1B, &[1, 1, 1, 1]).chunks(2)), false, None),
        ("pp=2", "recomputed, bf16", pipelined(cut(one_f, &[3, 1])).activation_checkpointing(CheckpointPolicy::Full).mixed_precision(MixedPrecision::new(Precision::BF16)), false, None),
        ("fsdp=2,tp=2,pp=2", "ZeRO-3, sequence parallel", with_tp(pipelined(cut(one_f, &[2, 2]))).fully_shard(""), false, None),
        ("pp=2,ep=2,cp=2", "experts, ring", pipelined(cut(one_f, &[2, 2])).expert_parallel(experts).context_parallel(ring), true, None),
    ];
    for (mesh, what, plan, experts, rows) in layouts {
        for (rank, tally) in tallies(mesh, &plan, experts, rows).iter().enumerate() {
            let what = format!("{mesh} ({what}), rank {rank}");
            assert_eq!(
                tally.unmarked.calls, 0,
                "{what}: host buffers handed to the engine outside the adapter: {:?}",
                tally.first_unmarked
            );
            assert!(tally.staged.calls > 0, "{what}: no tensor was staged");
            assert!(
                tally.largest_float_control <= SCALARS,
                "{what}: {} floats in one control call",
                tally.largest_float_control
            );
        }
    }
}
