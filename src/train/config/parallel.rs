//! `[parallel]`: how a job's ranks are arranged and what they share.

use flashover_parallel::activation_checkpointing::CheckpointPolicy;
use flashover_parallel::context_parallel::CpAttention;
use flashover_parallel::pipeline::ScheduleKind;
use serde::{Deserialize, Serialize};

/// How per-rank gradients combine: a setting parsed once, with the job file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GradientReduction {
    /// Losses are per-sample means: gradients are averaged over ranks and micro-batches.
    #[default]
    Mean,
    /// Losses are sums: gradients are summed.
    Sum,
}

impl std::str::FromStr for GradientReduction {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mean" => Ok(GradientReduction::Mean),
            "sum" => Ok(GradientReduction::Sum),
            other => Err(format!("`{other}`: expected mean or sum")),
        }
    }
}

impl std::fmt::Display for GradientReduction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GradientReduction::Mean => "mean",
            GradientReduction::Sum => "sum",
        })
    }
}

/// What carries the collectives of ranks run as threads of this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Engine {
    /// The thread engine: host memory shared by the rank threads, all on the job's device.
    #[default]
    Threads,
    /// NCCL: rank thread `r` on GPU `r`, collectives on the tensors' GPU memory (needs
    /// `run.device = cuda`, a GPU per rank, and a build with the `cuda` and `nccl` features).
    Nccl,
}

impl std::str::FromStr for Engine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "threads" => Ok(Engine::Threads),
            "nccl" => Ok(Engine::Nccl),
            other => Err(format!("`{other}`: expected threads or nccl")),
        }
    }
}

impl std::fmt::Display for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Engine::Threads => "threads",
            Engine::Nccl => "nccl",
        })
    }
}

/// Settings written as text in job files (`1f1b`, `every:2`) and held typed: serialised with
/// `Display`, read with `FromStr`, so a bad value fails when the file is read, naming it.
mod as_text {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};
    use std::fmt::Display;
    use std::str::FromStr;

    pub fn serialize<T: Display, S: Serializer>(value: &T, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(value)
    }

    pub fn deserialize<'de, T, D>(d: D) -> Result<T, D::Error>
    where
        T: FromStr<Err = String>,
        D: Deserializer<'de>,
    {
        String::deserialize(d)?.parse().map_err(D::Error::custom)
    }
}

/// `[parallel]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelSection {
    /// The mesh, e.g. `dp=4`.
    pub mesh: String,
    /// Gradient bucket size in MiB (the plan's `gradient_buckets.bucket_mb`).
    pub bucket_mb: f64,
    /// Reduce gradient buckets while backward runs (gradient hooks) where the schedule and
    /// the device allow; the report says when they were reduced and, if after backward, why
    /// (interleaved and zero-bubble schedules, hot-expert copies, a device without the hook).
    pub overlap: bool,
    /// Collective timeout in seconds.
    pub timeout_s: f64,
    /// For ranks run as threads of this process: `threads` (the thread engine) or `nccl` (one
    /// GPU per rank). Ranks started as processes (mpirun, `flashover launch`) take the
    /// launcher's engine, and this must stay `threads`.
    #[serde(with = "as_text")]
    pub engine: Engine,
    /// `mean` (losses are per-sample means: gradients averaged over ranks and micro-batches)
    /// or `sum` (losses are sums: gradients summed).
    #[serde(with = "as_text")]
    pub gradient_reduction: GradientReduction,
    /// ZeRO stage: 0 (DDP), 1 (AdamW state sharded by rows over `fsdp`, or `dp` without it),
    /// 2 (and gradients: each rank receives only its rows' sums), 3 (and parameters, in fully
    /// sharded units over `fsdp`, replicated over `dp`: HSDP).
    pub zero: u8,
    /// ZeRO-3: free each block's gathered parameters after its forward and gather them again
    /// in backward (the autodiff device gets Burn's balanced checkpointing, whose backward
    /// states do not keep them). `false` keeps them from forward to backward.
    pub reshard_after_forward: bool,
    /// With a `tp` axis: split the activations between the tensor-parallel regions along the
    /// sequence (Megatron's sequence parallelism).
    pub sequence_parallel: bool,
    /// With a `pp` axis: the schedule (gpipe, 1f1b, interleaved, zb-h1).
    #[serde(with = "as_text")]
    pub pp_schedule: ScheduleKind,
    /// With a `pp` axis and the interleaved schedule: model chunks per rank.
    pub pp_chunks: usize,
    /// With a `pp` axis: blocks per virtual stage (default: as `pp_split` says).
    pub pp_blocks: Option<Vec<usize>>,
    /// With a `pp` axis and no `pp_blocks`: `even` (same number of blocks per stage) or `cost`
    /// (balance an estimate of each stage's compute, the LM head included).
    pub pp_split: String,
    /// With a `cp` axis: how attention reaches other ranks' keys and values, `ring` or
    /// `all-to-all` (Ulysses; heads must divide by tp x cp).
    #[serde(with = "as_text")]
    pub cp_attention: CpAttention,
    /// With a `cp` axis: each rank holds a head and a tail chunk of every sequence so causal
    /// attention work is even (`false`: one contiguous chunk per rank).
    pub cp_load_balance: bool,
    /// Activation checkpointing (recomputation in backward): `none`, `full` (every block),
    /// `every:K` (blocks 0, K, 2K, ...), `blocks:I,J` (those blocks) or `selective` (Burn's
    /// balanced checkpointing: keep matrix products, recompute the rest).
    #[serde(with = "as_text")]
    pub activation_checkpointing: CheckpointPolicy,
}

impl Default for ParallelSection {
    fn default() -> Self {
        ParallelSection {
            mesh: "dp=2".into(),
            bucket_mb: 1.0,
            overlap: true,
            timeout_s: 300.0,
            engine: Engine::Threads,
            gradient_reduction: GradientReduction::Mean,
            zero: 0,
            reshard_after_forward: true,
            sequence_parallel: false,
            pp_schedule: ScheduleKind::OneFOneB,
            pp_chunks: 1,
            pp_blocks: None,
            pp_split: "even".into(),
            cp_attention: CpAttention::Ring,
            cp_load_balance: true,
            activation_checkpointing: CheckpointPolicy::None,
        }
    }
}
