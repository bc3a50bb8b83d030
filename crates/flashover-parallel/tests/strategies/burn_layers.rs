//! A model of one's own built from Burn's standard layers (Burn's `Embedding`,
//! `RotaryEncoding` and `Linear` head as they are; `RmsNorm`, `SwiGlu`, `Linear` and `Dropout`
//! from `flashover_parallel::nn`, one import each): a Llama-style block (rotary causal
//! attention, SwiGLU feed-forward, dropout 0.1 on both residual branches) trains under `tp`,
//! `fsdp` x `tp` and `dp` as its plain single-rank Burn loop does (losses, clipped gradient
//! norms, every weight within 1e-5).

use crate::common::{assert_run_matches, plain_step};
use crate::plan_loops::{GLOBAL_BATCH, plan_loop, reference_loop};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Embedding, EmbeddingConfig, RotaryEncoding, RotaryEncodingConfig};
use burn::tensor::activation::softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover_parallel::nn::{
    Dropout, DropoutConfig, Linear, LinearConfig, RmsNorm, RmsNormConfig, SwiGlu, SwiGluConfig,
    set_dropout_draws,
};
use flashover_parallel::parallelize::{ParallelizePlan, TensorParallelRule};
use flashover_parallel::params::{ParamLayout, load_flat};

const VOCAB: usize = 13;
const SEQ: usize = 6;
const D_MODEL: usize = 16;
const D_K: usize = 4;
const D_FF: usize = 24;
const SEED: u64 = 5;

#[derive(Module, Debug)]
struct Llama {
    embedding: Embedding,
    attention_norm: RmsNorm,
    query: Linear,
    key: Linear,
    value: Linear,
    out: Linear,
    rope: RotaryEncoding,
    ffn_norm: RmsNorm,
    swiglu: SwiGlu,
    down: Linear,
    dropout: Dropout,
    head: burn::nn::Linear,
}

impl Llama {
    /// Built from Burn's configs, then every parameter set from its index (every rank and the
    /// reference start alike).
    fn new(device: &Device) -> Self {
        let linear = |d_in, d_out| LinearConfig::new(d_in, d_out).init(device);
        let model = Llama {
            embedding: EmbeddingConfig::new(VOCAB, D_MODEL).init(device),
            attention_norm: RmsNormConfig::new(D_MODEL).init(device),
            query: linear(D_MODEL, D_MODEL),
            key: linear(D_MODEL, D_MODEL),
            value: linear(D_MODEL, D_MODEL),
            out: linear(D_MODEL, D_MODEL),
            rope: RotaryEncodingConfig::new(SEQ, D_K).init(device),
            ffn_norm: RmsNormConfig::new(D_MODEL).init(device),
            swiglu: SwiGluConfig::new(D_MODEL, D_FF).init(device),
            down: linear(D_FF, D_MODEL),
            dropout: DropoutConfig::new(0.1).init(),
            head: burn::nn::LinearConfig::new(D_MODEL, VOCAB).init(device),
        };
        let n = ParamLayout::of(&model).numel;
        let values: Vec<f32> = (0..n).map(|i| (i as f32 * 0.31).sin() * 0.3).collect();
        load_flat(model, &values)
    }

    /// The next-token loss of samples `samples` of an endless token stream.
    fn loss(&self, samples: std::ops::Range<usize>, device: &Device) -> Tensor<1> {
        let n = samples.len();
        let token = |s: usize, p: usize| ((s * 7 + p * 3 + s * p) % VOCAB) as i64;
        let stream = |offset: usize| -> Vec<i64> {
            samples
                .clone()
                .flat_map(|s| (0..SEQ).map(move |p| token(s, p + offset)))
                .collect()
        };
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(stream(0), [n, SEQ]), device);
        let targets = Tensor::<1, Int>::from_data(TensorData::new(stream(1), [n * SEQ]), device);
        let x = self.embedding.forward(tokens);
        let x = x.clone() + self.dropout.forward(self.attention(x));
        let ffn = self
            .down
            .forward(self.swiglu.forward(self.ffn_norm.forward(x.clone())));
        let x = x + self.dropout.forward(ffn);
        let logits = self.head.forward(x).reshape([n * SEQ, VOCAB]);
        CrossEntropyLossConfig::new()
            .init(device)
            .forward(logits, targets)
    }

    /// Causal self-attention with rotary positions, heads counted from the split width.
    fn attention(&self, x: Tensor<3>) -> Tensor<3> {
        let [batch, seq, _] = x.dims();
        let h = self.attention_norm.forward(x);
        let [q, k, v] = Linear::forward_shared([&self.query, &self.key, &self.value], h);
        let width = q.dims()[2];
        let heads = |t: Tensor<3>| t.reshape([batch, seq, width / D_K, D_K]).swap_dims(1, 2);
        let (q, k) = (self.rope.forward(heads(q)), self.rope.forward(heads(k)));
        let mask = burn::nn::attention::generate_autoregressive_mask(batch, seq, &q.device());
        let scores = q
            .matmul(k.transpose())
            .div_scalar((D_K as f32).sqrt())
            .mask_fill(mask.unsqueeze_dim(1), -1e9);
        let context = softmax(scores, 3)
            .matmul(heads(v))
            .swap_dims(1, 2)
            .reshape([batch, seq, width]);
        self.out.forward(context)
    }
}

/// Megatron's split of the block: attention by whole heads, the SwiGLU pair column-wise and
/// its down projection row-wise.
fn tp_plan() -> ParallelizePlan {
    let swiglu = Llama::new(&Device::flex()).swiglu;
    ParallelizePlan::new()
        .tensor_parallel(TensorParallelRule::colwise(&["query", "key", "value"]).in_units(D_K))
        .tensor_parallel(TensorParallelRule::rowwise(&["out"]))
        .tensor_parallel_rules(swiglu.tensor_parallel_rules("swiglu"))
        .tensor_parallel(TensorParallelRule::rowwise(&["down"]))
        .dropout_seed(SEED)
}

#[test]
fn a_llama_block_of_burns_layers_with_dropout_trains_as_one_rank() {
    let device = Device::flex().autodiff();
    let reference = reference_loop(Llama::new(&device), |model, samples| {
        set_dropout_draws(SEED, samples.start / GLOBAL_BATCH, samples.clone());
        model.loss(samples, &device)
    });
    for (mesh, plan) in [
        ("tp=2", tp_plan()),
        ("fsdp=2,tp=2", tp_plan().fully_shard("")),
        ("dp=2", ParallelizePlan::new().dropout_seed(SEED)),
    ] {
        let (run, _) = plan_loop(mesh, &plan, Llama::new, |model, par, step, ctx, device| {
            plain_step(model, par, step, ctx, |m, samples| m.loss(samples, device))
        });
        assert_run_matches(mesh, &run, &reference);
    }
}

/// Burn's `BatchNorm` between two of Burn's linear layers, with the drop-in's one changed
/// import: its training statistics are the whole batch's on every layout (the running ones,
/// which the weights compared include, too).
#[derive(Module, Debug)]
struct Normed {
    input: burn::nn::Linear,
    norm: flashover_parallel::nn::BatchNorm,
    output: burn::nn::Linear,
}

impl Normed {
    fn new(device: &Device) -> Self {
        let model = Normed {
            // No bias before a norm that subtracts the mean (its gradient is rounding noise,
            // which Adam would scale up differently on every layout).
            input: burn::nn::LinearConfig::new(6, 16)
                .with_bias(false)
                .init(device),
            norm: flashover_parallel::nn::BatchNormConfig::new(16).init(device),
            output: burn::nn::LinearConfig::new(16, 2).init(device),
        };
        let n = ParamLayout::of(&model).numel;
        let values: Vec<f32> = (0..n).map(|i| (i as f32 * 0.43).cos() * 0.4).collect();
        load_flat(model, &values)
    }

    /// The mean squared error of samples `samples` of an endless regression set.
    fn loss(&self, samples: std::ops::Range<usize>, device: &Device) -> Tensor<1> {
        let n = samples.len();
        let x: Vec<f32> = samples
            .clone()
            .flat_map(|s| (0..6).map(move |j| ((s * 5 + j * 3) % 11) as f32 / 5.0 - 1.0))
            .collect();
        let y: Vec<f32> = x
            .chunks(6)
            .flat_map(|r| [r[0] - r[3], r[1] * r[2]])
            .collect();
        let x = Tensor::<2>::from_data(TensorData::new(x, [n, 6]), device);
        let y = Tensor::<2>::from_data(TensorData::new(y, [n, 2]), device);
        let hidden = self.norm.forward(self.input.forward(x));
        let out = self.output.forward(burn::tensor::activation::relu(hidden));
        (out - y).square().mean()
    }
}

#[test]
fn burns_batch_norm_normalises_by_the_whole_batch_on_every_data_layout() {
    let device = Device::flex().autodiff();
    let reference = reference_loop(Normed::new(&device), |model, samples| {
        model.loss(samples, &device)
    });
    for (mesh, plan) in [
        ("dp=2", ParallelizePlan::new()),
        ("fsdp=2", ParallelizePlan::new().fully_shard("")),
        ("dp=2,fsdp=2", ParallelizePlan::new().fully_shard("")),
    ] {
        let (run, held) = plan_loop(mesh, &plan, Normed::new, |model, par, step, ctx, device| {
            plain_step(model, par, step, ctx, |m, samples| m.loss(samples, device))
        });
        assert_run_matches(mesh, &run, &reference);
        // Under fully_shard every parameter is half its rows (rounded up), and the running
        // statistics, buffers, stay whole.
        let model = Normed::new(&Device::flex());
        let (mean, var) = (
            model.norm.running_mean.clone(),
            model.norm.running_var.clone(),
        );
        let buffers: Vec<_> = [ParamLayout::of(&mean), ParamLayout::of(&var)]
            .iter()
            .flat_map(|l| l.slots.iter().map(|slot| slot.id))
            .collect();
        let sharded = |numel: usize, rows: usize| match plan.fully_shard.is_empty() {
            true => numel,
            false => rows.div_ceil(2) * (numel / rows),
        };
        let expected: usize = (ParamLayout::of(&model).slots.iter())
            .map(|slot| match buffers.contains(&slot.id) {
                true => slot.numel,
                false => sharded(slot.numel, slot.shape[0]),
            })
            .sum();
        assert!(
            held.iter().all(|h| *h == expected),
            "{mesh}: {held:?} of {expected}"
        );
    }
}
