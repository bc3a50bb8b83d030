//! The reference transformer split into pipeline stages: the first virtual stage holds the
//! embedding, every stage a contiguous run of blocks, the last the final norm and LM head (and
//! computes the loss).

use burn::module::Module;
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::tensor::{Int, Tensor};
use flashover_models::{Block, ForwardContext, Transformer, next_token_loss, rope_tables};
use flashover_parallel::ParallelError;
use flashover_parallel::pipeline::StageOutput;

/// One virtual stage of [`Transformer`].
#[derive(Module, Debug)]
pub struct TransformerStage {
    /// The embedding (first stage only).
    pub embed: Option<Embedding>,
    /// This stage's blocks.
    pub blocks: Vec<Block>,
    /// Final norm (last stage only).
    pub norm: Option<RmsNorm>,
    /// LM head (last stage only; the model must not tie it to the embedding).
    pub head: Option<Linear>,
    /// Index of this stage's first block in the whole model.
    pub first_block: usize,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// Per-head dimension.
    pub head_dim: usize,
}

/// Blocks per virtual stage: `n_layers` spread evenly over `stages` (earlier stages take the
/// remainder), or an explicit list that must sum to `n_layers`.
pub fn split_blocks(
    n_layers: usize,
    stages: usize,
    explicit: Option<&[usize]>,
) -> Result<Vec<usize>, String> {
    if let Some(list) = explicit {
        if list.len() != stages || list.iter().sum::<usize>() != n_layers {
            return Err(format!(
                "parallel.pp_blocks = {list:?} must give {stages} stages whose blocks sum to model.n_layers = {n_layers}"
            ));
        }
        return Ok(list.to_vec());
    }
    if n_layers < stages {
        return Err(format!(
            "model.n_layers = {n_layers} cannot fill {stages} pipeline stages: every stage needs a block"
        ));
    }
    Ok((0..stages)
        .map(|k| n_layers / stages + (k < n_layers % stages) as usize)
        .collect())
}

impl TransformerStage {
    /// Virtual stage `stage` of `stages` cut from `full`, with `counts` blocks per stage.
    pub fn cut(full: &Transformer, stage: usize, counts: &[usize]) -> Result<Self, ParallelError> {
        if full.head.is_none() && counts.len() > 1 {
            return Err(ParallelError::Invalid(
                "pipeline stages need an untied LM head: set model.tie_embeddings = false".into(),
            ));
        }
        let first: usize = counts[..stage].iter().sum();
        let last = stage + 1 == counts.len();
        Ok(TransformerStage {
            embed: (stage == 0).then(|| full.embed.clone()),
            blocks: full.blocks[first..first + counts[stage]].to_vec(),
            norm: last.then(|| full.norm.clone()),
            head: if last { full.head.clone() } else { None },
            first_block: first,
            rope_theta: full.rope_theta,
            head_dim: full.blocks.first().map_or(2, |b| b.attn.head_dim),
        })
    }

    /// Runs the stage on `input` (the previous stage's activation) or, on the first stage, on
    /// `tokens`; on the last stage returns the loss against `targets`.
    pub fn forward(
        &self,
        input: Option<Tensor<3>>,
        tokens: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        ctx: &ForwardContext,
    ) -> StageOutput<3> {
        let t = tokens.dims()[1];
        let mut h = match (&self.embed, input) {
            (Some(embed), _) => embed.forward(tokens),
            (None, Some(x)) => x,
            (None, None) => panic!("a middle pipeline stage ran without its input"),
        };
        let rope = rope_tables(0, t, self.head_dim, self.rope_theta, &h.device());
        for (i, block) in self.blocks.iter().enumerate() {
            h = block.forward_with(h, &rope, ctx, self.first_block + i);
        }
        match (&self.norm, &self.head) {
            (Some(norm), Some(head)) => {
                StageOutput::Loss(next_token_loss(head.forward(norm.forward(h)), targets))
            }
            _ => StageOutput::Activation(h),
        }
    }

    /// This stage's parameters with the whole model's names (`blocks.{global index}...`).
    pub fn global_name(&self, local: &str) -> String {
        match local.strip_prefix("blocks.") {
            Some(rest) => {
                let (index, tail) = rest.split_once('.').unwrap_or((rest, ""));
                let index: usize = index.parse().unwrap_or(0);
                format!("blocks.{}.{tail}", self.first_block + index)
            }
            None => local.to_string(),
        }
    }
}
