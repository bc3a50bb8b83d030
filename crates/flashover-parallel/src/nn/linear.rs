//! Burn's `Linear`, splittable column- or row-wise.

use crate::pipeline::deferred_product;
use crate::pipeline::weight_grad::forward_store;
use crate::placed::{TpSplit, local_value, tp_split, value_dims};
use crate::plan::TpStyle;
use crate::tensor_parallel::async_colwise::colwise_product;
use crate::tensor_parallel::{TensorParallel, VocabShard};
use burn::config::Config;
use burn::module::{Module, Param, ParamId};
use burn::nn::Initializer;
use burn::tensor::module::linear;
use burn::tensor::{Device, Int, Tensor};
use flashover_comm::Group;

/// Burn's [`burn::nn::Linear`] (`y = x W + b`, `W: [d_in, d_out]`), splittable by a plan.
#[derive(Module, Debug)]
pub struct Linear {
    /// `[d_in, d_out]`, or this rank's columns (column-wise) or rows (row-wise) of it.
    pub weight: Param<Tensor<2>>,
    /// `[d_out]`, or this rank's entries (column-wise).
    pub bias: Option<Param<Tensor<1>>>,
}

/// [`burn::nn::LinearConfig`] for [`Linear`]: the same fields, defaults and initialisation.
#[derive(Config, Debug)]
pub struct LinearConfig {
    /// Input features.
    pub d_input: usize,
    /// Output features.
    pub d_output: usize,
    /// Whether the layer adds a bias.
    #[config(default = true)]
    pub bias: bool,
    /// How the weight and bias are initialised (Burn's default).
    #[config(
        default = "Initializer::KaimingUniform { gain: 1.0 / 3.0f64.sqrt(), fan_out_only: false }"
    )]
    pub initializer: Initializer,
}

impl LinearConfig {
    /// A new layer, initialised as Burn's `LinearConfig::init` does.
    pub fn init(&self, device: &Device) -> Linear {
        burn::nn::LinearConfig::new(self.d_input, self.d_output)
            .with_bias(self.bias)
            .with_initializer(self.initializer.clone())
            .init(device)
            .into()
    }
}

impl From<burn::nn::Linear> for Linear {
    fn from(layer: burn::nn::Linear) -> Self {
        Linear {
            weight: layer.weight,
            bias: layer.bias,
        }
    }
}

impl Linear {
    /// `x: [.., d_in]` -> `[.., d_out]`. Split column-wise, `x` is whole and the output this
    /// rank's [`Self::d_output`] features (the gradient of `x` summed over `tp`); split
    /// row-wise, `x` is this rank's [`Self::d_input`] features and the output whole (partial
    /// products summed over `tp`, then the bias added).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        placed_linear(&self.weight, self.bias.as_ref(), x)
    }

    /// `layers` applied to one input `x`, as `layers.map(|l| l.forward(x.clone()))` computes
    /// it, but with one entry into the tensor-parallel region for all of them when they are
    /// column-wise splits over one `tp` group (attention's query, key and value; SwiGLU's gate
    /// and up): one all-reduce of `x`'s gradient in backward (one all-gather of `x` under
    /// sequence parallelism) instead of one per layer, as Megatron's fused QKV projection
    /// has. Layers split otherwise, or not at all, run one by one.
    pub fn forward_shared<const D: usize, const N: usize>(
        layers: [&Linear; N],
        x: Tensor<D>,
    ) -> [Tensor<D>; N] {
        let params = layers.map(|l| (&l.weight, l.bias.as_ref()));
        match placed_linears(&params, x).try_into() {
            Ok(outputs) => outputs,
            Err(_) => unreachable!("one output per layer"),
        }
    }

    /// The mean cross-entropy of this layer's output `logits: [batch, seq, d_out]` (an output
    /// head) against `targets: [batch, seq]`; split column-wise (a vocabulary-parallel head),
    /// computed from each rank's part of the logits without gathering them.
    pub fn cross_entropy(&self, logits: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        super::cross_entropy(logits, targets, head_split(&self.weight))
    }

    /// Input features this rank's part reads (`d_in / tp` when split row-wise).
    pub fn d_input(&self) -> usize {
        value_dims(&self.weight)[0]
    }

    /// Output features this rank's part computes (`d_out / tp` when split column-wise): size
    /// attention heads from it (`heads = query.d_output() / head_dim`) so a split layer
    /// yields `heads / tp` of them.
    pub fn d_output(&self) -> usize {
        value_dims(&self.weight)[1]
    }
}

/// `x weight + bias`, `weight` the value (this rank's part) of parameter `param`: Burn's
/// `linear`, or inside a zero-bubble pipeline forward with the weight's gradient deferred to
/// the step's store (`pipeline::deferred_product`).
fn local_product<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    param: ParamId,
    bias: Option<Tensor<1>>,
) -> Tensor<D> {
    match forward_store() {
        Some(store) => deferred_product(x, weight, param, bias, &store),
        None => linear(x, weight, bias),
    }
}

/// The `tp` stream on which a column-wise layer's backward all-reduces (with sequence
/// parallelism, reduce-scatters) its input's gradient while it computes its weight's
/// (Megatron's asynchronous tensor parallelism): not while a zero-bubble step defers weight
/// gradients to its weight actions.
fn overlapping_stream(split: &TpSplit) -> Option<&std::sync::Arc<flashover_runtime::CommStream>> {
    split.stream.as_ref().filter(|_| forward_store().is_none())
}

/// `y + b`, the bias broadcast over `y`'s leading dimensions.
fn with_bias<const D: usize>(y: Tensor<D>, bias: Option<Tensor<1>>) -> Tensor<D> {
    match bias {
        Some(b) => y + b.unsqueeze(),
        None => y,
    }
}

/// What [`Linear::forward`] computes, for a linear layer's parameters held by any module (the
/// reference transformer's Burn `Linear`s): `x W + b` with the collectives of the split the
/// plan recorded on `weight`, or Burn's `linear` when it is not split (see [`local_product`]).
pub(crate) fn placed_linear<const D: usize>(
    weight: &Param<Tensor<2>>,
    bias: Option<&Param<Tensor<1>>>,
    x: Tensor<D>,
) -> Tensor<D> {
    let (id, param) = (weight.id, weight);
    let (weight, split) = local_value(weight);
    let Some(split) = split else {
        return local_product(x, weight, id, bias.map(|b| local_value(b).0));
    };
    super::sequence_split::check_inside_stack(param, split);
    let tp = TensorParallel::new(&split.group).with_sequence_parallel(split.sequence_parallel);
    match split.style {
        TpStyle::Colwise => {
            let bias = bias.map(|b| local_value(b).0);
            let sp = split.sequence_parallel;
            let overlapped = overlapping_stream(split)
                .and_then(|stream| colwise_product(x.clone(), weight.clone(), stream, sp));
            match overlapped {
                Some(y) => with_bias(y, bias),
                None => local_product(tp.enter(x), weight, id, bias),
            }
        }
        TpStyle::Rowwise => {
            let y = tp.exit(local_product(x, weight, id, None));
            // The bias's gradient is summed over tp under sequence parallelism (its value
            // carries that).
            match bias {
                Some(b) => y + b.val().unsqueeze(),
                None => y,
            }
        }
        TpStyle::Vocab => panic!(
            "a `vocab` rule names a Linear: vocab rules split embedding tables \
             (flashover::nn::Embedding); split an output head column-wise"
        ),
    }
}

/// What [`Linear::forward_shared`] computes, for linear layers' `(weight, bias)` held by any
/// module.
pub(crate) fn placed_linears<const D: usize>(
    layers: &[(&Param<Tensor<2>>, Option<&Param<Tensor<1>>>)],
    x: Tensor<D>,
) -> Vec<Tensor<D>> {
    let splits: Vec<Option<&TpSplit>> = layers.iter().map(|(w, _)| tp_split(w)).collect();
    let shared = splits.first().copied().flatten().filter(|first| {
        first.style == TpStyle::Colwise
            && splits.iter().all(|s| {
                s.is_some_and(|s| {
                    s.style == TpStyle::Colwise
                        && s.sequence_parallel == first.sequence_parallel
                        && std::sync::Arc::ptr_eq(
                            s.group.communicator(),
                            first.group.communicator(),
                        )
                })
            })
    });
    let Some(split) = shared else {
        return layers
            .iter()
            .map(|(w, b)| placed_linear(w, *b, x.clone()))
            .collect();
    };
    super::sequence_split::check_inside_stack(layers[0].0, split);
    let stream = overlapping_stream(split).filter(|_| !split.sequence_parallel || D == 3);
    if let Some(stream) = stream {
        // One product with the layers' parts side by side: one collective on the input's
        // gradient, overlapped with their weights' gradients.
        let weights: Vec<Tensor<2>> = layers.iter().map(|(w, _)| local_value(w).0).collect();
        let widths: Vec<usize> = weights.iter().map(|w| w.dims()[1]).collect();
        let y = colwise_product(x, Tensor::cat(weights, 1), stream, split.sequence_parallel)
            .expect("a sequence split of [batch, seq, d_in] (checked above)");
        let mut start = 0;
        return (layers.iter().zip(widths))
            .map(|((_, b), width)| {
                let part = y.clone().narrow(D - 1, start, width);
                start += width;
                with_bias(part, b.map(|b| local_value(b).0))
            })
            .collect();
    }
    let tp = TensorParallel::new(&split.group).with_sequence_parallel(split.sequence_parallel);
    let x = tp.enter(x);
    layers
        .iter()
        .map(|(w, b)| {
            let bias = b.map(|b| local_value(b).0);
            local_product(x.clone(), local_value(w).0, w.id, bias)
        })
        .collect()
}

/// The vocabulary rows and `tp` group of an output head's weight `[d, vocab]` split
/// column-wise (a vocabulary-parallel head), for its loss; `None` when it is whole.
pub(crate) fn head_split(weight: &Param<Tensor<2>>) -> Option<(VocabShard, Group)> {
    let s = tp_split(weight)?;
    assert_eq!(
        s.style,
        TpStyle::Colwise,
        "a row-wise layer's output is whole"
    );
    Some((
        VocabShard::new(s.rows, s.group.rank(), s.group.size()),
        s.group.clone(),
    ))
}
