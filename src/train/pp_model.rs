//! The reference transformer split into pipeline stages: the first virtual stage holds the
//! embedding, every stage a contiguous run of blocks, the last the final norm and LM head (and
//! computes the loss).

use super::tp_model::{tp_block_forward, tp_context, tp_loss, unshard_block};
use burn::module::{Module, Param};
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::tensor::{Int, Tensor};
use flashover_models::{Block, ForwardContext, LinearOp, Transformer, next_token_loss};
use flashover_parallel::ParallelError;
use flashover_parallel::pipeline::{StageOutput, WeightGradStore, deferred_linear};
use flashover_parallel::tensor_parallel::{
    TensorParallel, VocabShard, gather_parts, vocab_parallel_embedding,
};

/// One virtual stage of [`Transformer`].
///
/// ```
/// use burn::tensor::{Device, Int, Tensor};
/// use flashover::train::TransformerStage;
/// use flashover_models::{ForwardContext, TransformerConfig};
/// use flashover_parallel::pipeline::StageOutput;
///
/// let model = TransformerConfig { tie_embeddings: false, ..TransformerConfig::tiny(16) }
///     .init(3, &Device::flex());
/// // Two stages of one block each: the first embeds, the last computes the loss.
/// let (first, last) = (
///     TransformerStage::cut(&model, 0, &[1, 1]).unwrap(),
///     TransformerStage::cut(&model, 1, &[1, 1]).unwrap(),
/// );
/// // The stage keeps the whole model's parameters (their ids too): the placements name them.
/// assert_eq!(last.blocks[0].attn.wq.weight.id, model.blocks[1].attn.wq.weight.id);
/// let tokens = Tensor::<2, Int>::from_ints([[1, 2, 3, 4, 5]], &Device::flex());
/// let (inputs, targets) = (tokens.clone().narrow(1, 0, 4), tokens.narrow(1, 1, 4));
/// let ctx = ForwardContext::default();
/// let StageOutput::Activation(h) = first.forward(None, inputs.clone(), targets.clone(), &ctx)
/// else { panic!("the first stage passes activations on") };
/// let StageOutput::Loss(loss) = last.forward(Some(h), inputs, targets, &ctx)
/// else { panic!("the last stage computes the loss") };
/// assert!(loss.into_scalar::<f32>().is_finite());
/// ```
#[derive(Module, Debug)]
pub struct TransformerStage {
    /// The embedding (first stage only).
    pub embed: Option<Embedding>,
    /// This stage's blocks.
    pub blocks: Vec<Block>,
    /// Final norm (last stage only).
    pub norm: Option<RmsNorm>,
    /// LM head (last stage only, untied models).
    pub head: Option<Linear>,
    /// The last stage's copy of the embedding table, used as the LM head of a tied model.
    /// Its gradient is summed with the first stage's embedding gradient every step, so both
    /// copies stay equal (as Megatron does across its first and last stages).
    pub tied_head: Option<Param<Tensor<2>>>,
    /// Index of this stage's first block in the whole model.
    pub first_block: usize,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// Per-head dimension.
    pub head_dim: usize,
    /// With tensor parallelism inside the stage: the plan and this rank's vocabulary rows.
    #[module(skip)]
    tp: Option<(TensorParallel, VocabShard)>,
}

/// Runs the blocks' linear layers with their weight gradients deferred to a store, for
/// zero-bubble schedules (see [`flashover_parallel::pipeline::deferred_linear`]).
pub struct DeferWeightGrads(pub WeightGradStore);

impl LinearOp for DeferWeightGrads {
    fn apply(&self, linear: &Linear, x: Tensor<3>) -> Tensor<3> {
        deferred_linear(linear, x, &self.0)
    }
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

/// Blocks per virtual stage balancing an estimate of each stage's compute: a block costs its
/// matrix products per token (`2 (4 d^2 + 3 d f)`) plus attention (`4 t d`), and the last stage
/// also pays the LM head (`2 d V`). The contiguous split minimising the most expensive stage,
/// every stage holding at least one block.
pub fn split_blocks_by_cost(
    config: &flashover_models::TransformerConfig,
    seq_len: usize,
    stages: usize,
) -> Result<Vec<usize>, String> {
    let (d, f, v, t) = (
        config.d_model as f64,
        config.d_ff as f64,
        config.vocab_size as f64,
        seq_len as f64,
    );
    let n = config.n_layers;
    if n < stages {
        return Err(format!(
            "model.n_layers = {n} cannot fill {stages} pipeline stages: every stage needs a block"
        ));
    }
    let block = 2.0 * (4.0 * d * d + 3.0 * d * f) + 4.0 * t * d;
    let head = 2.0 * d * v;
    let (counts, _) = flashover_plan::stages::balanced_stages(n, stages, block, head)
        .ok_or_else(|| format!("model.n_layers = {n} cannot fill {stages} pipeline stages"))?;
    Ok(counts)
}

impl TransformerStage {
    /// Virtual stage `stage` of `stages` cut from `full`, with `counts` blocks per stage.
    pub fn cut(full: &Transformer, stage: usize, counts: &[usize]) -> Result<Self, ParallelError> {
        Self::cut_split(full, stage, counts, None)
    }

    /// [`TransformerStage::cut`] from a model whose weights are already this rank's
    /// tensor-parallel shares ([`crate::train::TpTransformer::local`]).
    pub fn cut_split(
        full: &Transformer,
        stage: usize,
        counts: &[usize],
        tp: Option<(TensorParallel, VocabShard)>,
    ) -> Result<Self, ParallelError> {
        let first: usize = counts[..stage].iter().sum();
        let last = stage + 1 == counts.len();
        Ok(TransformerStage {
            embed: (stage == 0).then(|| full.embed.clone()),
            blocks: full.blocks[first..first + counts[stage]].to_vec(),
            norm: last.then(|| full.norm.clone()),
            head: if last { full.head.clone() } else { None },
            tied_head: (last && full.head.is_none()).then(|| {
                let w = full.embed.weight.val();
                Param::from_data(w.clone().detach().into_data(), &w.device())
            }),
            first_block: first,
            rope_theta: full.rope_theta,
            head_dim: full.blocks.first().map_or(2, |b| b.attn.head_dim),
            tp,
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
        let mut h = match (&self.embed, input, &self.tp) {
            (Some(embed), _, Some((tp, vocab))) => {
                vocab_parallel_embedding(embed.weight.val(), tokens, vocab, tp)
            }
            (Some(embed), _, None) => embed.forward(tokens),
            (None, Some(x), _) => x,
            (None, None, _) => panic!("a middle pipeline stage ran without its input"),
        };
        let rope = ctx.rope_tables(t, self.head_dim, self.rope_theta, &h.device());
        let heads = self.blocks.first().map_or(0, |b| b.attn.n_heads);
        for (i, block) in self.blocks.iter().enumerate() {
            let layer = self.first_block + i;
            let rope = rope.clone();
            h = match &self.tp {
                Some((tp, _)) => {
                    let (inner, tp) = (tp_context(ctx, tp, heads, t), tp.clone());
                    inner.block(layer, block, h, move |b, h, ctx| {
                        tp_block_forward(b, h, &rope, ctx, layer, &tp)
                    })
                }
                None => ctx.block(layer, block, h, move |b, h, ctx| {
                    b.forward_with(h, &rope, ctx, layer)
                }),
            };
        }
        let head = match (&self.head, &self.tied_head) {
            (Some(head), _) => Some(head.weight.val()),
            (None, Some(table)) => Some(table.val().transpose()),
            (None, None) => None,
        };
        match (&self.norm, head, &self.tp) {
            (Some(norm), Some(head), Some((tp, vocab))) => {
                StageOutput::Loss(tp_loss(norm, head, h, targets, vocab, tp))
            }
            (Some(norm), Some(head), None) => {
                let h = norm.forward(h);
                let [b, t, d] = h.dims();
                let v = head.dims()[1];
                let logits = h.reshape([b * t, d]).matmul(head).reshape([b, t, v]);
                StageOutput::Loss(next_token_loss(logits, targets))
            }
            _ => StageOutput::Activation(h),
        }
    }

    /// The stage with every tensor-parallel rank's shares gathered back (collective over `tp`;
    /// the stage itself without tensor parallelism).
    pub fn unshard(&self) -> Result<Self, ParallelError> {
        let mut full = self.clone().valid();
        if let Some((tp, vocab)) = &self.tp {
            for block in &mut full.blocks {
                unshard_block(block, tp)?;
            }
            if let Some(embed) = &full.embed {
                let rows = gather_parts(embed.weight.val(), 0, &tp.group, Some(vocab.vocab))?;
                full.embed = Some(Embedding {
                    weight: Param::from_tensor(rows),
                });
            }
            if let Some(table) = &full.tied_head {
                let rows = gather_parts(table.val(), 0, &tp.group, Some(vocab.vocab))?;
                full.tied_head = Some(Param::from_tensor(rows));
            }
            if let Some(head) = &full.head {
                let columns = gather_parts(head.weight.val(), 1, &tp.group, Some(vocab.vocab))?;
                full.head = Some(Linear {
                    weight: Param::from_tensor(columns),
                    bias: None,
                });
            }
            full.tp = None;
        }
        Ok(full)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashover_models::TransformerConfig;

    #[test]
    fn even_splits_give_the_remainder_to_the_first_stages_and_explicit_lists_are_checked() {
        assert_eq!(split_blocks(8, 3, None).unwrap(), vec![3, 3, 2]);
        assert_eq!(split_blocks(4, 2, Some(&[1, 3])).unwrap(), vec![1, 3]);
        assert!(
            split_blocks(4, 2, Some(&[1, 2]))
                .unwrap_err()
                .contains("sum to model.n_layers = 4")
        );
        assert!(
            split_blocks(2, 3, None)
                .unwrap_err()
                .contains("cannot fill 3")
        );
    }

    #[test]
    fn a_heavy_head_leaves_the_last_stage_fewer_blocks() {
        // d 64, d_ff 172: a block costs ~2 (4 x 64^2 + 3 x 64 x 172) = 99k per token; a head
        // over 4096 words costs 2 x 64 x 4096 = 524k, about five blocks.
        let config = TransformerConfig::new(4096, 64, 8, 4, 172);
        let counts = split_blocks_by_cost(&config, 32, 2).unwrap();
        assert_eq!(counts.iter().sum::<usize>(), 8);
        assert!(counts[1] < counts[0], "{counts:?}");
        // Without a vocabulary to speak of, the split is even.
        let light = TransformerConfig::new(2, 64, 8, 4, 172);
        assert_eq!(split_blocks_by_cost(&light, 32, 2).unwrap(), vec![4, 4]);
    }
}
