//! The job configuration: one TOML file (or flags) for model, data, mesh, optimizer and run.
//! Every field has a default, so an empty file is a valid job; `validate` lists every invalid
//! field at once, each with its path.

mod checkpoint;
mod data;
mod model;
mod optim;
mod parallel;
mod run;
mod validate;

pub use checkpoint::CheckpointSection;
pub use data::DataSection;
pub use model::{ModelSection, MoeSection};
pub use optim::OptimSection;
pub use parallel::{Engine, GradientReduction, ParallelSection};
pub use run::{KillDrill, RunSection};

use flashover_models::TransformerConfig;
use flashover_models::moe::MoeConfig;
use flashover_parallel::activation_checkpointing::CheckpointPolicy;
use flashover_parallel::context_parallel::CpAttention;
use flashover_parallel::parallelize::ParallelizePlan;
use flashover_parallel::pipeline::ScheduleKind;
use flashover_runtime::DeviceMesh;
use serde::{Deserialize, Serialize};

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
    fn the_nccl_engine_is_refused_off_cuda_and_a_bad_engine_when_read() {
        let c = TrainConfig::from_toml("[parallel]\nengine = \"nccl\"\n").unwrap();
        assert_eq!(c.parallel.engine, Engine::Nccl);
        let all = c.validate().join("\n");
        assert!(
            all.contains("parallel.engine = nccl needs run.device = cuda"),
            "{all}"
        );
        let bad = TrainConfig::from_toml("[parallel]\nengine = \"gloo\"\n").unwrap_err();
        assert!(bad.contains("expected threads or nccl"), "{bad}");
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
        let text = include_str!("../../../examples/configs/ddp.toml");
        let c = TrainConfig::from_toml(text).unwrap();
        assert!(c.validate().is_empty(), "{:?}", c.validate());
        assert_eq!(c.parallel.mesh, "dp=4");
        for (name, text) in [
            ("3d.toml", include_str!("../../../examples/configs/3d.toml")),
            (
                "fsdp.toml",
                include_str!("../../../examples/configs/fsdp.toml"),
            ),
            (
                "long_context.toml",
                include_str!("../../../examples/configs/long_context.toml"),
            ),
            (
                "fsdp_tp_plan.toml",
                include_str!("../../../examples/configs/fsdp_tp_plan.toml"),
            ),
        ] {
            let c = TrainConfig::from_toml(text).unwrap();
            assert!(c.validate().is_empty(), "{name}: {:?}", c.validate());
        }
    }
}
