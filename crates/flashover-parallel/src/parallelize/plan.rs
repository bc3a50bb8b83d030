//! A parallelization plan as data: which modules of a model each strategy transforms, named by
//! their paths in the model (`blocks.*.attn`), as a Rust value or a TOML table.

use crate::error::ParallelError;
use serde::{Deserialize, Serialize};

/// A dotted module path (`blocks.3.attn.wq`) naming a module and everything inside it. A `*`
/// segment matches any one segment (`blocks.*.mlp`); the empty path names the whole model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ModulePath(String);

impl ModulePath {
    /// The path `path` (see the type's docs).
    pub fn new(path: &str) -> Self {
        ModulePath(path.to_string())
    }

    /// The path as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether the parameter at `param_path` lies inside the module this path names.
    pub fn contains(&self, param_path: &str) -> bool {
        if self.0.is_empty() {
            return true;
        }
        let mut param = param_path.split('.');
        self.0
            .split('.')
            .all(|want| param.next().is_some_and(|got| want == "*" || want == got))
    }
}

/// Which modules of a model each strategy transforms (see [`super::parallelize`]).
///
/// ```
/// use flashover_parallel::parallelize::ParallelizePlan;
///
/// // TOML, as in a job file's `[parallelize]` table ...
/// let plan = ParallelizePlan::from_toml(r#"fully_shard = ["blocks", "embed"]"#).unwrap();
/// // ... or the same plan in Rust.
/// assert_eq!(plan, ParallelizePlan::new().fully_shard("blocks").fully_shard("embed"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelizePlan {
    /// Modules whose parameters are fully sharded over the `fsdp` axis (ZeRO-3): each rank
    /// keeps rows `rank * chunk ..` of every parameter's first dimension and gathers the whole
    /// parameter where the model reads it. Parameters outside them stay whole, replicated
    /// over `fsdp` as over `dp`.
    #[serde(default)]
    pub fully_shard: Vec<ModulePath>,
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

    /// A plan read from a TOML table (`fully_shard = ["blocks"]`); unknown keys are refused.
    pub fn from_toml(text: &str) -> Result<Self, ParallelError> {
        toml::from_str(text)
            .map_err(|e| ParallelError::Invalid(format!("invalid parallelize plan: {e}")))
    }

    /// The first `fully_shard` path that contains `param_path`, if any.
    pub(crate) fn shard_path(&self, param_path: &str) -> Option<&ModulePath> {
        self.fully_shard.iter().find(|p| p.contains(param_path))
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
