//! The reference transformer split into pipeline stages: the first virtual stage holds the
//! embedding, every stage a contiguous run of blocks, the last the final norm and LM head (and
//! computes the loss).

use super::tp_model::{split_heads, tp_block_forward, tp_context};
use burn::module::{Module, ModuleMapper, Param};
use burn::nn::{Embedding, Linear, RmsNorm};
use burn::tensor::{Int, Tensor};
use flashover_models::{Block, ForwardContext, OutputHead, Transformer};
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::TensorParallelParts;
use flashover_parallel::pipeline::StageOutput;
use flashover_parallel::tensor_parallel::TensorParallel;

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
    /// With tensor parallelism inside the stage: the plan and how its parts turn back whole.
    #[module(skip)]
    tp: Option<(TensorParallel, TensorParallelParts)>,
}

/// A parameter's copy: a new parameter (its own id and values) with the same placement (a
/// tensor-parallel part stays one, its split recorded).
struct FreshCopy;

impl ModuleMapper for FreshCopy {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let value = param.val();
        Param::from_data(value.clone().detach().into_data(), &value.device())
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
    /// tensor-parallel parts ([`crate::train::TpTransformer::local`]).
    pub fn cut_split(
        full: &Transformer,
        stage: usize,
        counts: &[usize],
        tp: Option<(TensorParallel, TensorParallelParts)>,
    ) -> Result<Self, ParallelError> {
        let first: usize = counts[..stage].iter().sum();
        let last = stage + 1 == counts.len();
        Ok(TransformerStage {
            embed: (stage == 0).then(|| full.embed.clone()),
            blocks: full.blocks[first..first + counts[stage]].to_vec(),
            norm: last.then(|| full.norm.clone()),
            head: if last { full.head.clone() } else { None },
            tied_head: (last && full.head.is_none())
                .then(|| Module::map(full.embed.weight.clone(), &mut FreshCopy)),
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
        let heads = split_heads(self.blocks.first());
        let ctx = match &self.tp {
            Some((tp, _)) => tp_context(ctx, tp, heads, t),
            None => ctx.clone(),
        };
        let mut h = match (&self.embed, input) {
            (Some(embed), _) => ctx.embed(embed, tokens),
            (None, Some(x)) => x,
            (None, None) => panic!("a middle pipeline stage ran without its input"),
        };
        let rope = ctx.rope_tables(t, self.head_dim, self.rope_theta, &h.device());
        for (i, block) in self.blocks.iter().enumerate() {
            let layer = self.first_block + i;
            let (rope, tp) = (rope.clone(), self.tp.clone());
            h = ctx.block(layer, block, h, move |b, h, ctx| match &tp {
                Some((tp, _)) => tp_block_forward(b, h, &rope, ctx, layer, tp),
                None => b.forward_with(h, &rope, ctx, layer),
            });
        }
        let tied;
        let head = match (&self.head, &self.tied_head) {
            (Some(head), _) => OutputHead::Untied(head),
            (None, Some(table)) => {
                tied = Embedding {
                    weight: table.clone(),
                };
                OutputHead::Tied(&tied)
            }
            (None, None) => return StageOutput::Activation(h),
        };
        match &self.norm {
            Some(norm) => StageOutput::Loss(ctx.loss(head, norm.forward(h), targets)),
            None => StageOutput::Activation(h),
        }
    }

    /// The stage with every tensor-parallel rank's parts gathered back (collective over `tp`;
    /// the stage itself without tensor parallelism).
    pub fn unshard(&self) -> Result<Self, ParallelError> {
        let full = self.clone().valid();
        Ok(match &self.tp {
            Some((_, parts)) => TransformerStage {
                tp: None,
                ..parts.whole(full).valid()
            },
            None => full,
        })
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
