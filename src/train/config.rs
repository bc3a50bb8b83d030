//! The job configuration: one TOML file (or flags) for model, data, mesh, optimizer and run.
//! Every field has a default, so an empty file is a valid job; `validate` lists every invalid
//! field at once, each with its path.

use flashover_models::TransformerConfig;
use flashover_models::moe::{DropPolicy, MoeConfig, RouterKind};
use flashover_parallel::activation_checkpointing::CheckpointPolicy;
use flashover_parallel::context_parallel::CpAttention;
use flashover_parallel::parallelize::ParallelizePlan;
use flashover_parallel::pipeline::ScheduleKind;
use flashover_runtime::{Axis, DeviceChoice, DeviceMesh};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// A whole training job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// The model.
    pub model: ModelSection,
    /// Where tokens come from.
    pub data: DataSection,
    /// How ranks are arranged and what they share.
    pub parallel: ParallelSection,
    /// AdamW and the learning-rate schedule.
    pub optim: OptimSection,
    /// Steps, batch, seed, device, logs.
    pub run: RunSection,
    /// Saving and resuming training checkpoints.
    pub checkpoint: CheckpointSection,
    /// Mixture of experts in place of the dense feed-forward.
    pub moe: MoeSection,
    /// Mixed precision: compute dtype, gradient reduction dtype, loss scaling.
    pub precision: PrecisionSection,
    /// The reference model's plan, in place of its own (`TransformerConfig::plan_toml`): the
    /// `tensor_parallel` and `sequence_parallel` rules that split it over `tp`, and under
    /// ZeRO-3 in units the `fully_shard` modules (every block and the rest when empty). The
    /// job sets up pipelines, context and expert parallelism and recomputation itself, from
    /// `[parallel]` and `[moe]`.
    pub parallelize: Option<ParallelizePlan>,
}

/// `[precision]`: what forward and backward compute in (parameters and AdamW state stay f32),
/// what gradients are reduced in, and loss scaling (see `docs/mixed_precision.md`); the table a
/// plan's `[mixed_precision]` is too.
pub type PrecisionSection = flashover_parallel::precision::PrecisionSettings;

/// `[moe]`: a mixture-of-experts feed-forward in every block (see `docs/expert_parallel.md`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MoeSection {
    /// Experts per layer; 0 keeps the dense SwiGLU.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Hidden width of each expert (default: `model.d_ff`).
    pub d_expert: Option<usize>,
    /// `softmax` or `sigmoid` scores.
    pub router: RouterKind,
    /// Divide the chosen experts' weights by their sum.
    pub renormalize: bool,
    /// Absent: dropless. Otherwise each expert takes at most
    /// `ceil(capacity_factor * seq_len * top_k / experts)` assignments per sequence.
    pub capacity_factor: Option<f64>,
    /// `position` or `probability`: what an expert over capacity keeps.
    pub drop_policy: DropPolicy,
    /// Add one dense expert every token goes through.
    pub shared_expert: bool,
    /// Weight of the load-balancing loss.
    pub aux_loss_coef: f64,
    /// Weight of the router z-loss.
    pub z_loss_coef: f64,
    /// Auxiliary-loss-free balancing: per-step change of each expert's routing bias (0: off).
    pub bias_update_rate: f64,
    /// Balanced routing: Sinkhorn iterations per sequence before choosing (0: plain top-k).
    pub sinkhorn_iters: usize,
    /// Expert parallelism: copy this many of each layer's hottest experts (by the last step's
    /// loads) to every ep rank, which then keeps its tokens for them (0: off).
    pub replicate_hot: usize,
}

impl Default for MoeSection {
    fn default() -> Self {
        MoeSection {
            experts: 0,
            top_k: 2,
            d_expert: None,
            router: RouterKind::Softmax,
            renormalize: true,
            capacity_factor: None,
            drop_policy: DropPolicy::Position,
            shared_expert: false,
            aux_loss_coef: 0.01,
            z_loss_coef: 0.0,
            bias_update_rate: 0.0,
            sinkhorn_iters: 0,
            replicate_hot: 0,
        }
    }
}

/// `[checkpoint]`: sharded training checkpoints (see `docs/checkpoints.md`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointSection {
    /// Where checkpoints go: one `step-NNNNNNNN` directory each.
    pub dir: Option<PathBuf>,
    /// Save after every this many steps and after the last (0: never).
    pub save_every: usize,
    /// How many committed checkpoints to keep (oldest removed first).
    pub keep: usize,
    /// Write in the background while training continues (the next save waits for it).
    pub async_save: bool,
    /// Resume from this checkpoint (a `step-*` directory, or a directory of them: the newest).
    pub resume: Option<PathBuf>,
    /// Start from these weights instead of the seeded initialisation: a safetensors file of
    /// whole tensors named as the model's parameters (`ckpt export` writes one; so does
    /// ordinary Burn code with burn-store). The optimizer starts fresh at step 0.
    pub init_from: Option<PathBuf>,
    /// Fault injection for tests: `(rank, step)` makes that rank fail right after writing its
    /// shard of that step's checkpoint, before anything is committed.
    #[serde(skip)]
    pub fail_after_write: Option<(usize, usize)>,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        CheckpointSection {
            dir: None,
            save_every: 0,
            keep: 3,
            async_save: false,
            resume: None,
            init_from: None,
            fail_after_write: None,
        }
    }
}

/// `[model]`: a preset, optionally overridden field by field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// `tiny`, `small` or `base`.
    pub preset: String,
    /// Overrides the preset's width.
    pub d_model: Option<usize>,
    /// Overrides the preset's depth.
    pub n_layers: Option<usize>,
    /// Overrides the preset's heads.
    pub n_heads: Option<usize>,
    /// Overrides the preset's MLP width.
    pub d_ff: Option<usize>,
    /// Share embedding and LM head.
    pub tie_embeddings: bool,
    /// Dropout probability on attention probabilities and on each block's two branch outputs
    /// (counter-based masks: every layout drops the same elements as one rank).
    pub dropout: f64,
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            preset: "small".into(),
            d_model: Some(64),
            n_layers: Some(2),
            n_heads: Some(4),
            d_ff: Some(172),
            tie_embeddings: true,
            dropout: 0.0,
        }
    }
}

/// `[data]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataSection {
    /// `markov` (embedded, known loss floor) or `text` (byte tokens from `path`).
    pub source: String,
    /// Text file for `source = "text"`.
    pub path: Option<PathBuf>,
    /// Vocabulary of the Markov chain.
    pub vocab: usize,
    /// Successors per token of the Markov chain.
    pub branching: usize,
    /// Tokens per sample (the model sees `seq_len` inputs and predicts the next of each).
    pub seq_len: usize,
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection {
            source: "markov".into(),
            path: None,
            vocab: 64,
            branching: 4,
            seq_len: 32,
        }
    }
}

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
    /// `mean` (losses are per-sample means: gradients averaged over ranks and micro-batches)
    /// or `sum` (losses are sums: gradients summed).
    #[serde(with = "as_text")]
    pub gradient_reduction: GradientReduction,
    /// ZeRO stage: 0 (DDP), 1 (AdamW state sharded by rows over `fsdp`, or `dp` without it),
    /// 2 (and gradients: each rank receives only its rows' sums), 3 (and parameters, in fully
    /// sharded units over `fsdp`, replicated over `dp`: HSDP).
    pub zero: u8,
    /// ZeRO-3: free each block's gathered parameters after its forward and gather them again
    /// (recomputing the block) in backward. `false` keeps them from forward to backward.
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

/// `[optim]`: AdamW with linear warm-up and cosine decay to `min_lr_ratio x lr`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimSection {
    /// Peak learning rate.
    pub lr: f64,
    /// Warm-up steps.
    pub warmup_steps: usize,
    /// Final learning rate as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (none if absent or 0).
    pub clip: Option<f32>,
}

impl Default for OptimSection {
    fn default() -> Self {
        OptimSection {
            lr: 3e-3,
            warmup_steps: 10,
            min_lr_ratio: 0.1,
            weight_decay: 0.01,
            clip: Some(1.0),
        }
    }
}

/// `[run]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunSection {
    /// Optimizer steps.
    pub steps: usize,
    /// Samples per step over all data-parallel ranks.
    pub global_batch: usize,
    /// Micro-batches per step on each rank (gradient accumulation).
    pub micro_batches: usize,
    /// Seed of the model, the data and everything random.
    pub seed: u64,
    /// `flex`, `wgpu` or `cuda` (`BURN_DEVICE` overrides the default).
    pub device: DeviceChoice,
    /// Write one JSON line per step here.
    pub log_jsonl: Option<PathBuf>,
    /// Write a timeline of every rank's steps (and pipeline actions) here, as Chrome trace
    /// JSON (open it in Perfetto).
    pub trace: Option<PathBuf>,
    /// Stop once this many steps are done (counted from step 0, resumed steps included), as an
    /// interrupted job would; the learning-rate schedule still spans `steps`. A checkpoint is
    /// saved on exit when saving is on.
    pub exit_after: Option<usize>,
    /// Fault drills (tests, `--kill RANK@STEP`, `--stall RANK@STEP`): each kills (a panic) or
    /// stalls its rank as that step starts, once per elastic run.
    #[serde(skip)]
    pub kills: Vec<KillDrill>,
}

/// Kill rank `rank` as step `step` starts (or stall it there), once: a restarted run on the
/// survivors may have a rank of that number again; the drill does not repeat.
#[derive(Debug, Clone, Default)]
pub struct KillDrill {
    /// Global rank of the world the drill fires in.
    pub rank: usize,
    /// The step at whose start it fires.
    pub step: usize,
    /// Stall this long instead of dying (its peers' collectives time out meanwhile).
    pub stall: Option<std::time::Duration>,
    fired: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl KillDrill {
    /// Kill `rank` at the start of `step`.
    pub fn new(rank: usize, step: usize) -> Self {
        KillDrill {
            rank,
            step,
            stall: None,
            fired: Default::default(),
        }
    }

    /// Stall `rank` for `duration` at the start of `step`.
    pub fn stall(rank: usize, step: usize, duration: std::time::Duration) -> Self {
        KillDrill {
            stall: Some(duration),
            ..KillDrill::new(rank, step)
        }
    }

    /// `RANK@STEP`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = || format!("`{text}`: expected RANK@STEP, e.g. 1@25");
        let (rank, step) = text.split_once('@').ok_or_else(bad)?;
        Ok(KillDrill::new(
            rank.trim().parse().map_err(|_| bad())?,
            step.trim().parse().map_err(|_| bad())?,
        ))
    }

    /// Whether it fires now, on `rank` at `step` (at most once).
    pub(crate) fn fires(&self, rank: usize, step: usize) -> bool {
        rank == self.rank
            && step == self.step
            && !self.fired.swap(true, std::sync::atomic::Ordering::SeqCst)
    }
}

impl PartialEq for KillDrill {
    fn eq(&self, other: &Self) -> bool {
        (self.rank, self.step, self.stall) == (other.rank, other.step, other.stall)
    }
}

impl Default for RunSection {
    fn default() -> Self {
        RunSection {
            steps: 200,
            global_batch: 16,
            micro_batches: 1,
            seed: 1,
            device: DeviceChoice::Flex,
            log_jsonl: None,
            trace: None,
            exit_after: None,
            kills: vec![],
        }
    }
}

impl TrainConfig {
    /// Parses a TOML job file; unknown fields are errors. [`TrainConfig::validate`] then lists
    /// every inconsistent field at once, with its path.
    ///
    /// ```
    /// use flashover::train::TrainConfig;
    ///
    /// let config = TrainConfig::from_toml("[parallel]\nmesh = \"tp=3\"\n").unwrap();
    /// let errors = config.validate();
    /// assert!(errors.iter().any(|e| e.contains("model.n_heads = 4 does not divide by tp = 3")));
    /// assert!(TrainConfig::from_toml("[parallel]\nmeshh = \"dp=2\"").is_err());
    /// ```
    pub fn from_toml(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| format!("invalid config: {e}"))
    }

    /// [`TrainConfig::from_toml`] that reads past bad values of the typed settings
    /// (`parallel.pp_schedule`, `cp_attention`, `activation_checkpointing`,
    /// `gradient_reduction`): each is reported and left at its default, so `config check` can
    /// list it with every other problem. Syntax errors and unknown fields still fail.
    ///
    /// ```
    /// use flashover::train::TrainConfig;
    ///
    /// let (config, errors) =
    ///     TrainConfig::from_toml_lenient("[parallel]\npp_schedule = \"zz\"\nmesh = \"tp=3\"").unwrap();
    /// assert!(errors[0].starts_with("parallel.pp_schedule = "));
    /// assert!(config.validate().iter().any(|e| e.contains("tp = 3")));
    /// ```
    pub fn from_toml_lenient(text: &str) -> Result<(Self, Vec<String>), String> {
        type Check = fn(&str) -> Result<(), String>;
        const TYPED: [(&str, Check); 4] = [
            ("gradient_reduction", |v| {
                v.parse::<GradientReduction>().map(drop)
            }),
            ("pp_schedule", |v| v.parse::<ScheduleKind>().map(drop)),
            ("cp_attention", |v| v.parse::<CpAttention>().map(drop)),
            ("activation_checkpointing", |v| {
                v.parse::<CheckpointPolicy>().map(drop)
            }),
        ];
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| format!("invalid config: {e}"))?;
        let mut errors = vec![];
        if let Some(toml::Value::Table(parallel)) = table.get_mut("parallel") {
            for (key, check) in TYPED {
                if let Some(toml::Value::String(value)) = parallel.get(key)
                    && let Err(e) = check(value)
                {
                    errors.push(format!("parallel.{key} = {e}"));
                    parallel.remove(key);
                }
            }
        }
        let config = table
            .try_into()
            .map_err(|e| format!("invalid config: {e}"))?;
        Ok((config, errors))
    }

    /// The model configuration the sections describe (vocabulary from the data source).
    pub fn transformer(&self, vocab_size: usize) -> Result<TransformerConfig, String> {
        let base = match self.model.preset.as_str() {
            "tiny" => TransformerConfig::tiny(vocab_size),
            "small" => TransformerConfig::small(vocab_size),
            "base" => TransformerConfig::base(vocab_size),
            other => {
                return Err(format!(
                    "model.preset = `{other}`: expected tiny, small or base"
                ));
            }
        };
        let m = &self.model;
        Ok(TransformerConfig {
            d_model: m.d_model.unwrap_or(base.d_model),
            n_layers: m.n_layers.unwrap_or(base.n_layers),
            n_heads: m.n_heads.unwrap_or(base.n_heads),
            d_ff: m.d_ff.unwrap_or(base.d_ff),
            tie_embeddings: m.tie_embeddings,
            moe: (self.moe.experts > 0).then(|| {
                let e = &self.moe;
                MoeConfig {
                    n_experts: e.experts,
                    top_k: e.top_k,
                    d_expert: e.d_expert.or(m.d_ff).unwrap_or(base.d_ff),
                    router: e.router,
                    renormalize: e.renormalize,
                    capacity_factor: e.capacity_factor,
                    drop_policy: e.drop_policy,
                    shared_expert: e.shared_expert,
                    aux_loss_coef: e.aux_loss_coef,
                    z_loss_coef: e.z_loss_coef,
                    bias_update_rate: e.bias_update_rate,
                    sinkhorn_iters: e.sinkhorn_iters,
                }
            }),
            ..base
        })
    }

    /// The vocabulary of the configured data source.
    pub fn vocab_size(&self) -> usize {
        if self.data.source == "text" {
            256
        } else {
            self.data.vocab
        }
    }

    /// Blocks per pipeline virtual stage, as `parallel.pp_blocks` or `parallel.pp_split` say.
    pub fn pipeline_blocks(
        &self,
        model: &TransformerConfig,
        stages: usize,
    ) -> Result<Vec<usize>, String> {
        match (
            self.parallel.pp_blocks.as_deref(),
            self.parallel.pp_split.as_str(),
        ) {
            (Some(list), _) => super::stage_split::split_blocks(model.n_layers, stages, Some(list)),
            (None, "even") => super::stage_split::split_blocks(model.n_layers, stages, None),
            (None, "cost") => {
                super::stage_split::split_blocks_by_cost(model, self.data.seq_len, stages)
            }
            (None, other) => Err(format!(
                "parallel.pp_split = `{other}`: expected even or cost"
            )),
        }
    }

    /// The parsed mesh.
    pub fn mesh(&self) -> Result<DeviceMesh, String> {
        self.parallel
            .mesh
            .parse()
            .map_err(|e| format!("parallel.mesh: {e}"))
    }

    /// Every problem with the configuration, each naming its field; empty when valid.
    pub fn validate(&self) -> Vec<String> {
        let mut errors = vec![];
        match self.transformer(self.vocab_size()) {
            Ok(t) => {
                if let Err(e) = t.validate() {
                    errors.extend(e.split("; ").map(String::from));
                }
            }
            Err(e) => errors.push(e),
        }
        match self.data.source.as_str() {
            "markov" => {
                if self.data.vocab < 2 {
                    errors.push(format!(
                        "data.vocab = {} must be at least 2",
                        self.data.vocab
                    ));
                }
                if self.data.branching == 0 || self.data.branching > self.data.vocab {
                    errors.push(format!(
                        "data.branching = {} must be between 1 and data.vocab = {}",
                        self.data.branching, self.data.vocab
                    ));
                }
            }
            "text" if self.data.path.is_none() => {
                errors.push("data.path is required when data.source = \"text\"".into())
            }
            "text" => {}
            other => errors.push(format!("data.source = `{other}`: expected markov or text")),
        }
        if !(0.0..1.0).contains(&self.model.dropout) {
            errors.push(format!(
                "model.dropout = {} must be in [0, 1)",
                self.model.dropout
            ));
        }
        if self.data.seq_len == 0 {
            errors.push("data.seq_len must be at least 1".into());
        }
        if self.checkpoint.save_every > 0 && self.checkpoint.dir.is_none() {
            errors.push(
                "checkpoint.save_every is set but checkpoint.dir is not: say where to save (--ckpt-dir DIR)".into(),
            );
        }
        if self.checkpoint.resume.is_some() && self.checkpoint.init_from.is_some() {
            errors.push(
                "checkpoint.resume and checkpoint.init_from are both set: resume continues a run, init_from starts one from weights; pick one".into(),
            );
        }
        if self.checkpoint.keep == 0 {
            errors.push("checkpoint.keep must be at least 1".into());
        }
        match self.mesh() {
            Ok(mesh) => {
                errors.extend(self.composition_errors());
                errors.extend(self.moe_errors(&mesh));
                errors.extend(self.cp_errors(&mesh));
                errors.extend(self.recompute_errors());
                errors.extend(self.precision_errors());
                errors.extend(self.pipeline_errors(&mesh));
                errors.extend(self.tensor_parallel_errors(&mesh));
                errors.extend(self.parallelize_errors(&mesh));
                errors.extend(self.batch_errors(&mesh));
            }
            Err(e) => errors.push(e),
        }
        if self.parallel.bucket_mb.is_nan() || self.parallel.bucket_mb <= 0.0 {
            errors.push(format!(
                "parallel.bucket_mb = {} must be positive",
                self.parallel.bucket_mb
            ));
        }
        if self.parallel.timeout_s.is_nan() || self.parallel.timeout_s <= 0.0 {
            errors.push(format!(
                "parallel.timeout_s = {} must be positive",
                self.parallel.timeout_s
            ));
        }
        if self.parallel.zero > 3 {
            errors.push(format!(
                "parallel.zero = {}: expected 0 (DDP), 1, 2 or 3",
                self.parallel.zero
            ));
        }
        if self.optim.lr.is_nan() || self.optim.lr <= 0.0 {
            errors.push(format!("optim.lr = {} must be positive", self.optim.lr));
        }
        if !(0.0..=1.0).contains(&self.optim.min_lr_ratio) {
            errors.push(format!(
                "optim.min_lr_ratio = {} must be in [0, 1]",
                self.optim.min_lr_ratio
            ));
        }
        if self.optim.clip.is_some_and(|c| c.is_nan() || c < 0.0) {
            errors.push("optim.clip must be positive (0 or absent: no clipping)".into());
        }
        if self.run.steps == 0 {
            errors.push("run.steps must be at least 1".into());
        }
        errors
    }

    /// What is wrong with a `pp` axis: a schedule that cannot be built, blocks that do not
    /// split into its stages.
    fn pipeline_errors(&self, mesh: &DeviceMesh) -> Vec<String> {
        let mut errors = vec![];
        let pp = mesh.degree(Axis::Pp);
        if pp > 1 {
            let kind = self.parallel.pp_schedule;
            let chunks = match kind {
                ScheduleKind::Interleaved1F1B => self.parallel.pp_chunks.max(1),
                _ => 1,
            };
            let built = flashover_parallel::pipeline::Schedule::build(
                kind,
                pp,
                self.run.micro_batches,
                chunks,
            );
            if let Err(e) = built {
                errors.push(format!("parallel.pp_schedule: {e}"));
            }
            if let Ok(t) = self.transformer(self.vocab_size())
                && let Err(e) = self.pipeline_blocks(&t, pp * chunks)
            {
                errors.push(e);
            }
        }
        errors
    }

    /// What is wrong with a `tp` axis: sizes that do not split over it.
    fn tensor_parallel_errors(&self, mesh: &DeviceMesh) -> Vec<String> {
        let mut errors = vec![];
        let tp = mesh.degree(Axis::Tp);
        if tp > 1 {
            if let Ok(t) = self.transformer(self.vocab_size()) {
                if !t.n_heads.is_multiple_of(tp) {
                    errors.push(format!(
                        "model.n_heads = {} does not divide by tp = {tp}: attention is split by whole heads",
                        t.n_heads
                    ));
                }
                if !t.d_ff.is_multiple_of(tp) {
                    errors.push(format!(
                        "model.d_ff = {} does not divide by tp = {tp}: the MLP is split by columns",
                        t.d_ff
                    ));
                }
            }
            // Under context parallelism, each cp rank's share of the sequence is split.
            let cp = mesh.degree(Axis::Cp);
            if self.parallel.sequence_parallel && !self.data.seq_len.is_multiple_of(tp * cp) {
                let over = match cp {
                    1 => format!("tp = {tp}"),
                    _ => format!("cp x tp = {}", cp * tp),
                };
                errors.push(format!(
                    "data.seq_len = {} does not divide by {over}: sequence parallelism splits \
                     each rank's share of the sequence over tp",
                    self.data.seq_len
                ));
            }
        }
        errors
    }

    /// Whether the global batch splits over the data-parallel ranks and micro-batches.
    fn batch_errors(&self, mesh: &DeviceMesh) -> Vec<String> {
        let mut errors = vec![];
        let fsdp = mesh.degree(Axis::Fsdp);
        let (dp, m, b) = (
            mesh.degree(Axis::Dp) * fsdp * mesh.degree(Axis::Ep),
            self.run.micro_batches,
            self.run.global_batch,
        );
        if m == 0 || b == 0 || !b.is_multiple_of(dp * m) {
            errors.push(format!(
                "run.global_batch = {b} must be a positive multiple of the data-parallel ranks dp x fsdp x ep ({dp}) x run.micro_batches ({m})"
            ));
        }
        errors
    }

    /// Whether ZeRO-3 runs in fully sharded units: always, but where the plan's pipeline
    /// steps rows of what a rank holds (under zb-h1 or with hot-expert copies).
    pub fn zero3_in_units(&self) -> bool {
        self.parallel.zero == 3 && !super::strategy::plan_pipeline::steps_rows(self)
    }

    /// The plan transform 1 applies to the reference model (`model`, its configuration): the
    /// job's `[parallelize]` table or the model's own plan (its `sequence_parallel` rules only
    /// when `parallel.sequence_parallel` asks, its `expert_parallel` rules cleared: the job
    /// places experts itself). Under ZeRO-3 in units `fully_shard` names every block and the
    /// rest (`""`) when it names no module; otherwise it is cleared, having nothing to cut.
    pub fn model_plan(&self, model: &TransformerConfig) -> Result<ParallelizePlan, String> {
        let mut plan = match &self.parallelize {
            Some(plan) => plan.clone(),
            None => {
                // The model's own plan; the job places experts itself and turns sequence
                // parallelism on when parallel.sequence_parallel says.
                let mut plan =
                    ParallelizePlan::from_toml(&model.plan_toml()).map_err(|e| e.to_string())?;
                plan.expert_parallel.clear();
                if !self.parallel.sequence_parallel {
                    plan.sequence_parallel.clear();
                }
                plan
            }
        };
        match self.zero3_in_units() {
            true if plan.fully_shard.is_empty() => plan = plan.fully_shard(""),
            true => {}
            // Inert without units: `validate` refuses the rules on an fsdp axis of more than
            // one rank that shards by rows instead, and without one there is nothing to cut.
            false => plan.fully_shard.clear(),
        }
        Ok(plan)
    }

    /// What is wrong with a `[parallelize]` table: the job takes the tensor-parallel split and,
    /// under ZeRO-3 in units, the units from it, and sets up the rest itself.
    fn parallelize_errors(&self, mesh: &DeviceMesh) -> Vec<String> {
        let Some(plan) = &self.parallelize else {
            return vec![];
        };
        let mut errors = vec![];
        let elsewhere = [
            (
                plan.pipeline.is_some(),
                "pipeline: the job cuts stages from parallel.mesh's pp with its cost model, \
                 scheduled as parallel.pp_schedule says",
            ),
            (
                plan.context_parallel.is_some(),
                "context_parallel: the job splits sequences over parallel.mesh's cp, with \
                 parallel.cp_attention",
            ),
            (
                !plan.expert_parallel.is_empty(),
                "expert_parallel: the job spreads [moe] experts over parallel.mesh's ep itself",
            ),
            (
                plan.replicate_hot_experts > 0,
                "replicate_hot_experts: set moe.replicate_hot",
            ),
            (
                plan.activation_checkpointing != CheckpointPolicy::None,
                "activation_checkpointing: set parallel.activation_checkpointing",
            ),
            (
                plan.mixed_precision.is_some(),
                "mixed_precision: the job computes and reduces as its [precision] table says",
            ),
        ];
        for (_, why) in elsewhere.iter().filter(|(set, _)| *set) {
            errors.push(format!(
                "parallelize.{why}; leave the rule out of [parallelize]"
            ));
        }
        // Without an fsdp axis there is nothing to shard (as a plan's rule is then inert).
        if !plan.fully_shard.is_empty() && mesh.degree(Axis::Fsdp) > 1 && !self.zero3_in_units() {
            errors.push(
                "parallelize.fully_shard: units need parallel.zero = 3, and under a pipeline \
                 (or with experts) neither zb-h1 nor hot-expert copies (those layouts shard \
                 every parameter by rows); leave fully_shard out"
                    .into(),
            );
        }
        if let Err(e) = self.table_fits_the_model(plan) {
            errors.push(format!("parallelize: {e}"));
        }
        let sp_rules = !plan.sequence_parallel.is_empty();
        if mesh.degree(Axis::Tp) > 1 && sp_rules != self.parallel.sequence_parallel {
            errors.push(format!(
                "parallelize.sequence_parallel {} but parallel.sequence_parallel = {}: name the \
                 modules between the tensor-parallel regions (the norms) exactly when sequence \
                 parallelism is on",
                if sp_rules {
                    "names modules"
                } else {
                    "is empty"
                },
                self.parallel.sequence_parallel
            ));
        }
        errors
    }

    /// Whether `plan`'s paths name modules of the reference model and its tensor-parallel
    /// styles apply to them, checked on a narrow model of the same structure (its parameter
    /// names, not its widths, which the job checks as it splits them).
    fn table_fits_the_model(&self, plan: &ParallelizePlan) -> Result<(), String> {
        let t = self.transformer(self.vocab_size())?;
        let narrow = flashover_models::TransformerConfig {
            vocab_size: 2,
            d_model: 2 * t.n_heads,
            d_ff: 1,
            moe: t
                .moe
                .map(|moe| flashover_models::MoeConfig { d_expert: 1, ..moe }),
            ..t
        };
        narrow.validate()?;
        let model = narrow.init(0, &burn::tensor::Device::flex());
        plan.check_paths(&model).map_err(|e| e.to_string())
    }

    /// What is wrong with `[precision]` (every strategy composes with any policy).
    fn precision_errors(&self) -> Vec<String> {
        self.precision.policy().err().into_iter().collect()
    }

    /// What is wrong with a `cp` axis in `mesh`: sequence lengths that do not cut evenly and
    /// heads all-to-all attention cannot split.
    fn cp_errors(&self, mesh: &DeviceMesh) -> Vec<String> {
        let mut errors = vec![];
        let algorithm = self.parallel.cp_attention;
        let cp = mesh.degree(Axis::Cp);
        if cp == 1 {
            return errors;
        }
        let chunks = if self.parallel.cp_load_balance {
            2 * cp
        } else {
            cp
        };
        if !self.data.seq_len.is_multiple_of(chunks) {
            let why = if self.parallel.cp_load_balance {
                "load-balanced context parallelism cuts each sequence into 2 x cp equal chunks"
            } else {
                "context parallelism cuts each sequence into cp equal chunks"
            };
            errors.push(format!(
                "data.seq_len = {} does not divide by {chunks}: {why}; use a multiple of {chunks} (e.g. {})",
                self.data.seq_len,
                self.data.seq_len.div_ceil(chunks) * chunks
            ));
        }
        if algorithm == CpAttention::AllToAll
            && let Ok(t) = self.transformer(self.vocab_size())
        {
            let tp = mesh.degree(Axis::Tp);
            if !t.n_heads.is_multiple_of(tp * cp) {
                errors.push(format!(
                    "model.n_heads = {} does not divide by tp x cp = {}: all-to-all attention gives each cp rank whole heads; use --cp-attention ring",
                    t.n_heads,
                    tp * cp
                ));
            }
        }
        errors
    }

    /// What is wrong with `parallel.activation_checkpointing`.
    fn recompute_errors(&self) -> Vec<String> {
        let policy = &self.parallel.activation_checkpointing;
        let mut errors = vec![];
        if let (CheckpointPolicy::Blocks(blocks), Ok(t)) =
            (policy, self.transformer(self.vocab_size()))
            && let Some(b) = blocks.iter().find(|&&b| b >= t.n_layers)
        {
            errors.push(format!(
                "parallel.activation_checkpointing names block {b}, but the model has {} (0..{})",
                t.n_layers, t.n_layers
            ));
        }
        errors
    }

    /// What is wrong with `[moe]` on `mesh`: expert counts that do not fit it.
    fn moe_errors(&self, mesh: &DeviceMesh) -> Vec<String> {
        let mut errors = vec![];
        let ep = mesh.degree(Axis::Ep);
        let e = &self.moe;
        if e.experts == 0 {
            return errors;
        }
        // The layer's own fields (top_k, capacity, weights) are checked with the model.
        if e.replicate_hot > e.experts {
            errors.push(format!(
                "moe.replicate_hot = {} exceeds moe.experts = {}",
                e.replicate_hot, e.experts
            ));
        }

        if !e.experts.is_multiple_of(ep) {
            errors.push(format!(
                "moe.experts = {} does not divide by ep = {ep}: each expert-parallel rank holds experts / ep whole experts",
                e.experts
            ));
        }
        errors
    }

    /// Whether the strategies this job asks for compose: the rule table's refusals
    /// ([`flashover_plan::rules`], shared with `plan`), each naming its rule.
    fn composition_errors(&self) -> Vec<String> {
        let Ok(layout) = crate::plan::layout_of(self) else {
            return vec![];
        };
        let experts = self.moe.experts > 0;
        let moe = if experts { " with experts" } else { "" };
        flashover_plan::rules::refusals(&layout, experts)
            .into_iter()
            .map(|r| {
                format!(
                    "layout `{layout}`{moe}: {} (rule `{}`, docs/composition.md)",
                    r.reason, r.rule
                )
            })
            .collect()
    }

    /// Learning rate at `step`: linear warm-up, then cosine decay to `min_lr_ratio x lr`.
    pub fn lr_at(&self, step: usize) -> f64 {
        let o = &self.optim;
        if step < o.warmup_steps {
            return o.lr * (step + 1) as f64 / o.warmup_steps as f64;
        }
        let span = (self.run.steps.saturating_sub(o.warmup_steps)).max(1) as f64;
        let progress = ((step - o.warmup_steps) as f64 / span).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        o.lr * (o.min_lr_ratio + (1.0 - o.min_lr_ratio) * cosine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_file_is_the_default_job() {
        let c = TrainConfig::from_toml("").unwrap();
        assert_eq!(c, TrainConfig::default());
        assert!(c.validate().is_empty(), "{:?}", c.validate());
    }

    #[test]
    fn every_invalid_field_is_listed_with_its_path() {
        let c = TrainConfig::from_toml(
            "[model]\nn_heads = 3\n[parallel]\nmesh = \"dp=3\"\n[run]\nglobal_batch = 16\nsteps = 0\n[optim]\nlr = -1.0\n",
        )
        .unwrap();
        let e = c.validate();
        let all = e.join("\n");
        assert!(
            all.contains("model.n_heads = 3 does not divide model.d_model = 64"),
            "{all}"
        );
        assert!(
            all.contains("run.global_batch = 16 must be a positive multiple of the data-parallel ranks dp x fsdp x ep (3)"),
            "{all}"
        );
        assert!(all.contains("run.steps"), "{all}");
        assert!(all.contains("optim.lr = -1"), "{all}");
        assert_eq!(e.len(), 4, "{all}");
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let e = TrainConfig::from_toml("[run]\nstep = 3\n").unwrap_err();
        assert!(e.contains("unknown field `step`"), "{e}");
    }

    #[test]
    fn the_schedule_warms_up_then_decays() {
        let c = TrainConfig::default();
        assert!(c.lr_at(0) < c.lr_at(9));
        assert!((c.lr_at(9) - c.optim.lr).abs() < 1e-12);
        assert!((c.lr_at(c.run.steps) - c.optim.lr * c.optim.min_lr_ratio).abs() < 1e-9);
    }
}

#[cfg(test)]
mod example_config_tests {
    use super::TrainConfig;

    #[test]
    fn the_example_config_parses_and_validates() {
        let text = include_str!("../../examples/configs/ddp.toml");
        let c = TrainConfig::from_toml(text).unwrap();
        assert!(c.validate().is_empty(), "{:?}", c.validate());
        assert_eq!(c.parallel.mesh, "dp=4");
        for (name, text) in [
            ("3d.toml", include_str!("../../examples/configs/3d.toml")),
            (
                "fsdp.toml",
                include_str!("../../examples/configs/fsdp.toml"),
            ),
            (
                "long_context.toml",
                include_str!("../../examples/configs/long_context.toml"),
            ),
            (
                "fsdp_tp_plan.toml",
                include_str!("../../examples/configs/fsdp_tp_plan.toml"),
            ),
        ] {
            let c = TrainConfig::from_toml(text).unwrap();
            assert!(c.validate().is_empty(), "{name}: {:?}", c.validate());
        }
    }
}
