//! `flashover bench ...`.

use crate::bench::comm::{self, CommBenchConfig, Record};
use clap::{Args, Subcommand};
use flashover::OpKind;
use std::time::Duration;

/// Benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Every collective at sizes from 4 KiB to 256 MiB, with memcpy as the reference.
    Comm(CommArgs),
    /// Tokens/s of the reference model: plain Burn loop vs Flashover DDP at several dp.
    Train(Box<TrainArgs>),
    /// Per-rank memory of DDP and ZeRO-1/2/3 at several shard counts, vs the formulas.
    Memory(Box<MemoryArgs>),
    /// Measured pipeline bubbles per schedule, vs the formulas and the simulation.
    Pipeline(Box<PipelineArgs>),
    /// Checkpoint save and load throughput next to raw file writes and reads of the same bytes.
    Ckpt(CkptArgs),
    /// Mixture of experts: step and all-to-all time, drop rate and bytes per ep and capacity.
    Moe(Box<MoeArgs>),
    /// Context parallelism: per-rank working memory and step time vs sequence length and cp,
    /// and each rank's share of causal attention work with and without load balancing.
    Cp(Box<CpArgs>),
    /// Activation checkpointing: working memory and step time per policy at two model sizes.
    Recompute(Box<RecomputeArgs>),
    /// The planner's memory and step-time predictions against measured runs of a few meshes.
    Plan(Box<PlanCalibrationArgs>),
    /// Each fused CubeCL kernel against the unfused Burn operations it replaces.
    Kernels(KernelArgs),
    /// Causal attention's forward and backward: the fused kernels (no score tensor) against
    /// Burn's `module::attention`, time and memory kept for backward per sequence length.
    Attention(AttentionArgs),
    /// A plan's fully sharded parameters gathered per read against per unit with prefetch.
    Units(Box<UnitsArgs>),
    /// A loop of one's own under data parallelism: gradient buckets reduced during backward
    /// against after it.
    Overlap(Box<OverlapArgs>),
}

/// Options of `bench overlap`.
#[derive(Debug, Args)]
pub struct OverlapArgs {
    /// Job options (model, batch, sequence length, seed, `--bucket-mb`); the mesh per
    /// variant.
    #[command(flatten)]
    job: super::job::JobArgs,
    /// Data-parallel degrees, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    dps: Vec<usize>,
    /// Measured rounds (after one warm-up round); each runs both ways.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Steps each way per round.
    #[arg(long, default_value_t = 2)]
    round_steps: usize,
}

/// Options of `bench units`.
#[derive(Debug, Args)]
pub struct UnitsArgs {
    /// Job options (model, batch, sequence length, seed); the mesh per variant.
    #[command(flatten)]
    job: super::job::JobArgs,
    /// Fully sharded degrees, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    fsdps: Vec<usize>,
    /// Measured rounds (after one warm-up round); each runs both ways.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Steps each way per round.
    #[arg(long, default_value_t = 2)]
    round_steps: usize,
}

/// Options of `bench kernels`.
#[derive(Debug, Args)]
pub struct KernelArgs {
    /// Device: flex (the kernels' reference path on both sides) or wgpu (needs the `wgpu`
    /// feature).
    #[arg(long, default_value = "wgpu")]
    device: flashover::DeviceChoice,
    /// Timed runs per measurement (the median is reported).
    #[arg(long, default_value_t = 10)]
    repeats: usize,
}

/// Options of `bench attention`.
#[derive(Debug, Args)]
pub struct AttentionArgs {
    /// Device: wgpu or cuda (the kernels), or flex (their reference on both sides).
    #[arg(long, default_value = "wgpu")]
    device: flashover::DeviceChoice,
    /// Sequence lengths, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024")]
    seqs: Vec<usize>,
    /// Heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Head dimension.
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Input dtype: f32, bf16 or f16 (the kernels compute in f32).
    #[arg(long, default_value = "f32")]
    dtype: flashover_parallel::precision::Precision,
    /// Timed runs of each way per length (after one warm-up), alternating.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

/// Options of `bench plan`.
#[derive(Debug, Args)]
pub struct PlanCalibrationArgs {
    /// Job options (model, batch, steps); the mesh and ZeRO stage per variant.
    #[command(flatten)]
    job: super::job::JobArgs,
    /// Layouts as MESH or MESH:ZERO, separated by spaces.
    #[arg(
        long,
        value_delimiter = ' ',
        default_value = "dp=1 dp=2 dp=2:2 fsdp=2:3 tp=2 pp=2 cp=2"
    )]
    layouts: Vec<String>,
}

/// Options of `bench recompute`.
#[derive(Debug, Args)]
pub struct RecomputeArgs {
    /// Job options (batch, sequence length, steps); model size and policy per variant.
    #[command(flatten)]
    job: super::job::JobArgs,
    /// Model sizes as d_model x n_layers, comma separated (heads from the job).
    #[arg(long, value_delimiter = ',', default_value = "128x4,256x8")]
    sizes: Vec<String>,
    /// Policies, comma separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "none,full,every:2,selective"
    )]
    policies: Vec<String>,
}

/// Options of `bench cp`.
#[derive(Debug, Args)]
pub struct CpArgs {
    /// Job options (model, batch, steps, --cp-attention); mesh and sequence length per variant.
    #[command(flatten)]
    job: super::job::JobArgs,
    /// Sequence lengths, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024")]
    seq_lens: Vec<usize>,
    /// Context-parallel degrees, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    cps: Vec<usize>,
}

/// Options of `bench moe`.
#[derive(Debug, Args)]
pub struct MoeArgs {
    /// Job options (model, data, steps, --experts, --top-k...); mesh and capacity per variant.
    #[command(flatten)]
    job: super::job::JobArgs,
    /// Expert-parallel degrees, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    eps: Vec<usize>,
    /// Capacity factors, comma separated (0: dropless).
    #[arg(long, value_delimiter = ',', default_value = "0,1,1.25,2")]
    capacity_factors: Vec<f64>,
}

/// Options of `bench ckpt`.
#[derive(Debug, Args)]
pub struct CkptArgs {
    /// Model parameters (each saved with two AdamW moments: 12 bytes per parameter).
    #[arg(long, default_value_t = 64 << 20)]
    params: usize,
    /// Writer threads (ranks).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Repeats (each writes everything anew).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Scratch directory (emptied; default: the system's temporary directory).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
}

/// Options of `bench pipeline`.
#[derive(Debug, Args)]
pub struct PipelineArgs {
    /// Job options (model, data, steps; batch is the rows per micro-batch x micro-batches).
    #[command(flatten)]
    job: super::job::JobArgs,
    /// Pipeline degrees, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    pps: Vec<usize>,
    /// Micro-batch counts, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    micro: Vec<usize>,
    /// Schedules, comma separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "gpipe,1f1b,interleaved,zb-h1"
    )]
    schedules: Vec<String>,
}

/// Options of `bench memory`.
#[derive(Debug, Args)]
pub struct MemoryArgs {
    /// Job options (model, data, bucket size...); mesh, stage and steps are set per variant.
    #[command(flatten)]
    job: super::job::JobArgs,
    /// Shard counts, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    ns: Vec<usize>,
    /// ZeRO stages (0 is DDP), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,3")]
    stages: Vec<u8>,
}

/// Options of `bench train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Job options (model, data, batch, steps...); the mesh is set per variant.
    #[command(flatten)]
    job: super::job::JobArgs,
    /// Data-parallel degrees to measure, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    dps: Vec<usize>,
    /// ZeRO stages to measure at the largest degree (1-2 over dp, 3 over fsdp), comma separated.
    #[arg(long, value_delimiter = ',')]
    zero_stages: Vec<u8>,
    /// Tensor-parallel degrees to measure (mesh tp=N), comma separated.
    #[arg(long, value_delimiter = ',')]
    tps: Vec<usize>,
    /// Interleaved repeats of every variant (medians are reported).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Print JSON lines instead of a table.
    #[arg(long)]
    json: bool,
}

/// Options of `bench comm`.
#[derive(Debug, Args)]
pub struct CommArgs {
    /// World sizes, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    worlds: Vec<usize>,
    /// Operations, comma separated (all_reduce, reduce_scatter, all_gather, broadcast, all_to_all).
    #[arg(long, value_delimiter = ',')]
    ops: Vec<String>,
    /// Smallest message (bytes; K, M, G suffixes).
    #[arg(long, default_value = "4K", value_parser = super::parse_bytes)]
    min_bytes: usize,
    /// Largest message.
    #[arg(long, default_value = "256M", value_parser = super::parse_bytes)]
    max_bytes: usize,
    /// Milliseconds to aim for per measurement.
    #[arg(long, default_value_t = 200)]
    target_ms: u64,
    /// Print one JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    /// Time each thread-engine measurement a second time with the flight recorder on
    /// (backend `thread+flight`), side by side.
    #[arg(long)]
    flight: bool,
    /// Time each thread-engine measurement again on Flex tensors through `TensorCollectives`,
    /// side by side: handed over by value (backend `thread+tensor`) and still held by another
    /// value (`thread+shared-tensor`); with `--backend nccl`, CUDA tensors (`nccl+tensor`, and at
    /// world size 1 `thread+tensor` on the same tensors).
    #[arg(long)]
    tensors: bool,
    /// `thread` (ranks as threads, --worlds), `mpi` (one rank per process: run under
    /// `mpirun`; needs the `mpi` feature) or `nccl` (one rank per GPU and process, started by
    /// `flashover launch --engine nccl`, or alone a world of one; needs the `cuda` and `nccl`
    /// features; `--tensors` times CUDA tensors, on their device buffers).
    #[arg(long, default_value = "thread")]
    backend: String,
}

/// `bench comm --backend nccl`'s world and GPU: this process's rank of a job started with
/// torchrun-style variables (`flashover launch --engine nccl`), or alone a world of one on GPU 0.
#[cfg(all(feature = "nccl", feature = "cuda"))]
fn nccl_world() -> Result<(flashover_comm::Group, burn::tensor::Device), String> {
    let timeout = Duration::from_secs(600);
    let (world, local_rank) = match super::job::process_world(timeout)? {
        Some((world, _)) if world.device_collectives().is_none() => {
            return Err(
                "--backend nccl: this process's world is not NCCL's (started by mpirun or Slurm?); start the ranks with `flashover launch --engine nccl -n N`".into(),
            );
        }
        Some(world) => world,
        None => (
            flashover_comm::NcclWorld::group(0, 1, 0, timeout, |id| Ok(vec![id.to_vec()]))
                .map_err(|e| e.to_string())?,
            0,
        ),
    };
    let device = flashover_runtime::DeviceChoice::Cuda
        .device(local_rank)
        .map_err(|e| e.to_string())?;
    Ok((world, device))
}

fn parse_op(name: &str) -> Result<OpKind, String> {
    comm::OPS
        .into_iter()
        .find(|o| o.name() == name.trim())
        .ok_or_else(|| format!("--ops: unknown op `{name}`; expected one of all_reduce, reduce_scatter, all_gather, broadcast, all_to_all"))
}

pub fn run(cmd: BenchCommand) -> Result<(), String> {
    match cmd {
        BenchCommand::Cp(args) => {
            let config = args.job.build_with_mesh("dp=1")?;
            let records = crate::bench::context::run(&config, &args.seq_lens, &args.cps)?;
            println!(
                "| seq len | cp | layout | working MiB / rank | vs cp=1 | step ms | attention work max/mean | attention time max/mean |"
            );
            println!("|---:|---:|---|---:|---:|---:|---:|---:|");
            for r in &records {
                let single = records
                    .iter()
                    .find(|s| s.seq_len == r.seq_len && s.cp == 1)
                    .map_or(f64::NAN, |s| {
                        r.working_bytes_per_rank / s.working_bytes_per_rank
                    });
                println!(
                    "| {} | {} | {} | {:.1} | {:.3} | {:.0} | {:.3} | {:.3} |",
                    r.seq_len,
                    r.cp,
                    if r.cp == 1 {
                        "-"
                    } else if r.load_balanced {
                        "head+tail"
                    } else {
                        "contiguous"
                    },
                    r.working_bytes_per_rank / (1 << 20) as f64,
                    single,
                    r.step_s * 1e3,
                    r.work_imbalance,
                    r.time_imbalance
                );
            }
            Ok(())
        }
        BenchCommand::Kernels(args) => {
            let device = args.device.device(0).map_err(|e| e.to_string())?;
            let mut records = crate::bench::kernels::run(&device, args.repeats)?;
            if flashover_kernels::is_cube_device(&device) {
                records.extend(crate::bench::kernels::run_training(
                    args.device,
                    10,
                    args.repeats.div_ceil(5),
                )?);
            }
            println!("device {device:?}");
            println!(
                "| operation | size | fused ms | unfused ms | unfused / fused | fused GB/s (minimum traffic) |"
            );
            println!("|---|---|---:|---:|---:|---:|");
            for r in &records {
                // Training steps have no minimum traffic to compare against.
                let rate = if r.bytes > 0.0 {
                    format!("{:.2}", r.bytes / r.fused_s / 1e9)
                } else {
                    "-".into()
                };
                println!(
                    "| {} | {} | {:.3} | {:.3} | {:.2} | {rate} |",
                    r.op,
                    r.size,
                    r.fused_s * 1e3,
                    r.unfused_s * 1e3,
                    r.unfused_s / r.fused_s,
                );
            }
            Ok(())
        }
        BenchCommand::Attention(args) => {
            let device = args.device.device(0).map_err(|e| e.to_string())?;
            let dtype = args.dtype.float_dtype().into();
            let records = crate::bench::attention::run(
                &device,
                &args.seqs,
                args.heads,
                args.head_dim,
                dtype,
                args.repeats,
            )?;
            println!(
                "device {device:?}, {} heads x {}, {:?}",
                args.heads, args.head_dim, args.dtype
            );
            println!("| seq | way | forward+backward ms | kept for backward MiB | time / fused |");
            println!("|---:|---|---:|---:|---:|");
            for pair in records.chunks(2) {
                let fused = pair[0].step_s;
                for r in pair {
                    let kept = r.kept_mib.map_or("-".into(), |m| format!("{m:.1}"));
                    let ms = match &r.error {
                        Some(e) => format!("failed: {}", e.lines().next().unwrap_or(e)),
                        None => format!("{:.2}", r.step_s * 1e3),
                    };
                    let ratio = r.step_s / fused;
                    println!("| {} | {} | {ms} | {kept} | {ratio:.2} |", r.seq, r.way);
                }
            }
            Ok(())
        }
        BenchCommand::Plan(args) => {
            let config = args.job.build_with_mesh("dp=1")?;
            let layouts = args
                .layouts
                .iter()
                .map(|l| match l.split_once(':') {
                    Some((mesh, zero)) => zero
                        .parse::<u8>()
                        .map(|z| (mesh.to_string(), z))
                        .map_err(|e| format!("--layouts `{l}`: {e}")),
                    None => Ok((l.clone(), 0)),
                })
                .collect::<Result<Vec<_>, String>>()?;
            let (rate, records) = crate::bench::calibrate::run(&config, &layouts)?;
            println!(
                "matrix products measured at {:.1} GFLOP/s (fp32, Flex, 256 x 256)",
                rate / 1e9
            );
            println!(
                "| layout | state KiB predicted | measured | ratio | activations KiB predicted | working KiB measured | ratio | step ms predicted | measured | ratio |"
            );
            println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
            const KIB: f64 = 1024.0;
            for r in &records {
                println!(
                    "| {} | {:.1} | {:.1} | {:.3} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} |",
                    r.layout,
                    r.predicted_state / KIB,
                    r.measured_state / KIB,
                    r.predicted_state / r.measured_state,
                    r.predicted_activations / KIB,
                    r.measured_working / KIB,
                    r.predicted_activations / r.measured_working,
                    r.predicted_step * 1e3,
                    r.measured_step * 1e3,
                    r.predicted_step / r.measured_step
                );
            }
            Ok(())
        }
        BenchCommand::Units(args) => {
            let config = args.job.build_with_mesh("dp=1")?;
            let records =
                crate::bench::units::run(&config, &args.fsdps, args.rounds, args.round_steps)?;
            println!(
                "| fsdp | gathers | all-gathers / step | reduce-scatters / step | prefetched | gathered at most KiB | step ms | tokens/s | vs per read |"
            );
            println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|");
            for r in &records {
                let per_read = records
                    .iter()
                    .find(|p| p.fsdp == r.fsdp && p.gathers == "per read")
                    .map_or(f64::NAN, |p| r.tokens_per_s / p.tokens_per_s);
                let peak = r
                    .gathered_peak_bytes
                    .map_or("-".to_string(), |b| format!("{:.0}", b as f64 / 1024.0));
                println!(
                    "| {} | {} | {} | {} | {} | {} | {:.1} | {:.0} | {:.2}x |",
                    r.fsdp,
                    r.gathers,
                    r.all_gathers,
                    r.reduce_scatters,
                    r.prefetches,
                    peak,
                    r.step_s * 1e3,
                    r.tokens_per_s,
                    per_read
                );
            }
            Ok(())
        }
        BenchCommand::Overlap(args) => {
            let config = args.job.build_with_mesh("dp=1")?;
            let records =
                crate::bench::overlap::run(&config, &args.dps, args.rounds, args.round_steps)?;
            println!(
                "| dp | buckets reduced | buckets | comm ms | overlapped ms | exposed ms | step ms | tokens/s | vs after |"
            );
            println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|");
            for r in &records {
                let after = records
                    .iter()
                    .find(|p| p.dp == r.dp && !p.overlap)
                    .map_or(f64::NAN, |p| r.tokens_per_s / p.tokens_per_s);
                println!(
                    "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.2}x |",
                    r.dp,
                    if r.overlap {
                        "during backward"
                    } else {
                        "after backward"
                    },
                    r.buckets,
                    r.comm_s * 1e3,
                    r.overlapped_s * 1e3,
                    r.exposed_s * 1e3,
                    r.step_s * 1e3,
                    r.tokens_per_s,
                    after
                );
            }
            Ok(())
        }
        BenchCommand::Recompute(args) => {
            let config = args.job.build_with_mesh("dp=1")?;
            let sizes = args
                .sizes
                .iter()
                .map(|s| {
                    let (d, l) = s
                        .split_once('x')
                        .ok_or_else(|| format!("--sizes `{s}`: expected D_MODELxN_LAYERS"))?;
                    let parse = |v: &str| {
                        v.trim()
                            .parse::<usize>()
                            .map_err(|e| format!("--sizes `{s}`: {e}"))
                    };
                    Ok((parse(d)?, parse(l)?))
                })
                .collect::<Result<Vec<_>, String>>()?;
            let records = crate::bench::recompute::run(&config, &sizes, &args.policies)?;
            println!(
                "| model (d x layers) | policy | kept after forward MiB | vs none | step working MiB | vs none | step ms | vs none | final loss |"
            );
            println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
            for r in &records {
                let none = records
                    .iter()
                    .find(|n| n.model == r.model && n.policy == "none");
                let ratio = |f: &dyn Fn(&crate::bench::recompute::RecomputeBenchRecord) -> f64| {
                    none.map_or(f64::NAN, |n| f(r) / f(n))
                };
                const MIB: f64 = (1 << 20) as f64;
                println!(
                    "| {} | {} | {:.1} | {:.3} | {:.1} | {:.3} | {:.0} | {:.3} | {:.4} |",
                    r.model,
                    r.policy,
                    r.kept_bytes as f64 / MIB,
                    ratio(&|x| x.kept_bytes as f64),
                    r.working_bytes as f64 / MIB,
                    ratio(&|x| x.working_bytes as f64),
                    r.step_s * 1e3,
                    ratio(&|x| x.step_s),
                    r.loss
                );
            }
            Ok(())
        }
        BenchCommand::Moe(args) => {
            let mut config = args.job.build_with_mesh("dp=1")?;
            if config.moe.experts == 0 {
                config.moe.experts = 8;
            }
            let records = crate::bench::moe::run(&config, &args.eps, &args.capacity_factors)?;
            println!(
                "| ep | capacity factor | step ms | all-to-all ms | drop rate | imbalance | remote MiB/step | formula MiB/step | measured / formula |"
            );
            println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|");
            const MIB: f64 = (1 << 20) as f64;
            for r in &records {
                println!(
                    "| {} | {} | {:.1} | {:.1} | {:.4} | {:.2} | {:.3} | {:.3} | {} |",
                    r.ep,
                    r.capacity_factor
                        .map_or("dropless".into(), |f| f.to_string()),
                    r.step_ms,
                    r.a2a_ms,
                    r.drop_rate,
                    r.imbalance,
                    r.remote_bytes / MIB,
                    r.formula_bytes / MIB,
                    if r.formula_bytes > 0.0 {
                        format!("{:.3}", r.remote_bytes / r.formula_bytes)
                    } else {
                        "-".into()
                    }
                );
            }
            Ok(())
        }
        BenchCommand::Ckpt(args) => {
            let dir = args
                .dir
                .unwrap_or_else(|| std::env::temp_dir().join("flashover-bench-ckpt"));
            let records =
                crate::bench::checkpoint::run(&dir, args.params, args.ranks, args.repeats)?;
            println!(
                "| bytes | ranks | raw write GB/s | save GB/s | save / raw | raw read GB/s | load GB/s | load / raw |"
            );
            println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
            for r in &records {
                println!(
                    "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                    r.bytes,
                    r.ranks,
                    r.raw_write_gbs,
                    r.save_gbs,
                    r.save_gbs / r.raw_write_gbs,
                    r.raw_read_gbs,
                    r.load_gbs,
                    r.load_gbs / r.raw_read_gbs
                );
            }
            Ok(())
        }
        BenchCommand::Pipeline(args) => {
            let config = args.job.build_with_mesh("dp=1")?;
            let records =
                crate::bench::pipeline::run(&config, &args.pps, &args.micro, &args.schedules)?;
            println!(
                "| schedule | p | m | v | formula | simulated | measured | measured / formula | peak in flight (rank 0) | schedule ms |"
            );
            println!("|---|---|---|---|---:|---:|---:|---:|---:|---:|");
            for r in &records {
                println!(
                    "| {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.2} | {} | {:.1} |",
                    r.schedule,
                    r.pp,
                    r.micro_batches,
                    r.chunks,
                    r.formula,
                    r.simulated,
                    r.measured,
                    r.measured / r.formula,
                    r.peak_in_flight,
                    r.schedule_ms
                );
            }
            Ok(())
        }
        BenchCommand::Memory(args) => {
            let config = args.job.build_with_mesh("dp=1")?;
            let records = crate::bench::memory::run(&config, &args.stages, &args.ns)?;
            const MIB: f64 = (1 << 20) as f64;
            println!(
                "| layout | N | measured state (MiB) | formula (MiB) | measured / formula | gathered peak (MiB) | largest unit (MiB) |"
            );
            println!("|---|---|---|---|---|---|---|");
            for r in &records {
                let layout = if r.zero == 0 {
                    "DDP".to_string()
                } else {
                    format!("ZeRO-{}", r.zero)
                };
                println!(
                    "| {layout} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
                    r.n,
                    r.measured_state as f64 / MIB,
                    r.formula / MIB,
                    r.measured_state as f64 / r.formula,
                    r.gathered_peak as f64 / MIB,
                    r.largest_unit as f64 / MIB,
                );
            }
            Ok(())
        }
        BenchCommand::Train(args) => {
            let config = args.job.build_with_mesh("dp=1")?;
            let records = crate::bench::train::run(
                &config,
                &args.dps,
                &args.zero_stages,
                &args.tps,
                args.repeats,
            )?;
            let plain = records[0].tokens_per_s;
            for r in &records {
                if args.json {
                    println!("{}", serde_json::to_string(r).expect("records serialise"));
                } else {
                    let comm: Vec<String> = r
                        .exposed_ms
                        .iter()
                        .map(|(axis, exposed)| {
                            let hidden = r.overlapped_ms.get(axis).copied().unwrap_or(0.0);
                            format!("{axis} {exposed:.2}/{hidden:.2}")
                        })
                        .collect();
                    let comm = match comm.is_empty() {
                        true => String::new(),
                        false => format!("  comm ms/step exposed/overlapped: {}", comm.join(", ")),
                    };
                    println!(
                        "{:<16} {:>10.0} tokens/s {:>9.2} ms/step  ratio to plain Burn {:.3}  params/rank {:.3} MiB{comm}",
                        r.variant,
                        r.tokens_per_s,
                        r.step_ms,
                        r.tokens_per_s / plain,
                        r.param_bytes as f64 / (1 << 20) as f64
                    );
                }
            }
            Ok(())
        }
        BenchCommand::Comm(args) => {
            if args.backend == "thread" && args.worlds.iter().any(|&w| w < 2) {
                return Err("--worlds: every world size must be at least 2".into());
            }
            if args.min_bytes > args.max_bytes {
                return Err(format!(
                    "--min-bytes {} exceeds --max-bytes {}",
                    args.min_bytes, args.max_bytes
                ));
            }
            let ops = if args.ops.is_empty() {
                comm::OPS.to_vec()
            } else {
                args.ops
                    .iter()
                    .map(|o| parse_op(o))
                    .collect::<Result<_, _>>()?
            };
            let config = CommBenchConfig {
                worlds: args.worlds,
                ops,
                min_bytes: args.min_bytes,
                max_bytes: args.max_bytes,
                target: Duration::from_millis(args.target_ms),
                flight: args.flight,
                tensors: args.tensors,
            };
            // The header comes with the first record: under MPI only rank 0 emits.
            let mut header = !args.json;
            let emit = |r: &Record| {
                if args.json {
                    println!("{}", serde_json::to_string(r).expect("records serialise"));
                    return;
                }
                if std::mem::take(&mut header) {
                    println!(
                        "{:<15} {:>13} {:>5} {:>12} {:>12} {:>10} {:>10}",
                        "op", "backend", "world", "bytes", "time_us", "algbw", "busbw"
                    );
                }
                match r {
                    Record::Memcpy { bytes, gbps, .. } => {
                        println!(
                            "{:<15} {:>13} {:>5} {:>12} {:>12} {:>10.2} {:>10}",
                            "memcpy", "-", 1, bytes, "-", gbps, "-"
                        )
                    }
                    Record::Collective {
                        op,
                        backend,
                        world,
                        bytes,
                        time_s,
                        algbw_gbps,
                        busbw_gbps,
                    } => println!(
                        "{op:<15} {backend:>13} {world:>5} {bytes:>12} {:>12.1} {algbw_gbps:>10.2} {busbw_gbps:>10.2}",
                        time_s * 1e6
                    ),
                }
            };
            match args.backend.as_str() {
                "thread" => comm::run(&config, emit),
                #[cfg(feature = "mpi")]
                "mpi" => comm::run_mpi(&config, emit)?,
                #[cfg(not(feature = "mpi"))]
                "mpi" => {
                    return Err(
                        "--backend mpi: this build has no MPI engine; build with --features mpi and run under mpirun".into(),
                    );
                }
                #[cfg(all(feature = "nccl", feature = "cuda"))]
                "nccl" => {
                    let (world, device) = nccl_world()?;
                    comm::run_nccl(&config, &*world, &device, emit)?
                }
                #[cfg(not(all(feature = "nccl", feature = "cuda")))]
                "nccl" => {
                    return Err(
                        "--backend nccl: this build has no NCCL engine with CUDA tensors; build with --features cuda,nccl and run it on a GPU machine (alone for a world of one, or under `flashover launch --engine nccl -n N`)".into(),
                    );
                }
                other => {
                    return Err(format!("--backend `{other}`: expected thread, mpi or nccl"));
                }
            }
            Ok(())
        }
    }
}
