//! Every inconsistent field of a job at once, each with its path; and the plan a job's
//! model runs under.

use super::TrainConfig;
use flashover_models::TransformerConfig;
use flashover_parallel::activation_checkpointing::CheckpointPolicy;
use flashover_parallel::context_parallel::CpAttention;
use flashover_parallel::parallelize::ParallelizePlan;
use flashover_parallel::pipeline::ScheduleKind;
use flashover_runtime::{Axis, DeviceMesh};

impl TrainConfig {
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
        if self.parallel.engine == super::Engine::Nccl
            && self.run.device != flashover_runtime::DeviceChoice::Cuda
        {
            errors.push(format!(
                "parallel.engine = nccl needs run.device = cuda (NCCL moves GPU memory), not {}",
                self.run.device
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
        if self.run.log_every == 0 {
            errors.push("run.log_every must be at least 1 (1: read every step's loss)".into());
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
        self.parallel.zero == 3 && !crate::train::strategy::plan_pipeline::steps_rows(self)
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
}
