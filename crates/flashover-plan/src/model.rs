//! What is trained: a decoder-only transformer's shape and the batch it sees.

use serde::{Deserialize, Serialize};

/// A Llama-style decoder-only transformer (RMSNorm, rotary attention with grouped key/value
/// heads, SwiGLU MLP, optionally a mixture of experts in place of the MLP).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Preset name or `custom`.
    pub name: String,
    /// Transformer blocks.
    pub layers: usize,
    /// Model width.
    pub hidden: usize,
    /// Attention (query) heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention; `heads` for plain multi-head attention).
    pub kv_heads: usize,
    /// MLP (or each expert's) hidden width.
    pub ffn: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Embedding and LM head share one matrix.
    pub tied_embeddings: bool,
    /// Experts per MoE layer (0: dense MLP).
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
}

/// The batch: sequences per optimizer step and their length (how each rank's share is cut into
/// micro-batches is part of the [`crate::Layout`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Sequences per optimizer step, over all data-parallel ranks.
    pub global_batch: usize,
}

impl ModelSpec {
    /// Presets: Llama 3 shapes `llama-1b`, `llama-8b`, `llama-70b`, `llama-405b`.
    pub fn preset(name: &str) -> Option<ModelSpec> {
        let llama = |name: &str, layers, hidden, heads, ffn, tied| ModelSpec {
            name: name.into(),
            layers,
            hidden,
            heads,
            kv_heads: 8,
            ffn,
            vocab: 128_256,
            tied_embeddings: tied,
            experts: 0,
            top_k: 0,
        };
        Some(match name.to_ascii_lowercase().as_str() {
            "llama-1b" => llama("llama-1b", 16, 2048, 32, 8192, true),
            "llama-8b" => llama("llama-8b", 32, 4096, 32, 14_336, false),
            "llama-70b" => llama("llama-70b", 80, 8192, 64, 28_672, false),
            "llama-405b" => llama("llama-405b", 126, 16_384, 128, 53_248, false),
            _ => return None,
        })
    }

    /// Names of the presets.
    pub const PRESETS: [&'static str; 4] = ["llama-1b", "llama-8b", "llama-70b", "llama-405b"];

    /// Parameters of one block's attention.
    pub fn attention_params(&self) -> f64 {
        let (h, kv) = (self.hidden as f64, self.kv_width());
        // q and o are h x h; k and v are h x kv_width.
        2.0 * h * h + 2.0 * h * kv
    }

    /// Width of the keys (and of the values): `kv_heads x head_dim`.
    pub fn kv_width(&self) -> f64 {
        (self.hidden / self.heads.max(1) * self.kv_heads) as f64
    }

    /// Parameters of one MLP (or of one expert).
    pub fn mlp_params(&self) -> f64 {
        3.0 * self.hidden as f64 * self.ffn as f64
    }

    /// Parameters of one block: attention, MLP (every expert and the router), two norms.
    pub fn block_params(&self) -> f64 {
        let h = self.hidden as f64;
        let ffn = if self.experts > 0 {
            self.experts as f64 * self.mlp_params() + h * self.experts as f64
        } else {
            self.mlp_params()
        };
        self.attention_params() + ffn + 2.0 * h
    }

    /// Parameters of the embedding and (untied) LM head, and the final norm.
    pub fn embedding_params(&self) -> f64 {
        let table = (self.vocab * self.hidden) as f64;
        table * if self.tied_embeddings { 1.0 } else { 2.0 } + self.hidden as f64
    }

    /// All parameters.
    pub fn params(&self) -> f64 {
        self.layers as f64 * self.block_params() + self.embedding_params()
    }

    /// Parameters a token goes through (a mixture of experts uses `top_k` experts).
    pub fn active_params(&self) -> f64 {
        self.layers as f64 * self.active_block_params() + self.embedding_params()
    }

    /// Parameters of one block that a token goes through.
    pub fn active_block_params(&self) -> f64 {
        if self.experts == 0 {
            return self.block_params();
        }
        let h = self.hidden as f64;
        self.attention_params()
            + self.top_k as f64 * self.mlp_params()
            + h * self.experts as f64
            + 2.0 * h
    }

    /// Model FLOPs of one optimizer step over `tokens` tokens of sequences of `seq_len`:
    /// `6 N` per token for the weights (forward 2, backward 4) plus `12 L h s` for attention's
    /// two score products (PaLM's accounting, full non-causal scores).
    pub fn step_flops(&self, tokens: f64, seq_len: usize) -> f64 {
        let attention = 12.0 * self.layers as f64 * self.hidden as f64 * seq_len as f64;
        (6.0 * self.active_params() + attention) * tokens
    }

    /// What is wrong with the description (each problem named by field).
    pub fn validate(&self) -> Vec<String> {
        let mut errors = vec![];
        for (name, v) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("ffn", self.ffn),
            ("vocab", self.vocab),
        ] {
            if v == 0 {
                errors.push(format!("model.{name} must be at least 1"));
            }
        }
        if self.heads > 0 && !self.hidden.is_multiple_of(self.heads) {
            errors.push(format!(
                "model.heads = {} does not divide model.hidden = {}",
                self.heads, self.hidden
            ));
        }
        if self.kv_heads > 0 && !self.heads.is_multiple_of(self.kv_heads) {
            errors.push(format!(
                "model.kv_heads = {} does not divide model.heads = {}",
                self.kv_heads, self.heads
            ));
        }
        if self.experts > 0 && (self.top_k == 0 || self.top_k > self.experts) {
            errors.push(format!(
                "model.top_k = {} must be between 1 and model.experts = {}",
                self.top_k, self.experts
            ));
        }
        errors
    }
}

impl Workload {
    /// Tokens per optimizer step.
    pub fn tokens(&self) -> f64 {
        (self.seq_len * self.global_batch) as f64
    }
}
