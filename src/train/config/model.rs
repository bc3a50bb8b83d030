//! `[model]` and `[moe]`: the reference transformer a job trains.

use flashover_models::moe::{DropPolicy, RouterKind};
use serde::{Deserialize, Serialize};

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
