//! A parallelization plan as data: which modules of a model each strategy transforms, named by
//! their paths in the model (`blocks.*.attn`), as a Rust value or a TOML table.

mod rules;
mod validate;
mod vocabulary;

pub use rules::{
    AttachedModule, ContextParallelRule, ModulePath, PipelineRule, TensorParallelRule, TpStyle,
};
pub(crate) use validate::check_plan;
pub use vocabulary::{CheckpointPolicy, CpAttention, GradientBuckets, GradientRows, ScheduleKind};

use crate::error::ParallelError;
use crate::precision::MixedPrecision;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Which modules of a model each strategy transforms (see [`crate::parallelize::parallelize`]).
///
/// ```
/// use flashover_parallel::activation_checkpointing::CheckpointPolicy;
/// use flashover_parallel::parallelize::{
///     ContextParallelRule, ParallelizePlan, PipelineRule, TensorParallelRule,
/// };
/// use flashover_parallel::pipeline::ScheduleKind;
/// use flashover_parallel::precision::{MixedPrecision, Precision};
///
/// // TOML, for a table of your own configuration file ...
/// let plan = ParallelizePlan::from_toml(
///     r#"
///     fully_shard = ["blocks", "embed"]
///     expert_parallel = ["blocks.*.moe"]
///     activation_checkpointing = "every:2"
///
///     [pipeline]
///     layers = "blocks"
///     first = ["embed"]
///     last = ["norm", "embed"]
///     schedule = "1f1b"
///     micro_batches = 4
///     layers_per_stage = [7, 5]   # the last stage also runs the head
///
///     [context_parallel]
///     attention = ["blocks.*.attn.core"]
///     algorithm = "ring"
///
///     [mixed_precision]
///     param_dtype = "bf16"        # reduce_dtype = "f32" and no loss scale by default
///
///     [[tensor_parallel]]
///     style = "colwise"
///     paths = ["blocks.*.attn.query", "blocks.*.attn.key", "blocks.*.attn.value"]
///     unit = 16
///
///     [[tensor_parallel]]
///     style = "rowwise"
///     paths = ["blocks.*.attn.out"]
///     unit = 16
///     "#,
/// )
/// .unwrap();
/// // ... or the same plan in Rust.
/// let heads = ["blocks.*.attn.query", "blocks.*.attn.key", "blocks.*.attn.value"];
/// let rust = ParallelizePlan::new()
///     .fully_shard("blocks")
///     .fully_shard("embed")
///     .tensor_parallel(TensorParallelRule::colwise(&heads).in_units(16))
///     .tensor_parallel(TensorParallelRule::rowwise(&["blocks.*.attn.out"]).in_units(16))
///     .context_parallel(ContextParallelRule::ring(&["blocks.*.attn.core"]))
///     .expert_parallel("blocks.*.moe")
///     .activation_checkpointing(CheckpointPolicy::Every(2))
///     .pipeline(
///         PipelineRule::new("blocks", ScheduleKind::OneFOneB, 4)
///             .first(&["embed"])
///             .last(&["norm", "embed"])
///             .layers_per_stage(&[7, 5]),
///     )
///     .mixed_precision(MixedPrecision::new(Precision::BF16));
/// assert_eq!(plan, rust);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelizePlan {
    /// Modules whose parameters are fully sharded over the `fsdp` axis (ZeRO-3): each rank
    /// keeps rows `rank * chunk ..` of every parameter's first dimension and gathers the whole
    /// parameter where the model reads it. Parameters outside them stay whole, replicated
    /// over `fsdp` as over `dp`.
    #[serde(default)]
    pub fully_shard: Vec<ModulePath>,
    /// Modules inside `fully_shard` paths whose parameters stay whole all the same: layers
    /// whose forward reads a parameter's stored shape (`Param::shape()`, which a shard
    /// answers with its own rows) before `val()`. Nothing else is kept whole but buffers (Burn's
    /// `RunningState`, which no gather could bring back). Burn 0.22.1's `RmsNorm`, `BatchNorm`
    /// and `PositionWiseFeedForward` read it (their shape check then fails in the first
    /// forward): use [`crate::nn::RmsNorm`], [`crate::nn::BatchNorm`] and
    /// [`crate::nn::transformer`]'s layers, which read [`crate::parallelize::value_dims`], or name them
    /// here. The report is [`crate::parallelize::ShardedModel::kept_whole`].
    #[serde(default)]
    pub keep_whole: Vec<ModulePath>,
    /// Linear layers split over the `tp` axis (ignored on a mesh without `tp`). The layers
    /// must be [`crate::nn::Linear`], whose forward adds the collectives a split needs; other
    /// parameters stay whole on every `tp` rank, which computes them identically.
    #[serde(default)]
    pub tensor_parallel: Vec<TensorParallelRule>,
    /// Sequence parallelism (with `tp`): the modules between the tensor-parallel regions
    /// (norms) run on this rank's `1/tp` of the sequence, so their activations are split too.
    /// Non-empty turns it on: column-wise layers all-gather their input along the sequence
    /// and row-wise ones reduce-scatter their output; the parameters of these modules and
    /// row-wise biases see only their rank's positions, so their gradients are summed over
    /// `tp`. Something must split activations by sequence before the first split layer: the
    /// token embedding under a `vocab` rule (its lookups leave it split by sequence), or a
    /// `sequence_split_stacks` stack.
    #[serde(default)]
    pub sequence_parallel: Vec<ModulePath>,
    /// Layer stacks that take whole sequences and split them by position themselves, returning
    /// whole sequences ([`crate::nn::transformer`]'s encoder and decoder, as Burn's contract
    /// has them), so activations outside them stay whole and replicated (TorchTitan's input
    /// and output layouts of a module): over `tp` under sequence parallelism, over `cp` under
    /// a `context_parallel` rule (contiguous chunks: a stack's attention is not causal, so
    /// every chunk does the same work; its attention swaps positions for heads, all-to-all,
    /// whatever the rule's algorithm). A split layer inside one refuses to run outside its
    /// stack's forward.
    #[serde(default)]
    pub sequence_split_stacks: Vec<ModulePath>,
    /// How the model is cut into pipeline stages over `pp` (on a mesh without `pp`, one stage
    /// runs every micro-batch).
    #[serde(default)]
    pub pipeline: Option<PipelineRule>,
    /// How sequences are split over `cp` (on a mesh without `cp`, the attention cores attend
    /// locally).
    #[serde(default)]
    pub context_parallel: Option<ContextParallelRule>,
    /// Which of the pipeline rule's layers are recomputed in backward (activation
    /// checkpointing): `full`, `every:K` (layers `0, K, 2K, ...`), `blocks:I,J` or `none` (the
    /// default). A recomputed layer keeps only its input for backward and runs its forward
    /// again there; its fully sharded parameters are gathered again too, so between forward
    /// and backward a rank holds their shards only. Needs a pipeline rule (which names the
    /// layers and runs on a mesh without `pp` too).
    #[serde(default, with = "policy_name")]
    pub activation_checkpointing: CheckpointPolicy,
    /// Mixture-of-experts layers ([`crate::moe::Moe`]) whose routed experts are spread
    /// over `ep`: each rank holds `n_experts / ep` of every layer's and runs the tokens of every
    /// `ep` rank that chose them; the router and shared expert stay whole. The layer's forward is
    /// [`crate::expert_parallel::MoeForward::forward`]. `ep` ranks read different samples, as `dp` ranks do.
    #[serde(default)]
    pub expert_parallel: Vec<ModulePath>,
    /// Hot-expert replication for the `expert_parallel` layers (0, the default, copies none):
    /// each step, the `n` experts of each layer that took the most assignments in the previous
    /// step (summed over the `ep` group) are copied from their owners to every `ep` rank, whose
    /// tokens for them then stay on the rank instead of crossing the all-to-all; the copies'
    /// gradients are summed over `ep` and added to the owners' before the reduction. The same
    /// computation, with gradients summed in another order. Take backward passes with
    /// [`crate::parallelize::Parallelized::backward`] (the pipeline's steps do), which hands the copies'
    /// gradients over. Not for experts a `fully_shard` rule shards.
    #[serde(default)]
    pub replicate_hot_experts: usize,
    /// What the model computes in and its gradients are reduced in (FSDP2's
    /// `MixedPrecisionPolicy`; f32 throughout when absent). The parameters and the
    /// optimizer's state stay f32: [`crate::parallelize::Parallelized::forward`] and the pipeline's steps
    /// compute on [`MixedPrecision::compute_view`] of the model, so gradients come back in f32;
    /// fully sharded units are all-gathered in `param_dtype` (half the bytes for bf16) and
    /// reduce-scattered in `reduce_dtype`, as every other gradient is reduced. A policy that
    /// scales the loss (f16) scales it in [`crate::parallelize::Parallelized::backward`] (in
    /// [`crate::parallelize::PipelineRunner::step`] under a pipeline) and skips a step whose
    /// gradients overflowed. The TOML table is a job file's `[precision]`
    /// ([`crate::precision::PrecisionSettings`]).
    #[serde(default, with = "policy_settings")]
    pub mixed_precision: Option<MixedPrecision>,
    /// How gradients are summed over the data axes: buckets of `bucket_mb` MiB, reduced while
    /// backward runs (`overlap`) where the step's executor lets gradient hooks report them
    /// ([`crate::parallelize::PipelineRunner::step`], pipelined or one stage; its report says
    /// whether they did), else right after backward. Defaults: 4 MiB, overlapped.
    #[serde(default)]
    pub gradient_buckets: GradientBuckets,
    /// The seed of the dropout masks of [`crate::nn`]'s layers: with it, each step's masks are
    /// those a one-device loop draws after `flashover::nn::set_dropout_draws(dropout_seed,
    /// step, samples)` (see [`crate::nn::Dropout`]). Default 0.
    #[serde(default)]
    pub dropout_seed: u64,
}

/// A precision policy as the settings table it is written as.
mod policy_settings {
    use super::*;
    use crate::precision::PrecisionSettings;

    pub fn serialize<S: Serializer>(
        policy: &Option<MixedPrecision>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        policy.map(|p| p.settings()).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<MixedPrecision>, D::Error> {
        match Option::<PrecisionSettings>::deserialize(d)? {
            Some(settings) => Ok(Some(settings.policy().map_err(serde::de::Error::custom)?)),
            None => Ok(None),
        }
    }
}

/// A checkpoint policy by the name `CheckpointPolicy`'s `FromStr` reads (`every:2`).
mod policy_name {
    use super::*;

    pub fn serialize<S: Serializer>(policy: &CheckpointPolicy, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&policy.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<CheckpointPolicy, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// Sequence parallelism of one layer stack that splits its whole input itself
/// ([`crate::nn::transformer::TransformerEncoder::sequence_parallel_rules`]): the paths a plan
/// adds to `sequence_split_stacks` and `sequence_parallel`.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceParallelRules {
    /// The stack (a `sequence_split_stacks` path).
    pub stack: String,
    /// Its whole modules between split layers (`sequence_parallel` paths: norms).
    pub modules: Vec<String>,
}

impl ParallelizePlan {
    /// A plan that transforms nothing: the model replicated, its batch split over `dp`
    /// and `fsdp` (plain data parallelism).
    pub fn new() -> Self {
        Self::default()
    }

    /// Also fully shard the module at `path` (`""`: the whole model).
    pub fn fully_shard(mut self, path: &str) -> Self {
        self.fully_shard.push(ModulePath::new(path));
        self
    }

    /// Keep the parameters of the module at `path` whole under the `fully_shard` path that
    /// holds it (a layer of your own that reads a parameter's stored shape).
    pub fn keep_whole(mut self, path: &str) -> Self {
        self.keep_whole.push(ModulePath::new(path));
        self
    }

    /// Also split the linear layers of `rule` over `tp`.
    pub fn tensor_parallel(mut self, rule: TensorParallelRule) -> Self {
        self.tensor_parallel.push(rule);
        self
    }

    /// Also split the linear layers of every rule of `rules` over `tp` (a layer's ready-made
    /// set, such as [`crate::nn::transformer::TransformerEncoder::tensor_parallel_rules`]).
    pub fn tensor_parallel_rules(
        mut self,
        rules: impl IntoIterator<Item = TensorParallelRule>,
    ) -> Self {
        self.tensor_parallel.extend(rules);
        self
    }

    /// Also run the module at `path` on sequence shards (see the field's docs).
    pub fn sequence_parallel(mut self, path: &str) -> Self {
        self.sequence_parallel.push(ModulePath::new(path));
        self
    }

    /// Also run a layer stack under sequence parallelism as `rules` says: the stack splits
    /// its whole input, its modules between split layers run on this rank's positions.
    pub fn sequence_parallel_rules(mut self, rules: SequenceParallelRules) -> Self {
        self = self.sequence_split_stack(&rules.stack);
        for module in &rules.modules {
            self = self.sequence_parallel(module);
        }
        self
    }

    /// Also let the layer stack at `path` split its whole input by position (see the field's
    /// docs).
    pub fn sequence_split_stack(mut self, path: &str) -> Self {
        self.sequence_split_stacks.push(ModulePath::new(path));
        self
    }

    /// Also cut the model into pipeline stages as `rule` says.
    pub fn pipeline(mut self, rule: PipelineRule) -> Self {
        self.pipeline = Some(rule);
        self
    }

    /// Also split sequences over `cp` as `rule` says.
    pub fn context_parallel(mut self, rule: ContextParallelRule) -> Self {
        self.context_parallel = Some(rule);
        self
    }

    /// Also recompute the pipeline rule's layers that `policy` names in backward.
    pub fn activation_checkpointing(mut self, policy: CheckpointPolicy) -> Self {
        self.activation_checkpointing = policy;
        self
    }

    /// Also spread the experts of the mixture-of-experts layer at `path` over `ep`.
    pub fn expert_parallel(mut self, path: &str) -> Self {
        self.expert_parallel.push(ModulePath::new(path));
        self
    }

    /// Also copy the `n` hottest experts of every `expert_parallel` layer to every `ep` rank
    /// each step (see the field's docs).
    pub fn replicate_hot_experts(mut self, n: usize) -> Self {
        self.replicate_hot_experts = n;
        self
    }

    /// Also compute in `policy`'s dtype and reduce gradients in its reduce dtype (see the
    /// field's docs).
    pub fn mixed_precision(mut self, policy: MixedPrecision) -> Self {
        self.mixed_precision = Some(policy);
        self
    }

    /// Also sum gradients in buckets as `buckets` says (see the field's docs).
    pub fn gradient_buckets(mut self, buckets: GradientBuckets) -> Self {
        self.gradient_buckets = buckets;
        self
    }

    /// Seeds the dropout masks (see the field's docs).
    pub fn dropout_seed(mut self, seed: u64) -> Self {
        self.dropout_seed = seed;
        self
    }

    /// Fails, naming the path and the reason, when the plan does not fit `model` split over
    /// `tp` ranks: a path that names nothing, a tensor-parallel path that is not a linear
    /// layer, a width that does not divide (what [`crate::parallelize::parallelize`] checks first), without
    /// a mesh.
    pub fn check<M: burn::module::Module>(
        &self,
        model: &M,
        tp: usize,
    ) -> Result<(), ParallelError> {
        let layout = crate::params::ParamLayout::of(model);
        validate::check_plan(self, &layout.slots, Some(tp))
    }

    /// [`Self::check`] of the paths and styles only, not the widths: a model of the same
    /// structure and smaller widths checks a plan meant for a large one.
    pub fn check_paths<M: burn::module::Module>(&self, model: &M) -> Result<(), ParallelError> {
        let layout = crate::params::ParamLayout::of(model);
        validate::check_plan(self, &layout.slots, None)
    }

    /// A plan read from a TOML table (`fully_shard = ["blocks"]`); unknown keys are refused.
    pub fn from_toml(text: &str) -> Result<Self, ParallelError> {
        toml::from_str(text)
            .map_err(|e| ParallelError::Invalid(format!("invalid parallelize plan: {e}")))
    }

    /// The first `fully_shard` path that contains `param_path`, if any.
    pub(crate) fn shard_path(&self, param_path: &str) -> Option<&ModulePath> {
        self.fully_shard.iter().find(|p| p.contains(param_path))
    }

    /// Whether `param_path` is the parameter of an attention core the `context_parallel` rule
    /// names (held directly by the named module).
    pub(crate) fn attention_core(&self, param_path: &str) -> bool {
        let depth = param_path.split('.').count();
        self.context_parallel.as_ref().is_some_and(|rule| {
            rule.attention
                .iter()
                .any(|p| p.depth() + 1 == depth && p.contains(param_path))
        })
    }

    /// The tensor-parallel rule and path naming the linear layer that holds `param_path`
    /// directly (the path has one segment fewer than the parameter), if any.
    pub(crate) fn tp_rule(&self, param_path: &str) -> Option<(&TensorParallelRule, &ModulePath)> {
        let depth = param_path.split('.').count();
        self.tensor_parallel.iter().find_map(|rule| {
            rule.paths
                .iter()
                .find(|p| p.depth() + 1 == depth && p.contains(param_path))
                .map(|p| (rule, p))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_modules_segment_by_segment() {
        let blocks = ModulePath::new("blocks.*.mlp");
        assert!(blocks.contains("blocks.0.mlp.fc.weight"));
        assert!(blocks.contains("blocks.11.mlp.proj.bias"));
        assert!(!blocks.contains("blocks.0.attn.qkv.weight"));
        // A segment is matched whole: `block` is not a prefix of `blocks`.
        assert!(!ModulePath::new("block").contains("blocks.0.mlp.fc.weight"));
        assert!(!ModulePath::new("blocks.0.mlp.fc.weight.x").contains("blocks.0.mlp.fc.weight"));
        assert!(ModulePath::new("").contains("anything.at.all"));
    }

    #[test]
    fn unknown_plan_keys_are_refused_with_the_key() {
        let err = ParallelizePlan::from_toml(r#"fully_shrad = ["blocks"]"#).unwrap_err();
        assert!(err.to_string().contains("fully_shrad"), "{err}");
    }
}
