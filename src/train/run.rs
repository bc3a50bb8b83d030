//! The training job: one closure per rank under the launcher; each rank builds its
//! [`PlanPipeline`](super::strategy::PlanPipeline) and loops over the steps: batches, the step, the record,
//! checkpoints.

use super::config::{Engine, TrainConfig};
use super::report::{StepRecord, TrainReport};
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover_data::{MarkovSource, TextSource, TokenSource};
use flashover_parallel::data_parallel::ReductionTiming;
use flashover_runtime::{Axis, Group, Launch, LaunchError, RankContext};
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The token source the configuration names.
pub fn token_source(config: &TrainConfig) -> Result<Arc<dyn TokenSource>, String> {
    let d = &config.data;
    Ok(match d.source.as_str() {
        "markov" => Arc::new(MarkovSource::new(d.vocab, d.branching, config.run.seed)),
        "text" => {
            let path = d
                .path
                .as_ref()
                .ok_or("data.path is required when data.source = \"text\"")?;
            Arc::new(
                TextSource::open(path, d.seq_len + 1, config.run.seed)
                    .map_err(|e| e.to_string())?,
            )
        }
        other => return Err(format!("data.source = `{other}`: expected markov or text")),
    })
}

/// Inputs and next-token targets for samples `indices`, each `seq_len + 1` tokens.
pub fn make_batch(
    source: &dyn TokenSource,
    indices: std::ops::Range<u64>,
    seq_len: usize,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let b = (indices.end - indices.start) as usize;
    let mut inputs = Vec::with_capacity(b * seq_len);
    let mut targets = Vec::with_capacity(b * seq_len);
    for i in indices {
        let s = source.sample(i, seq_len + 1);
        inputs.extend(s[..seq_len].iter().map(|&t| t as i64));
        targets.extend(s[1..].iter().map(|&t| t as i64));
    }
    (
        Tensor::from_data(TensorData::new(inputs, [b, seq_len]), device),
        Tensor::from_data(TensorData::new(targets, [b, seq_len]), device),
    )
}

/// Runs the job, every rank a thread of this process. `on_step` sees every step's record as it
/// completes (rank 0's thread).
///
/// ```
/// use flashover::train::{TrainConfig, train};
///
/// // The reference transformer, data parallel over two rank threads, three steps.
/// let config = TrainConfig::from_toml(
///     "[parallel]\nmesh = \"dp=2\"\n[run]\nsteps = 3\nglobal_batch = 4\n",
/// )
/// .unwrap();
/// let report = train(&config, &|step| assert!(step.loss.is_finite())).unwrap();
/// assert_eq!(report.steps.len(), 3);
/// assert_eq!(report.steps[0].ranks.len(), 2);
/// ```
pub fn train(
    config: &TrainConfig,
    on_step: &(dyn Fn(&StepRecord) + Sync),
) -> Result<TrainReport, String> {
    run_job(config, on_step, None)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "rank 0 gave no report".into())
}

/// Runs the job as rank `world.rank()` of a job whose ranks are processes (under `mpirun`,
/// with the MPI engine's world group), on device `local_rank` of `run.device`. The same code
/// as [`train`] runs on each rank, so the results are the thread launcher's. Rank 0 gets the
/// report (and calls `on_step`, writes the log); the others get `None`.
///
/// ```
/// use flashover::comm::{Group, ThreadWorld};
/// use flashover::train::{TrainConfig, train_process};
///
/// // Two ranks, each with its own world communicator, as two processes would have (here
/// // threads of the thread engine stand in for MPI).
/// let mut config = TrainConfig::default();
/// config.run.steps = 2;
/// config.run.global_batch = 4;
/// let reports: Vec<_> = std::thread::scope(|s| {
///     let ranks: Vec<_> = ThreadWorld::new(2)
///         .build()
///         .into_iter()
///         .map(|comm| {
///             let config = &config;
///             let world = Group::new(std::sync::Arc::new(comm));
///             s.spawn(move || train_process(config, &|_| {}, world, 0))
///         })
///         .collect();
///     ranks.into_iter().map(|r| r.join().unwrap().unwrap()).collect()
/// });
/// assert!(reports[0].is_some() && reports[1].is_none(), "rank 0 reports");
/// ```
pub fn train_process(
    config: &TrainConfig,
    on_step: &(dyn Fn(&StepRecord) + Sync),
    world: Group,
    local_rank: usize,
) -> Result<Option<TrainReport>, String> {
    run_job(config, on_step, Some((world, local_rank))).map_err(|e| e.to_string())
}

/// Why a job stopped: a rank failed (the likeliest root cause among the failed ranks), or
/// anything else.
#[derive(Debug)]
pub(crate) enum JobFailure {
    /// Rank `rank` failed first; `message` says how (and how many failed).
    Rank { rank: usize, message: String },
    /// The job could not run.
    Other(String),
}

impl From<String> for JobFailure {
    fn from(message: String) -> Self {
        JobFailure::Other(message)
    }
}

impl std::fmt::Display for JobFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobFailure::Rank { message, .. } | JobFailure::Other(message) => f.write_str(message),
        }
    }
}

/// The output of rank 0 of a finished job.
pub(crate) type JobOutput = Option<TrainReport>;

pub(crate) fn run_job(
    config: &TrainConfig,
    on_step: &(dyn Fn(&StepRecord) + Sync),
    process: Option<(Group, usize)>,
) -> Result<JobOutput, JobFailure> {
    let errors = config.validate();
    if !errors.is_empty() {
        return Err(format!("invalid configuration:\n  {}", errors.join("\n  ")).into());
    }
    let mesh = config.mesh()?;
    let source = token_source(config)?;
    let model_config = config.transformer(source.vocab_size())?;
    let local_rank = process.as_ref().map_or(0, |(_, local)| *local);
    let device = config
        .run
        .device
        .device(local_rank)
        .map_err(|e| e.to_string())?;
    let leader = process.as_ref().is_none_or(|(w, _)| w.rank() == 0);
    let log = match &config.run.log_jsonl {
        Some(path) if leader => Some(
            std::fs::File::create(path)
                .map_err(|e| format!("run.log_jsonl {}: {e}", path.display()))?,
        ),
        _ => None,
    };
    let log_error = std::sync::Mutex::new(None::<String>);
    let started = Instant::now();
    let transfers_before = flashover_runtime::transfers::snapshot();
    let timeout = Duration::from_secs_f64(config.parallel.timeout_s);
    let launch = Launch::new(&mesh)
        .map_err(|e| e.to_string())?
        .device(device)
        .timeout(timeout);
    let launch = match (config.parallel.engine, &process) {
        (Engine::Threads, _) => launch,
        (Engine::Nccl, None) => nccl_threads(launch, timeout)?,
        (Engine::Nccl, Some(_)) => {
            return Err(
                "parallel.engine = nccl is for ranks run as threads of one process; \
                 this process was started as one rank of a job, whose launcher's engine it uses"
                    .to_string()
                    .into(),
            );
        }
    };
    let body = |ctx: RankContext| {
        let emit = |record: &StepRecord| {
            on_step(record);
            if let Some(file) = log.as_ref() {
                let mut file = file;
                if let Err(e) = writeln!(
                    file,
                    "{}",
                    serde_json::to_string(record).expect("records serialise")
                ) {
                    *log_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                }
            }
        };
        super::rank::train_rank(&ctx, config, &model_config, source.as_ref(), &emit, started)
    };
    let failure = |e: LaunchError| match &e {
        LaunchError::Rank { cause, .. } => JobFailure::Rank {
            rank: cause.rank,
            message: e.to_string(),
        },
        LaunchError::Mesh(_) => JobFailure::Other(e.to_string()),
    };
    let output = match process {
        None => launch
            .run(body)
            .map_err(failure)?
            .into_iter()
            .next()
            .flatten(),
        Some((world, _)) => launch.run_process(world, body).map_err(failure)?,
    };
    if let Some(e) = log_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(format!("writing run.log_jsonl: {e}").into());
    }
    let Some((steps, params, buckets, timing)) = output else {
        return Ok(None);
    };
    let memory = steps
        .last()
        .map(|s| s.ranks.iter().map(|r| r.memory).collect())
        .unwrap_or_default();
    Ok(Some(TrainReport {
        tokens: steps.len() * config.run.global_batch * config.data.seq_len,
        steps,
        params,
        loss_floor: source.loss_floor(),
        num_params: model_config.num_params(),
        mesh: mesh.to_spec(),
        buckets,
        overlap: timing == ReductionTiming::DuringBackward,
        reduction: timing.to_string(),
        memory,
        zero: config.parallel.zero,
        shard_degree: match config.parallel.zero {
            0 => 1,
            3 => mesh.degree(Axis::Fsdp),
            // Rows over fsdp, or dp without it.
            _ if mesh.degree(Axis::Fsdp) > 1 => mesh.degree(Axis::Fsdp),
            _ => mesh.degree(Axis::Dp),
        },
        expert_params: model_config.moe.as_ref().map_or(0, |m| {
            model_config.n_layers * m.routed_params(model_config.d_model)
        }),
        expert_degree: mesh.degree(Axis::Ep),
        wall_s: started.elapsed().as_secs_f64(),
        host_transfers: flashover_runtime::transfers::snapshot().since(&transfers_before),
    }))
}

/// `launch` with rank thread `r` on GPU `r`, in an NCCL world of the launch's threads.
#[cfg(all(feature = "nccl", feature = "cuda"))]
fn nccl_threads(launch: Launch, timeout: Duration) -> Result<Launch, String> {
    Ok(launch.own_worlds(
        move |rank, size, exchange| {
            flashover_comm::NcclWorld::group(rank, size, rank, timeout, exchange)
        },
        |rank| {
            flashover_runtime::DeviceChoice::Cuda
                .device(rank)
                .map_err(|e| e.to_string())
        },
    ))
}

/// Without the `cuda` and `nccl` features there is no NCCL engine for CUDA tensors.
#[cfg(not(all(feature = "nccl", feature = "cuda")))]
fn nccl_threads(_launch: Launch, _timeout: Duration) -> Result<Launch, String> {
    Err(
        "parallel.engine = nccl: this build has no NCCL engine for CUDA tensors; build with \
         --features cuda,nccl"
            .into(),
    )
}
