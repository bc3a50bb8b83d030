//! `flashover train` and `flashover verify`: flags that override the job file.

use clap::Args;
use flashover::DeviceChoice;
use flashover::train::{StepRecord, TrainConfig};
use flashover_parallel::precision::Precision;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;

/// When the strategies run the project's CubeCL kernels (`flashover_kernels::KernelUse`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kernels {
    /// On a CubeCL device that is a card.
    Auto,
    /// On every CubeCL device, CPU adapters included; on Flex, their tensor-op references
    /// (the device path, with no host loop).
    Always,
    /// Never: tensor operations and host loops everywhere.
    Never,
}

impl Kernels {
    /// Sets the policy for this process.
    fn apply(self) {
        flashover_kernels::set_kernel_use(match self {
            Kernels::Auto => flashover_kernels::KernelUse::Auto,
            Kernels::Always => flashover_kernels::KernelUse::Always,
            Kernels::Never => flashover_kernels::KernelUse::Never,
        });
    }
}

/// Job options shared by `train` and `verify`. Flags override `--config`, which overrides the
/// built-in defaults.
#[derive(Debug, Args)]
pub struct JobArgs {
    /// A TOML job file (see examples/configs/).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The mesh, e.g. `dp=4`.
    #[arg(long)]
    mesh: Option<String>,
    /// Optimizer steps.
    #[arg(long)]
    steps: Option<usize>,
    /// Read the losses and norms to the host every N steps, in one read (default 1).
    #[arg(long)]
    log_every: Option<usize>,
    /// Samples per step over all data-parallel ranks.
    #[arg(long)]
    global_batch: Option<usize>,
    /// Micro-batches per step on each rank (gradient accumulation).
    #[arg(long)]
    micro_batches: Option<usize>,
    /// Tokens per sample.
    #[arg(long)]
    seq_len: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    lr: Option<f64>,
    /// Clip the global gradient norm (0: off).
    #[arg(long)]
    clip: Option<f32>,
    /// Seed of model, data and everything random.
    #[arg(long)]
    seed: Option<u64>,
    /// Compute device: flex, wgpu or cuda (default: BURN_DEVICE, else flex).
    #[arg(long)]
    device: Option<DeviceChoice>,
    /// When the strategies run the project's CubeCL kernels (the optimizer, packing, the
    /// fused sharded ops): `auto` on a GPU and not on a CPU adapter such as lavapipe or on
    /// Flex (host loops there), `always` everywhere (the GPU path, runnable on lavapipe; the
    /// kernels' tensor-op references on Flex), `never`.
    #[arg(long, value_enum, default_value_t = Kernels::Auto)]
    kernels: Kernels,
    /// Model preset: tiny, small or base.
    #[arg(long)]
    model: Option<String>,
    /// Model width (overrides the preset).
    #[arg(long)]
    d_model: Option<usize>,
    /// Model depth (overrides the preset).
    #[arg(long)]
    n_layers: Option<usize>,
    /// Byte-level text file to train on instead of the embedded Markov chain.
    #[arg(long)]
    data: Option<PathBuf>,
    /// DDP bucket size in MiB.
    #[arg(long)]
    bucket_mb: Option<f64>,
    /// Reduce gradients after backward instead of during it.
    #[arg(long)]
    no_overlap: bool,
    /// ZeRO stage: 0 (DDP), 1 (optimizer state sharded over dp x fsdp), 2 (and gradients),
    /// 3 (and parameters, over fsdp; with dp too: HSDP).
    #[arg(long)]
    zero: Option<u8>,
    /// ZeRO-3: whether blocks release gathered parameters after forward (true) or keep them
    /// until backward (false).
    #[arg(long)]
    reshard_after_forward: Option<bool>,
    /// With a tp axis: split activations outside the tensor-parallel regions along the sequence.
    #[arg(long)]
    sequence_parallel: bool,
    /// With a pp axis: gpipe, 1f1b, interleaved or zb-h1.
    #[arg(long)]
    pp_schedule: Option<flashover_parallel::pipeline::ScheduleKind>,
    /// With a pp axis and the interleaved schedule: model chunks per rank.
    #[arg(long)]
    pp_chunks: Option<usize>,
    /// Activation checkpointing: none, full, selective, every:K or blocks:I,J.
    #[arg(long)]
    activation_checkpointing:
        Option<flashover_parallel::activation_checkpointing::CheckpointPolicy>,
    /// With a cp axis: ring or all-to-all attention.
    #[arg(long)]
    cp_attention: Option<flashover_parallel::context_parallel::CpAttention>,
    /// Compute dtype (mixed precision): f32, bf16 or f16; weights and AdamW state stay f32.
    #[arg(long)]
    precision: Option<Precision>,
    /// Gradient reduction dtype: f32 (default), bf16 or f16.
    #[arg(long)]
    reduce_dtype: Option<Precision>,
    /// Loss scaling: auto (dynamic for f16), none, dynamic, or a fixed factor.
    #[arg(long)]
    loss_scale: Option<String>,
    /// With a cp axis: one contiguous chunk per rank instead of a head and a tail chunk.
    #[arg(long)]
    no_cp_load_balance: bool,
    /// For ranks as threads: threads (the thread engine) or nccl (rank r on GPU r; needs
    /// --device cuda and the cuda and nccl features).
    #[arg(long)]
    engine: Option<flashover::train::Engine>,
    /// Untie the LM head from the embedding (needed with a pp axis).
    #[arg(long)]
    untie_embeddings: bool,
    /// Mixture of experts in every block (8 experts, top-2 unless --experts / --top-k say).
    #[arg(long)]
    moe: bool,
    /// Experts per MoE layer (implies --moe).
    #[arg(long)]
    experts: Option<usize>,
    /// Experts per token.
    #[arg(long)]
    top_k: Option<usize>,
    /// Hidden width of each expert (default: the model's d_ff).
    #[arg(long)]
    d_expert: Option<usize>,
    /// Router scores: softmax or sigmoid.
    #[arg(long)]
    router: Option<String>,
    /// Expert capacity factor (per sequence; 0: dropless).
    #[arg(long)]
    capacity_factor: Option<f64>,
    /// What an expert over capacity keeps: position or probability.
    #[arg(long)]
    drop_policy: Option<String>,
    /// Add a shared expert every token goes through.
    #[arg(long)]
    shared_expert: bool,
    /// Weight of the load-balancing loss.
    #[arg(long)]
    aux_loss_coef: Option<f64>,
    /// Weight of the router z-loss.
    #[arg(long)]
    z_loss_coef: Option<f64>,
    /// Auxiliary-loss-free balancing: per-step change of each expert's routing bias.
    #[arg(long)]
    bias_update_rate: Option<f64>,
    /// Balanced routing: Sinkhorn iterations per sequence before choosing (0: plain top-k).
    #[arg(long)]
    sinkhorn_iters: Option<usize>,
    /// Copy this many of each layer's hottest experts to every ep rank each step.
    #[arg(long)]
    replicate_hot: Option<usize>,
}

impl JobArgs {
    /// The job: defaults, then the file, then the flags; validated.
    pub fn build(&self) -> Result<TrainConfig, String> {
        self.build_with_mesh_override(None)
    }

    /// Like [`JobArgs::build`], with the mesh forced to `mesh` (benchmarks set it per variant).
    pub fn build_with_mesh(&self, mesh: &str) -> Result<TrainConfig, String> {
        self.build_with_mesh_override(Some(mesh))
    }

    fn build_with_mesh_override(&self, mesh: Option<&str>) -> Result<TrainConfig, String> {
        let mut c = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("--config {}: {e}", path.display()))?;
                TrainConfig::from_toml(&text)
                    .map_err(|e| format!("--config {}: {e}", path.display()))?
            }
            None => TrainConfig::default(),
        };
        if self.device.is_none()
            && self.config.is_none()
            && let Some(d) = DeviceChoice::from_env().map_err(|e| format!("BURN_DEVICE: {e}"))?
        {
            c.run.device = d;
        }
        set(&mut c.parallel.mesh, self.mesh.clone());
        set(&mut c.parallel.mesh, mesh.map(String::from));
        set(&mut c.run.steps, self.steps);
        set(&mut c.run.log_every, self.log_every);
        set(&mut c.run.global_batch, self.global_batch);
        set(&mut c.run.micro_batches, self.micro_batches);
        set(&mut c.data.seq_len, self.seq_len);
        set(&mut c.optim.lr, self.lr);
        set(&mut c.run.seed, self.seed);
        set(&mut c.run.device, self.device);
        set(&mut c.parallel.bucket_mb, self.bucket_mb);
        set(&mut c.parallel.zero, self.zero);
        set(
            &mut c.parallel.reshard_after_forward,
            self.reshard_after_forward,
        );
        if self.sequence_parallel {
            c.parallel.sequence_parallel = true;
        }
        set(&mut c.parallel.pp_schedule, self.pp_schedule);
        set(&mut c.parallel.pp_chunks, self.pp_chunks);
        set(&mut c.parallel.cp_attention, self.cp_attention);
        set(&mut c.parallel.engine, self.engine);
        set(&mut c.precision.param_dtype, self.precision);
        set(&mut c.precision.reduce_dtype, self.reduce_dtype);
        set(&mut c.precision.loss_scale, self.loss_scale.clone());
        set(
            &mut c.parallel.activation_checkpointing,
            self.activation_checkpointing.clone(),
        );
        if self.no_cp_load_balance {
            c.parallel.cp_load_balance = false;
        }
        if self.untie_embeddings {
            c.model.tie_embeddings = false;
        }
        if let Some(clip) = self.clip {
            c.optim.clip = (clip > 0.0).then_some(clip);
        }
        if let Some(preset) = &self.model {
            c.model = flashover::train::ModelSection {
                preset: preset.clone(),
                d_model: None,
                n_layers: None,
                n_heads: None,
                d_ff: None,
                ..c.model
            };
        }
        if self.d_model.is_some() {
            c.model.d_model = self.d_model;
        }
        if self.n_layers.is_some() {
            c.model.n_layers = self.n_layers;
        }
        if let Some(path) = &self.data {
            c.data.source = "text".into();
            c.data.path = Some(path.clone());
        }
        if self.no_overlap {
            c.parallel.overlap = false;
        }
        self.apply_moe(&mut c)?;
        let errors = c.validate();
        if !errors.is_empty() {
            return Err(format!("invalid job:\n  {}", errors.join("\n  ")));
        }
        Ok(c)
    }
}

impl JobArgs {
    /// The `[moe]` flags.
    fn apply_moe(&self, c: &mut TrainConfig) -> Result<(), String> {
        let m = &mut c.moe;
        if self.moe && m.experts == 0 {
            m.experts = 8;
        }
        set(&mut m.experts, self.experts);
        set(&mut m.top_k, self.top_k);
        if self.d_expert.is_some() {
            m.d_expert = self.d_expert;
        }
        if let Some(router) = &self.router {
            m.router = parse_choice("--router", router)?;
        }
        if let Some(policy) = &self.drop_policy {
            m.drop_policy = parse_choice("--drop-policy", policy)?;
        }
        if let Some(f) = self.capacity_factor {
            m.capacity_factor = (f != 0.0).then_some(f);
        }
        m.shared_expert |= self.shared_expert;
        set(&mut m.aux_loss_coef, self.aux_loss_coef);
        set(&mut m.z_loss_coef, self.z_loss_coef);
        set(&mut m.bias_update_rate, self.bias_update_rate);
        set(&mut m.sinkhorn_iters, self.sinkhorn_iters);
        set(&mut m.replicate_hot, self.replicate_hot);
        Ok(())
    }
}

/// A lowercase enum value as the job file spells it.
fn parse_choice<T: serde::de::DeserializeOwned>(flag: &str, value: &str) -> Result<T, String> {
    serde_json::from_value(serde_json::Value::String(value.to_string()))
        .map_err(|e| format!("{flag} {value}: {e}"))
}

fn set<T>(field: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *field = v;
    }
}

/// What `train` writes and resumes from, beyond the job file.
#[derive(Debug, Args)]
pub struct TrainOutputs {
    /// Write one JSON line per step to this file.
    #[arg(long)]
    log_jsonl: Option<PathBuf>,
    /// Write a Chrome trace (Perfetto) of every rank's steps and pipeline actions here.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Save a sharded checkpoint every N steps and after the last one (into --ckpt-dir).
    #[arg(long)]
    save_every: Option<usize>,
    /// Directory of checkpoints (one `step-NNNNNNNN` directory each).
    #[arg(long)]
    ckpt_dir: Option<PathBuf>,
    /// Committed checkpoints to keep.
    #[arg(long)]
    keep_checkpoints: Option<usize>,
    /// Write checkpoints in the background while training continues.
    #[arg(long)]
    async_save: bool,
    /// Resume from a checkpoint (a `step-*` directory or a directory of them: the newest),
    /// on any mesh.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Start from the weights in this safetensors file (e.g. from `ckpt export`), any mesh.
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Stop after this many steps (from step 0), as an interrupted job would; the schedule
    /// still spans --steps.
    #[arg(long)]
    exit_after: Option<usize>,
    /// Elastic: when a rank fails, continue on the survivors (a mesh chosen for them),
    /// resumed from the newest committed checkpoint. Needs --ckpt-dir and --save-every.
    #[arg(long)]
    pub(crate) elastic: bool,
    /// Elastic: give up when fewer ranks than this survive.
    #[arg(long, default_value_t = 1)]
    min_ranks: usize,
    /// Elastic: give up after this many restarts.
    #[arg(long, default_value_t = 3)]
    max_restarts: usize,
    /// Fault drill: kill rank RANK as step STEP starts (`RANK@STEP`, repeatable; each fires
    /// once per run, so a restarted run is not killed again by it).
    #[arg(long = "kill", value_name = "RANK@STEP")]
    kills: Vec<String>,
    /// Fault drill: stall rank RANK as step STEP starts, for twice the collective timeout
    /// (`RANK@STEP`, repeatable, once per run): its peers' collectives time out.
    #[arg(long = "stall", value_name = "RANK@STEP")]
    stalls: Vec<String>,
}

/// Where an elastic run without `--ckpt-dir` keeps its checkpoints: a directory of this
/// launch in the system's temporary directory (a launcher passes its own down to its ranks).
pub(crate) fn elastic_checkpoint_dir() -> PathBuf {
    std::env::temp_dir().join(format!("flashover-elastic-{}", std::process::id()))
}

impl TrainOutputs {
    /// Where checkpoints go: `--ckpt-dir`, else the job file's, when saving is on.
    pub(crate) fn checkpoint_dir(&self, config: &TrainConfig) -> Option<PathBuf> {
        let every = self.save_every.unwrap_or(config.checkpoint.save_every);
        let dir = self
            .ckpt_dir
            .clone()
            .or_else(|| config.checkpoint.dir.clone());
        dir.filter(|_| every > 0)
    }

    /// Whether saving is on (`--save-every`, else the job file's).
    pub(crate) fn saves(&self, config: &TrainConfig) -> bool {
        self.save_every.unwrap_or(config.checkpoint.save_every) > 0
    }

    /// `--min-ranks`.
    pub(crate) fn min_ranks(&self) -> usize {
        self.min_ranks
    }

    /// `--max-restarts`.
    pub(crate) fn max_restarts(&self) -> usize {
        self.max_restarts
    }
}

/// `flashover train`.
pub fn train(args: &JobArgs, outputs: TrainOutputs) -> Result<(), String> {
    args.kernels.apply();
    let mut config = args.build()?;
    if outputs.log_jsonl.is_some() {
        config.run.log_jsonl = outputs.log_jsonl;
    }
    if outputs.trace.is_some() {
        config.run.trace = outputs.trace;
    }
    let ckpt = &mut config.checkpoint;
    set(&mut ckpt.save_every, outputs.save_every);
    set(&mut ckpt.keep, outputs.keep_checkpoints);
    if outputs.ckpt_dir.is_some() {
        ckpt.dir = outputs.ckpt_dir;
    }
    if outputs.resume.is_some() {
        ckpt.resume = outputs.resume;
    }
    ckpt.async_save |= outputs.async_save;
    if outputs.elastic && ckpt.dir.is_none() && ckpt.save_every > 0 {
        // Elastic restarts resume from checkpoints: somewhere to keep them when not told.
        let dir = elastic_checkpoint_dir();
        println!(
            "elastic: checkpoints in {} (--ckpt-dir to choose)",
            dir.display()
        );
        ckpt.dir = Some(dir);
    }
    if outputs.init_from.is_some() {
        ckpt.init_from = outputs.init_from;
    }
    if outputs.exit_after.is_some() {
        config.run.exit_after = outputs.exit_after;
    }
    for kill in &outputs.kills {
        let drill = flashover::train::KillDrill::parse(kill).map_err(|e| format!("--kill {e}"))?;
        config.run.kills.push(drill);
    }
    let stall = std::time::Duration::from_secs_f64(2.0 * config.parallel.timeout_s);
    for text in &outputs.stalls {
        let at = flashover::train::KillDrill::parse(text).map_err(|e| format!("--stall {e}"))?;
        config
            .run
            .kills
            .push(flashover::train::KillDrill::stall(at.rank, at.step, stall));
    }
    let errors = config.validate();
    if !errors.is_empty() {
        return Err(format!("invalid job:\n  {}", errors.join("\n  ")));
    }
    // Under mpirun (and built with the MPI engine) this process is one rank; rank 0 reports.
    let world = process_world(std::time::Duration::from_secs_f64(
        config.parallel.timeout_s,
    ))?;
    let leader = world.as_ref().is_none_or(|(w, _)| w.rank() == 0);
    if let Some((world, local_rank)) = world.clone().filter(|_| !leader) {
        return flashover::train::train_process(&config, &|_| {}, world, local_rank).map(|_| ());
    }
    let source = flashover::train::token_source(&config)?;
    println!("data: {}", source.describe());
    if let Some(floor) = source.loss_floor() {
        println!(
            "loss floor (entropy rate): {floor:.4} nats; uniform guess: {:.4}",
            (source.vocab_size() as f64).ln()
        );
    }
    let model = config.transformer(source.vocab_size())?;
    println!(
        "model: d_model {} x {} layers, {} heads, d_ff {}, {} parameters; mesh {}; device {}",
        model.d_model,
        model.n_layers,
        model.n_heads,
        model.d_ff,
        model.num_params(),
        config.parallel.mesh,
        config.run.device
    );
    let precision = &config.precision;
    if precision.policy()?.is_full_precision() {
        match reduced_f32_matmuls(&config) {
            Some(error) => println!(
                "precision: f32, but this device's f32 matmuls measured at relative error \
                 {error:.1e} (reduced-precision tensor cores: TF32 on CUDA)"
            ),
            None => println!("precision: f32"),
        }
    } else {
        println!(
            "precision: compute {}, gradient reduction {}, loss scale {}; weights and AdamW state f32",
            precision.param_dtype, precision.reduce_dtype, precision.loss_scale
        );
    }
    let bar = ProgressBar::new(config.run.steps as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} {msg} [{elapsed_precise}<{eta_precise}]",
        )
        .expect("valid template"),
    );
    let on_step = |r: &StepRecord| {
        bar.set_message(format!(
            "loss {:.4} | {:.0} tok/s | {:.1} ms/step",
            r.loss,
            r.tokens_per_s,
            r.step_time_s * 1e3
        ));
        bar.inc(1);
        if !bar.is_hidden() {
            return;
        }
        // Not a terminal: print a line every tenth of the run instead.
        let every = (config.run.steps / 10).max(1);
        if r.step.is_multiple_of(every) || r.step + 1 == config.run.steps {
            let scale = match (r.loss_scale, r.skipped) {
                (Some(s), true) => format!("  loss scale {s} (overflow: step skipped)"),
                (Some(s), false) => format!("  loss scale {s}"),
                (None, _) => String::new(),
            };
            println!(
                "step {:>5}  loss {:.4}  lr {:.2e}  grad_norm {:.3}  {:.0} tok/s{scale}",
                r.step, r.loss, r.lr, r.grad_norm, r.tokens_per_s
            );
        }
    };
    let report = match world {
        Some(_) if outputs.elastic => {
            return Err(
                "--elastic restarts ranks that are threads of this process; under a \
                        process launcher the launcher restarts processes (flashover launch \
                        --elastic runs the threads engine)"
                    .into(),
            );
        }
        Some((world, local_rank)) => {
            flashover::train::train_process(&config, &on_step, world, local_rank)?
                .ok_or("rank 0 gave no report")?
        }
        None if outputs.elastic && config.parallel.engine == flashover::train::Engine::Nccl => {
            return Err(
                "--elastic restarts ranks on the thread engine; --engine nccl has no restarts"
                    .into(),
            );
        }
        None if outputs.elastic => {
            let options = flashover::train::ElasticOptions {
                min_ranks: outputs.min_ranks,
                max_restarts: outputs.max_restarts,
            };
            let on_restart = |r: &flashover::train::Restart| {
                bar.println(format!("elastic {r}"));
                if bar.is_hidden() {
                    println!("elastic {r}");
                }
            };
            let elastic = flashover::train::train_elastic(&config, options, &on_step, &on_restart)?;
            println!(
                "elastic: {} restart(s); finished on {}",
                elastic.restarts.len(),
                elastic.report.mesh
            );
            elastic.report
        }
        None => flashover::train::train(&config, &on_step)?,
    };
    bar.finish();
    print!("{report}");
    Ok(())
}

/// This process's world group and local rank when a launcher started it as one rank of a job
/// (`mpirun` or Slurm with the MPI engine built in, torchrun-style variables with NCCL), each
/// collective waiting at most `timeout`; `None` when ranks are threads here.
pub(crate) fn process_world(
    timeout: std::time::Duration,
) -> Result<Option<(flashover::Group, usize)>, String> {
    let Some(env) = flashover::ProcessEnv::detect()? else {
        return Ok(None);
    };
    #[cfg(feature = "mpi")]
    if matches!(
        env.launcher,
        flashover::Launcher::Mpirun | flashover::Launcher::Slurm
    ) {
        let mpi = flashover_comm::MpiWorld::init().map_err(|e| e.to_string())?;
        if (mpi.rank(), mpi.size()) != (env.rank, env.world) {
            return Err(format!(
                "the launcher says rank {} of {}, MPI says rank {} of {}",
                env.rank,
                env.world,
                mpi.rank(),
                mpi.size()
            ));
        }
        return Ok(Some((mpi.group(timeout), env.local_rank)));
    }
    #[cfg(feature = "nccl")]
    if env.launcher == flashover::Launcher::Torchrun {
        // NCCL ranks: rank 0's unique id travels through the TCP rendezvous.
        let rdzv = env.rendezvous(timeout)?;
        let rank = env.rank;
        let exchange = |blob: &[u8]| {
            if rank == 0 {
                rdzv.serve(blob)
            } else {
                rdzv.join(rank, blob)
            }
            .map_err(|e| e.to_string())
        };
        let world =
            flashover_comm::NcclWorld::group(rank, env.world, env.local_rank, timeout, exchange)
                .map_err(|e| e.to_string())?;
        return Ok(Some((world, env.local_rank)));
    }
    let _ = timeout;
    Err(format!(
        "started by {:?} as rank {} of {}, but this build has no engine for one rank per process there: build with --features mpi and start it with mpirun or srun (or --features nccl for ranks started with torchrun-style variables, e.g. by `flashover launch --engine nccl`)",
        env.launcher, env.rank, env.world
    ))
}

/// `verify`'s default tolerance in f32 on a device whose f32 matmuls round their inputs to
/// TF32 (10-bit mantissa, unit roundoff 4.9e-4): measured on an H200, three steps of every
/// layout differed from one rank by at most 5.5e-4 in parameters (docs/benchmarks.md).
const TF32_TOLERANCE: f64 = 5e-3;

/// The measured relative error of the job's device's f32 matmuls, where it is above f32's
/// ([`flashover_runtime::F32_MATMUL_ERROR_LIMIT`]); `None` on an f32 device, or where the
/// device cannot be opened (the job then fails with that reason).
fn reduced_f32_matmuls(config: &TrainConfig) -> Option<f64> {
    let device = config.run.device.device(0).ok()?;
    let error = flashover_runtime::f32_matmul_error(&device);
    (error > flashover_runtime::F32_MATMUL_ERROR_LIMIT).then_some(error)
}

/// `flashover verify`.
pub fn verify(args: &JobArgs, tolerance: Option<f64>) -> Result<bool, String> {
    args.kernels.apply();
    let config = args.build()?;
    let full_precision = config.precision.policy()?.is_full_precision();
    let reduced_matmuls = full_precision
        .then(|| reduced_f32_matmuls(&config))
        .flatten();
    let tolerance = tolerance.unwrap_or(match (full_precision, reduced_matmuls) {
        (true, None) => 1e-5,
        (true, Some(_)) => TF32_TOLERANCE,
        (false, _) => 5e-2,
    });
    println!(
        "verify: mesh {} (micro-batches {}) against one rank, {} steps, seed {}",
        config.parallel.mesh, config.run.micro_batches, config.run.steps, config.run.seed
    );
    if let Some(error) = reduced_matmuls {
        println!(
            "verify: this device's f32 matmuls measured at relative error {error:.1e} \
             (reduced-precision tensor cores: TF32 on CUDA), and its kernels are chosen per \
             shape, so layouts agree to that precision: tolerance {tolerance:.0e}"
        );
    }
    let (reference, candidate, cmp) = flashover::train::verify(&config, tolerance)?;
    println!(
        "reference final loss {:.6}; candidate final loss {:.6}",
        reference.final_loss(),
        candidate.final_loss()
    );
    println!("{cmp}");
    Ok(cmp.pass)
}
