//! An encoder-decoder transformer written in plain Burn (one token table shared by the source,
//! the target and the output head; two encoder blocks with bidirectional self-attention and a
//! final norm; two decoder blocks with causal self-attention and cross-attention over the
//! encoder's output), pipelined by a plan.
//!
//! For a pipeline its forward is written in three parts (`PipelineModel`), and what runs
//! between them is two tensors: `(memory, target)`. The encoder's blocks change the memory,
//! the decoder's read it and change the target stream. Both cross every stage boundary with
//! their own gradients, so the memory's gradient comes back from every stage that reads it.
//! The plan names the two block lists in order (`encoder.blocks` then `decoder.blocks`,
//! layers 0-1 and 2-3) and attaches the encoder's final norm to its last block: no change to
//! the model's structure or parameter paths.
//!
//! It trains on one rank with a plain Burn loop, then at `pp=2` cut between encoder and
//! decoder, at `pp=2` with the decoder itself split (stage 0: the encoder and the first
//! decoder block), and at `fsdp=2,tp=2,pp=2` with sequence parallelism (every attention and
//! MLP split over tp, the shared table split by vocabulary, norms and position tables on 1/tp
//! of the positions). Losses and every final weight match the single rank within 1e-5
//! (fp32).
//!
//! Run: `cargo run --example parallelize_seq2seq`

use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::activation::{gelu, softmax};
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover::models::init;
use flashover::nn::{Embedding, Linear}; // tp: layers that follow a split
use flashover::parallel::params::{ParamLayout, flatten_params};
use flashover::prelude::*;

const VOCAB: usize = 24;
const WIDTH: usize = 16;
const HEAD_DIM: usize = 4;
const HEADS: usize = WIDTH / HEAD_DIM;
const SOURCE: usize = 8;
const TARGET: usize = 6;
const BLOCKS: usize = 2;
const GLOBAL_BATCH: usize = 8;
const STEPS: usize = 8;
const LR: f64 = 3e-3;
const MICRO_BATCHES: usize = 4;

// ---- The user's model: plain Burn, its linear layers and embeddings flashover::nn's. ----

#[derive(Module, Debug)]
struct Seq2Seq {
    embed: Embedding, // source, target and (tied) output head
    source_positions: Embedding,
    target_positions: Embedding,
    encoder: Encoder,
    decoder: Decoder,
}

#[derive(Module, Debug)]
struct Encoder {
    blocks: Vec<EncoderBlock>,
    norm: LayerNorm,
}

#[derive(Module, Debug)]
struct Decoder {
    blocks: Vec<DecoderBlock>,
    norm: LayerNorm,
}

#[derive(Module, Debug)]
struct EncoderBlock {
    ln_1: LayerNorm,
    attn: Attention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

#[derive(Module, Debug)]
struct DecoderBlock {
    ln_1: LayerNorm,
    attn: Attention,
    ln_2: LayerNorm,
    cross: Attention,
    ln_3: LayerNorm,
    mlp: Mlp,
}

#[derive(Module, Debug)]
struct Attention {
    query: Linear,
    key: Linear,
    value: Linear,
    proj: Linear,
}

#[derive(Module, Debug)]
struct Mlp {
    fc: Linear,
    out: Linear,
}

/// A biased linear layer, weights normal(0, 0.02) from (seed, name), bias zero.
fn linear(name: &str, d_in: usize, d_out: usize, device: &Device) -> Linear {
    let mut layer = init::linear(2, name, d_in, d_out, 0.02, device);
    layer.bias = Some(burn::module::Param::from_tensor(Tensor::zeros(
        [d_out],
        device,
    )));
    layer.into()
}

impl Attention {
    fn new(name: &str, device: &Device) -> Self {
        let layer = |part: &str| linear(&format!("{name}.{part}"), WIDTH, WIDTH, device);
        Attention {
            query: layer("query"),
            key: layer("key"),
            value: layer("value"),
            proj: layer("proj"),
        }
    }

    /// Attention of `queries` over `context` (itself for self-attention), causal or not.
    fn forward(&self, queries: Tensor<3>, context: Tensor<3>, causal: bool) -> Tensor<3> {
        let q = self.query.forward(queries);
        // tp: key and value enter the tensor-parallel region once.
        let [k, v] = Linear::forward_shared([&self.key, &self.value], context);
        // sp: lengths from the projections, which hold every position.
        let ([batch, rows, _], [_, cols, _]) = (q.dims(), k.dims());
        let heads = self.query.d_output() / HEAD_DIM; // tp: HEADS / tp on a rank
        let split = |t: Tensor<3>, n| t.reshape([batch, n, heads, HEAD_DIM]).swap_dims(1, 2);
        let (q, k, v) = (split(q, rows), split(k, cols), split(v, cols));
        let mut scores = q
            .matmul(k.swap_dims(2, 3))
            .div_scalar((HEAD_DIM as f32).sqrt());
        if causal {
            let mask: Vec<f32> = (0..rows * cols)
                .map(|i| if i % cols > i / cols { -1e9 } else { 0.0 })
                .collect();
            let mask =
                Tensor::<2>::from_data(TensorData::new(mask, [rows, cols]), &scores.device());
            scores = scores + mask.unsqueeze();
        }
        let y = softmax(scores, 3).matmul(v).swap_dims(1, 2);
        self.proj
            .forward(y.reshape([batch, rows, heads * HEAD_DIM]))
    }
}

impl Mlp {
    fn new(name: &str, device: &Device) -> Self {
        Mlp {
            fc: linear(&format!("{name}.fc"), WIDTH, 4 * WIDTH, device),
            out: linear(&format!("{name}.out"), 4 * WIDTH, WIDTH, device),
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.out.forward(gelu(self.fc.forward(x)))
    }
}

impl EncoderBlock {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let h = self.ln_1.forward(x.clone());
        let x = x + self.attn.forward(h.clone(), h, false);
        x.clone() + self.mlp.forward(self.ln_2.forward(x))
    }
}

impl DecoderBlock {
    fn forward(&self, x: Tensor<3>, memory: Tensor<3>) -> Tensor<3> {
        let h = self.ln_1.forward(x.clone());
        let x = x + self.attn.forward(h.clone(), h, true);
        let x = x.clone() + self.cross.forward(self.ln_2.forward(x), memory, false);
        x.clone() + self.mlp.forward(self.ln_3.forward(x))
    }
}

impl Seq2Seq {
    /// Weights from a seed on the host (every rank and the reference start equal).
    fn new(device: &Device) -> Self {
        let norm = || LayerNormConfig::new(WIDTH).init(device);
        let table = |name, rows| init::embedding(2, name, rows, WIDTH, 0.02, device).into();
        Seq2Seq {
            embed: table("embed", VOCAB),
            source_positions: table("source_positions", SOURCE),
            target_positions: table("target_positions", TARGET),
            encoder: Encoder {
                blocks: (0..BLOCKS)
                    .map(|i| EncoderBlock {
                        ln_1: norm(),
                        attn: Attention::new(&format!("e{i}.attn"), device),
                        ln_2: norm(),
                        mlp: Mlp::new(&format!("e{i}.mlp"), device),
                    })
                    .collect(),
                norm: norm(),
            },
            decoder: Decoder {
                blocks: (0..BLOCKS)
                    .map(|i| DecoderBlock {
                        ln_1: norm(),
                        attn: Attention::new(&format!("d{i}.attn"), device),
                        ln_2: norm(),
                        cross: Attention::new(&format!("d{i}.cross"), device),
                        ln_3: norm(),
                        mlp: Mlp::new(&format!("d{i}.mlp"), device),
                    })
                    .collect(),
                norm: norm(),
            },
        }
    }

    /// The mean loss of a batch: the three parts a pipeline runs, in a row.
    fn loss(&self, batch: &Batch) -> Tensor<1> {
        let x = (0..2 * BLOCKS).fold(self.embed(batch), |x, i| self.layer(i, x));
        self.head_loss(x, batch)
    }
}

/// Source tokens `[batch, SOURCE]`, target inputs and target outputs `[batch, TARGET]`.
type Batch = (Tensor<2, Int>, Tensor<2, Int>, Tensor<2, Int>);

/// pp: the forward in three parts, two tensors between them.
impl PipelineModel for Seq2Seq {
    type Batch = Batch;
    /// The encoder's output (its memory) and the decoder's stream.
    type Activation = (Tensor<3>, Tensor<3>);

    /// Both streams' token and position embeddings, `[batch, len, WIDTH]`.
    fn embed(&self, (source, target, _): &Batch) -> (Tensor<3>, Tensor<3>) {
        let place = |tokens: &Tensor<2, Int>, positions: &Embedding| {
            // sp: the positions the token lookups hold (this rank's 1/tp of them, or all).
            let at = self.embed.local_positions(tokens.dims()[1]);
            let at = Tensor::arange(at.start as i64..at.end as i64, &tokens.device());
            self.embed.forward(tokens.clone()) + positions.forward(at.unsqueeze())
        };
        let memory = place(source, &self.source_positions);
        (memory, place(target, &self.target_positions))
    }

    /// Layer `index` of `encoder.blocks` then `decoder.blocks`.
    fn layer(
        &self,
        index: usize,
        (memory, target): (Tensor<3>, Tensor<3>),
    ) -> (Tensor<3>, Tensor<3>) {
        match self.encoder.blocks.get(index) {
            Some(block) => {
                let mut memory = block.forward(memory);
                if index + 1 == BLOCKS {
                    memory = self.encoder.norm.forward(memory); // attached to the last block
                }
                (memory, target)
            }
            None => {
                let target = self.decoder.blocks[index - BLOCKS].forward(target, memory.clone());
                (memory, target)
            }
        }
    }

    /// The decoder's norm, the head (the shared table transposed), the loss.
    fn head_loss(&self, (_, target): (Tensor<3>, Tensor<3>), (_, _, next): &Batch) -> Tensor<1> {
        // tp: the table computes its rows' logits and their loss.
        let logits = self.embed.logits(self.decoder.norm.forward(target));
        self.embed.cross_entropy(logits, next.clone())
    }
}

/// Samples `range` of an endless task: a source sequence and its target, a function of the
/// source read backwards.
fn batch(range: std::ops::Range<usize>, device: &Device) -> Batch {
    let n = range.len();
    let source = |s: usize, t: usize| (s * 7 + t * t + 3 * t + 1) % VOCAB;
    let target = |s: usize, t: usize| (source(s, SOURCE - 1 - t) * 3 + t) % VOCAB;
    let tensor = |len: usize, f: &dyn Fn(usize, usize) -> usize| {
        let v: Vec<i64> = (range.clone())
            .flat_map(|s| (0..len).map(move |t| (s, t)))
            .map(|(s, t)| f(s, t) as i64)
            .collect();
        Tensor::from_data(TensorData::new(v, [n, len]), device)
    };
    // The decoder reads the targets shifted by one, after a start token 0.
    let input = |s: usize, t: usize| if t == 0 { 0 } else { target(s, t - 1) };
    (
        tensor(SOURCE, &source),
        tensor(TARGET, &input),
        tensor(TARGET, &target),
    )
}

// ---- Training: the plain single-rank loop, and the same loop under a plan. ----

/// Losses and final weights.
type Run = (Vec<f32>, Vec<f32>);

/// The plain Burn loop on one device.
fn single_rank() -> Run {
    let device = Device::flex().autodiff();
    let mut model = Seq2Seq::new(&device);
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
        let samples = batch(step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH, &device);
        let loss = model.loss(&samples);
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    (losses, flatten_params(&model))
}

/// The single-rank loop under a pipelined `plan` on `mesh`: rank 0's run and every rank's
/// stored elements.
fn pipelined(mesh: &str, plan: &ParallelizePlan) -> (Run, Vec<usize>) {
    let out = Launch::new(mesh)
        .expect("mesh")
        .run(|ctx| {
            let device = ctx.device().clone().autodiff();
            // The lines a plan adds to the loop are marked `+`.
            let (mut model, par) = parallelize(Seq2Seq::new(&device), plan, &ctx)?; // +
            let stored = ParamLayout::of(&model).numel;
            let mut optim = AdamWConfig::new().init();
            let mut losses = vec![];
            let micro = |samples| batch(samples, &device); // +: every stage builds micro-batches
            for step in 0..STEPS {
                let out = par
                    .pipeline()?
                    .step(&model, GLOBAL_BATCH, step, &micro, None, &ctx)?; // +
                losses.push(out.scalars.read().loss);
                model = optim.step(LR, model, out.grads);
            }
            let weights = flatten_params(&par.sharded().whole(model)?); // + (gathers the stages)
            Ok::<_, ParallelError>(((losses, weights), stored))
        })
        .expect("parallel training");
    let stored = out.iter().map(|(_, s)| *s).collect();
    (out.into_iter().next().unwrap().0, stored)
}

fn main() {
    let reference = single_rank();
    let whole = reference.1.len();
    println!(
        "encoder-decoder model, {whole} parameters, {HEADS} heads; one rank's loss {:.4} -> {:.4}",
        reference.0[0],
        reference.0[STEPS - 1]
    );
    // The two block lists in the order the forward runs them, the encoder's final norm with
    // its last block; the shared table on the first stage (embeddings) and the last (head).
    let cut = |layers_per_stage: &[usize]| {
        PipelineRule::new("encoder.blocks", ScheduleKind::OneFOneB, MICRO_BATCHES)
            .then_layers("decoder.blocks")
            .attach("encoder.norm", "encoder.blocks.1")
            .first(&["embed", "source_positions", "target_positions"])
            .last(&["decoder.norm", "embed"])
            .layers_per_stage(layers_per_stage)
    };
    // Megatron's split of every attention (self and cross) and MLP, the shared table by
    // vocabulary; sequence parallel: norms and position tables on 1/tp of the positions.
    let heads = [
        "*.blocks.*.attn.query",
        "*.blocks.*.attn.key",
        "*.blocks.*.attn.value",
        "decoder.blocks.*.cross.query",
        "decoder.blocks.*.cross.key",
        "decoder.blocks.*.cross.value",
    ];
    let proj = ["*.blocks.*.attn.proj", "decoder.blocks.*.cross.proj"];
    let tensor_parallel = ParallelizePlan::new()
        .tensor_parallel(TensorParallelRule::colwise(&heads).in_units(HEAD_DIM))
        .tensor_parallel(TensorParallelRule::rowwise(&proj).in_units(HEAD_DIM))
        .tensor_parallel(TensorParallelRule::colwise(&["*.blocks.*.mlp.fc"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["*.blocks.*.mlp.out"]))
        .tensor_parallel(TensorParallelRule::vocab(&["embed"]));
    let norms = [
        "*.blocks.*.ln_1",
        "*.blocks.*.ln_2",
        "decoder.blocks.*.ln_3",
        "*.norm",
    ];
    let sequence = ["source_positions", "target_positions"]
        .into_iter()
        .chain(norms)
        .fold(tensor_parallel, |plan, path| plan.sequence_parallel(path));
    let layouts = [
        (
            "pp=2",
            "encoder | decoder",
            ParallelizePlan::new().pipeline(cut(&[2, 2])),
        ),
        (
            "pp=2",
            "encoder and decoder block 0 | decoder block 1",
            ParallelizePlan::new().pipeline(cut(&[3, 1])),
        ),
        (
            "fsdp=2,tp=2,pp=2",
            "encoder | decoder, tp and sequence parallel, fully sharded",
            sequence.fully_shard("").pipeline(cut(&[2, 2])),
        ),
    ];
    for (mesh, what, plan) in &layouts {
        let (run, stored) = pipelined(mesh, plan);
        let loss = flashover::check::stepwise_relative_difference(&reference.0, &run.0);
        let weights = flashover::check::relative_difference(&reference.1, &run.1);
        println!(
            "{mesh:<17} {what}: stores {stored:?} of {whole} parameters per rank; max relative difference: losses {loss:.2e}, weights {weights:.2e}"
        );
        assert!(
            loss < 1e-5 && weights < 1e-5,
            "{mesh} ({what}) must match one rank"
        );
        assert!(
            stored.iter().all(|s| *s < whole),
            "{mesh}: every rank stores a share"
        );
    }
    println!("match: every cut trains the same model as one rank");
}
