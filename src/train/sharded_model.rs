//! The reference transformer under ZeRO-3 / FSDP with the policy "every block": one fully
//! sharded unit per block and one for the rest (embedding, final norm, LM head), as TorchTitan
//! applies `fully_shard` to each block and then to the root.
//!
//! The root unit stays gathered for the whole step (its embedding is used first and its head
//! last); each block is gathered just before its forward and, with `reshard_after_forward`,
//! released right after and gathered again for its backward.

use burn::module::Module;
use burn::tensor::{Int, Tensor};
use flashover_models::{Block, Transformer, rope_tables};
use flashover_parallel::ParallelError;
use flashover_parallel::zero::{FullyShardConfig, FullyShardedUnit, GatherStats};
use flashover_runtime::Group;
use std::sync::Arc;

/// [`Transformer`] as fully sharded units; see the module docs.
#[derive(Module, Debug)]
pub struct ShardedTransformer {
    /// Embedding, final norm and head (a `Transformer` without blocks).
    pub root: FullyShardedUnit<Transformer>,
    /// One unit per block.
    pub blocks: Vec<FullyShardedUnit<Block>>,
    /// Per-head dimension (for the rotary tables).
    pub head_dim: usize,
}

impl ShardedTransformer {
    /// Shards `model` over `group` (collective).
    pub fn new(
        mut model: Transformer,
        config: &FullyShardConfig,
        group: &Group,
        stats: &Arc<GatherStats>,
    ) -> Result<Self, ParallelError> {
        let head_dim = model.blocks.first().map_or(2, |b| b.attn.head_dim);
        let blocks = std::mem::take(&mut model.blocks)
            .into_iter()
            .map(|block| config.init(block, group, stats))
            .collect::<Result<Vec<_>, _>>()?;
        // The root is needed at both ends of the step: keeping it gathered saves a gather.
        let root_config = FullyShardConfig::new().with_reshard_after_forward(false);
        Ok(ShardedTransformer {
            root: root_config.init(model, group, stats)?,
            blocks,
            head_dim,
        })
    }

    /// `tokens: [batch, seq]` -> logits `[batch, seq, vocab]`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Result<Tensor<3>, ParallelError> {
        let root = self.root.gather()?;
        let t = tokens.dims()[1];
        let h = root.embed_tokens(tokens);
        let rope = rope_tables(0, t, self.head_dim, root.rope_theta, &h.device());
        let mut h = h;
        for block in &self.blocks {
            let rope = rope.clone();
            h = block.forward(h, move |b: &Block, h| b.forward(h, &rope))?;
        }
        Ok(root.logits(h))
    }

    /// The whole model, gathered outside any graph (collective).
    pub fn gather_full(&self) -> Result<Transformer, ParallelError> {
        let this = self.valid();
        let mut model = this.root.gather()?;
        model.blocks = this
            .blocks
            .iter()
            .map(|b| b.gather())
            .collect::<Result<_, _>>()?;
        Ok(model)
    }

    /// Elements in the largest unit (unpadded).
    pub fn largest_unit(&self) -> usize {
        self.blocks
            .iter()
            .map(|b| b.numel())
            .chain([self.root.numel()])
            .max()
            .unwrap_or(0)
    }
}
