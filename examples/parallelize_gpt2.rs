//! A GPT-2-style model written in plain Burn (learned absolute positions, LayerNorm with bias,
//! GELU MLP, biased linear layers, the embedding tied to the output head), parallelized by a
//! plan. Three things in it are for tensor parallelism, all also right on one device: its
//! linear layers and embeddings are `flashover::nn`'s (Burn's `Linear` and `Embedding`, whose
//! forward follows a split), attention counts its heads from the query projection's width (a
//! split one holds `heads / tp`), and the tied head and its loss come from the token
//! embedding (`logits`, `cross_entropy`: a table split by vocabulary computes its rows'
//! logits and reduces the loss over `tp` without gathering them). Query, key and value are separate layers: a fused `[d, 3d]` projection split
//! by columns would hand rank 0 all of the queries and none of the values.
//!
//! For pipelines its forward is written in three parts (`PipelineModel`: embed, one block,
//! head and loss), which its single-device loss composes.
//!
//! It trains on one rank with a plain Burn loop, then fully sharded at `fsdp=2` (the whole
//! model), `dp=2,fsdp=2` (HSDP: two replicas of a two-way sharded model), `fsdp=2` with only
//! the blocks sharded, `tp=2` (Megatron's column/row split of attention and MLP, and the
//! vocabulary-parallel embedding, head and loss),
//! `fsdp=2,tp=2` (both), `dp=2,pp=2` (two stages, 1F1B over 4 micro-batches, the tied
//! embedding on both ends), `fsdp=2,tp=2,pp=2` (all three), and `tp=2` and
//! `fsdp=2,tp=2,pp=2` with sequence parallelism (norms and the position embedding on 1/tp of
//! the positions; two lines of the model read positions and the sequence length where they
//! are, marked `sp`), and `fsdp=2,cp=2`, `fsdp=2,tp=2,cp=2` and `dp=2,pp=2,cp=2` with every
//! sequence split over `cp` (context parallelism: the model's attention core is
//! `flashover::nn::CausalAttention`, and its batch carries the positions it holds, marked
//! `cp`). Losses and every final weight match the single rank within 1e-5 (fp32), and each
//! rank stores its share of the parameters. `fsdp=2,tp=2` runs once more with every block
//! recomputed in backward (the plan's `activation_checkpointing`, through `pipeline()?.step` on a
//! mesh without `pp`).
//!
//! Run: `cargo run --example parallelize_gpt2`

use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover::models::init;
use flashover::nn::{CausalAttention, Embedding, Linear}; // tp, cp: layers that follow a split
use flashover::parallel::clip_global_norm;
use flashover::parallel::params::{
    ParamLayout, accumulate_grads, flatten_params, grads_from_flat, zero_grads,
};
use flashover::prelude::*;

const VOCAB: usize = 32;
const WIDTH: usize = 16;
const HEADS: usize = 4;
const HEAD_DIM: usize = WIDTH / HEADS;
const LAYERS: usize = 2;
const SEQ: usize = 8;
const GLOBAL_BATCH: usize = 8;
const STEPS: usize = 12;
const LR: f64 = 3e-3;
const MAX_NORM: f32 = 1.0;
const MICRO_BATCHES: usize = 4;

// ---- The user's model: plain Burn, its linear layers and embeddings flashover::nn's. ----

#[derive(Module, Debug)]
struct Block {
    ln_1: LayerNorm,
    query: Linear,
    key: Linear,
    value: Linear,
    proj: Linear,
    core: CausalAttention, // cp: attention's core, which attends across the cp ranks
    ln_2: LayerNorm,
    fc: Linear,
    out: Linear,
}

#[derive(Module, Debug)]
struct Gpt2 {
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
}

/// A biased linear layer, weights normal(0, 0.02) from (seed, name), bias zero.
fn linear(name: &str, d_in: usize, d_out: usize, device: &Device) -> Linear {
    let mut layer = init::linear(1, name, d_in, d_out, 0.02, device);
    layer.bias = Some(burn::module::Param::from_tensor(Tensor::zeros(
        [d_out],
        device,
    )));
    layer.into()
}

impl Gpt2 {
    /// Weights from a seed on the host (Burn's initialisers share one generator between
    /// threads, so the reference and the ranks would not start equal).
    fn new(device: &Device) -> Self {
        let block = |i: usize| Block {
            ln_1: LayerNormConfig::new(WIDTH).init(device),
            query: linear(&format!("b{i}.query"), WIDTH, WIDTH, device),
            key: linear(&format!("b{i}.key"), WIDTH, WIDTH, device),
            value: linear(&format!("b{i}.value"), WIDTH, WIDTH, device),
            proj: linear(&format!("b{i}.proj"), WIDTH, WIDTH, device),
            core: CausalAttention::new(device),
            ln_2: LayerNormConfig::new(WIDTH).init(device),
            fc: linear(&format!("b{i}.fc"), WIDTH, 4 * WIDTH, device),
            out: linear(&format!("b{i}.out"), 4 * WIDTH, WIDTH, device),
        };
        Gpt2 {
            wte: init::embedding(1, "wte", VOCAB, WIDTH, 0.02, device).into(),
            wpe: init::embedding(1, "wpe", SEQ, WIDTH, 0.01, device).into(),
            blocks: (0..LAYERS).map(block).collect(),
            ln_f: LayerNormConfig::new(WIDTH).init(device),
        }
    }

    /// The mean next-token loss of a batch: the model's forward, written as the three parts a
    /// pipeline runs on different stages.
    fn loss(&self, batch: &Batch) -> Tensor<1> {
        let x = (0..LAYERS).fold(self.embed(batch), |x, i| self.layer(i, x));
        self.head_loss(x, batch)
    }
}

/// Tokens `[batch, seq]`, their positions in the sequence `[seq]` (cp: a rank holds some
/// positions of every sequence), and the next tokens `[batch, seq]`.
type Batch = (Tensor<2, Int>, Tensor<1, Int>, Tensor<2, Int>);

/// pp: the forward in three parts, so a pipeline stage can run its share of it.
impl PipelineModel for Gpt2 {
    type Activation = Tensor<3>;
    type Batch = Batch;

    /// Token and position embeddings, `[batch, seq, width]`.
    fn embed(&self, (tokens, positions, _): &Batch) -> Tensor<3> {
        // sp: the positions the token lookups hold (this rank's 1/tp of them, or all).
        let at = self.wte.local_positions(tokens.dims()[1]);
        let positions = positions.clone().narrow(0, at.start, at.len());
        self.wte.forward(tokens.clone()) + self.wpe.forward(positions.unsqueeze())
    }

    /// Block `index`: causal self-attention and the MLP, each with a residual.
    fn layer(&self, index: usize, x: Tensor<3>) -> Tensor<3> {
        let b = &self.blocks[index];
        let h = b.ln_1.forward(x.clone());
        // tp: the three column-wise layers enter the tensor-parallel region once.
        let [q, k, v] = Linear::forward_shared([&b.query, &b.key, &b.value], h);
        // sp: the sequence length from the projections, which hold every position.
        let [batch, seq, _] = q.dims();
        // tp: HEADS on one device, HEADS / tp on a rank of a column-wise split.
        let heads = b.query.d_output() / HEAD_DIM;
        let split = |t: Tensor<3>| t.reshape([batch, seq, heads, HEAD_DIM]).swap_dims(1, 2);
        let [q, k, v] = [q, k, v].map(split);
        // softmax(q k^T / sqrt(HEAD_DIM) + causal mask) v, over every position of the sequence.
        let attn = b.core.forward(q, k, v);
        let attn = attn.swap_dims(1, 2).reshape([batch, seq, heads * HEAD_DIM]); // tp: not WIDTH
        let x = x + b.proj.forward(attn);
        x.clone() + b.out.forward(gelu(b.fc.forward(b.ln_2.forward(x))))
    }

    /// The final norm, the head (the token embedding transposed: tied weights), the loss.
    fn head_loss(&self, x: Tensor<3>, (_, _, targets): &Batch) -> Tensor<1> {
        // tp: the table computes its (rows' of the) logits and their loss.
        let logits = self.wte.logits(self.ln_f.forward(x));
        self.wte.cross_entropy(logits, targets.clone())
    }
}

/// Sequences `range` of an endless text: inputs, their positions and next tokens.
fn batch(range: std::ops::Range<usize>, device: &Device) -> Batch {
    let n = range.len();
    let token = |s: usize, t: usize| ((s * 5 + t * t * 3 + t) % VOCAB) as i64;
    let seqs = |shift: usize| -> Vec<i64> {
        range
            .clone()
            .flat_map(|s| (0..SEQ).map(move |t| token(s, t + shift)))
            .collect()
    };
    let tensor = |v: Vec<i64>| Tensor::from_data(TensorData::new(v, [n, SEQ]), device);
    let positions = Tensor::arange(0..SEQ as i64, device);
    (tensor(seqs(0)), positions, tensor(seqs(1)))
}

// ---- Training: the plain single-rank loop, and the same loop under a plan. ----

/// Losses and final weights.
type Run = (Vec<f32>, Vec<f32>);

/// The plain Burn loop on one device (global-norm clipping written out).
fn single_rank() -> Run {
    let device = Device::flex().autodiff();
    let mut model = Gpt2::new(&device);
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
        let loss = model.loss(&batch(
            step * GLOBAL_BATCH..(step + 1) * GLOBAL_BATCH,
            &device,
        ));
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = clip(&model, grads);
        model = optim.step(LR, model, grads);
    }
    (losses, flatten_params(&model))
}

/// Global-norm clipping on one device, as `Parallelized::gradients` clips over the ranks.
fn clip(model: &Gpt2, grads: GradientsParams) -> GradientsParams {
    let device = model.devices()[0].clone().inner();
    let (flat, _) = accumulate_grads(model, &grads, zero_grads(model, &device), &[]);
    let (flat, _norm) = clip_global_norm(flat, Some(MAX_NORM)).expect("one device");
    grads_from_flat(model, &flat)
}

/// The single-rank loop under `plan` on `mesh`: rank 0's run, every rank's stored elements and
/// the layer forwards rank 0 ran again in backward.
fn parallel(mesh: &str, plan: &ParallelizePlan) -> (Run, Vec<usize>, usize) {
    let out = Launch::new(mesh)
        .expect("mesh")
        .run(|ctx| {
            let device = ctx.device().clone().autodiff();
            // The lines a plan adds to the loop are marked `+`.
            let (mut model, par) = parallelize(Gpt2::new(&device), plan, &ctx)?; // +
            let stored = ParamLayout::of(&model).numel;
            let mut optim = AdamWConfig::new().init();
            let (mut losses, mut recomputed) = (vec![], 0);
            let clip = Some(MAX_NORM);
            // cp: this rank's positions of each sequence (all of them without cp).
            let share = |(x, p, y): Batch| -> Result<Batch, ParallelError> {
                let (x, y) = (par.sequences().share(x, 1)?, par.sequences().share(y, 1)?);
                Ok((x, par.sequences().share(p, 0)?, y))
            };
            for step in 0..STEPS {
                let grads = if plan.pipeline.is_none() {
                    let samples = batch(par.data().batch_share(GLOBAL_BATCH, step)?, &device); // +
                    let samples = share(samples)?; // cp
                    // fsdp: each block's shards gathered in one collective, the next prefetched
                    let loss = par.forward(&model, |m| m.loss(&samples))?; // + (optional)
                    losses.push(par.data().mean_loss(loss.clone().into_scalar::<f32>())?); // +
                    par.gradients(&model, loss.backward(), clip, &ctx)?.0 // +
                } else {
                    // pp: the schedule runs this rank's stages over the micro-batches.
                    let micro = |samples| share(batch(samples, &device)).expect("SEQ splits"); // pp
                    let out =
                        par.pipeline()?
                            .step(&model, GLOBAL_BATCH, step, &micro, clip, &ctx)?; // pp
                    losses.push(out.scalars.read().loss); // pp
                    recomputed += out.recomputed;
                    out.grads // pp
                };
                model = optim.step(LR, model, grads);
            }
            let weights = flatten_params(&par.sharded().whole(model)?); // + (gathers the shards)
            Ok::<_, ParallelError>(((losses, weights), stored, recomputed))
        })
        .expect("parallel training");
    let stored = out.iter().map(|(_, s, _)| *s).collect();
    let (run, _, recomputed) = out.into_iter().next().unwrap();
    (run, stored, recomputed)
}

fn main() {
    let reference = single_rank();
    let whole = reference.1.len();
    println!(
        "GPT-2-style model, {whole} parameters; one rank's loss {:.4} -> {:.4}",
        reference.0[0],
        reference.0[STEPS - 1]
    );
    // Megatron's split: attention heads and the MLP's hidden features by columns, the
    // projections back to the residual by rows; everything else whole on every tp rank.
    let heads = TensorParallelRule::colwise(&["blocks.*.query", "blocks.*.key", "blocks.*.value"]);
    let tp_plan = ParallelizePlan::new()
        .tensor_parallel(heads.in_units(HEAD_DIM))
        .tensor_parallel(TensorParallelRule::rowwise(&["blocks.*.proj"]).in_units(HEAD_DIM))
        .tensor_parallel(TensorParallelRule::colwise(&["blocks.*.fc"]))
        .tensor_parallel(TensorParallelRule::rowwise(&["blocks.*.out"]))
        .tensor_parallel(TensorParallelRule::vocab(&["wte"]));
    // Sequence parallel: what runs whole between the split layers runs on 1/tp of the
    // positions (norms, and the position embedding added to the token lookups).
    let sequence = ["wpe", "blocks.*.ln_1", "blocks.*.ln_2", "ln_f"]
        .into_iter()
        .fold(tp_plan.clone(), |plan, path| plan.sequence_parallel(path));
    // One block per stage of two; the token embedding on the first and (as the head) the
    // last stage, which keep their copies in step.
    let pipeline = PipelineRule::new("blocks", ScheduleKind::OneFOneB, MICRO_BATCHES)
        .first(&["wte", "wpe"])
        .last(&["ln_f", "wte"]);
    // Context parallel: each rank holds a quarter of every sequence's positions from the start
    // and one from the end; each block's attention core reaches the others' keys and values.
    let context = ContextParallelRule::ring(&["blocks.*.core"]);
    let layouts = [
        ("fsdp=2", ParallelizePlan::new().fully_shard("")),
        ("dp=2,fsdp=2", ParallelizePlan::new().fully_shard("")),
        ("fsdp=2", ParallelizePlan::new().fully_shard("blocks")),
        ("tp=2", tp_plan.clone()),
        ("fsdp=2,tp=2", tp_plan.clone().fully_shard("")),
        (
            "dp=2,pp=2",
            ParallelizePlan::new().pipeline(pipeline.clone()),
        ),
        (
            "fsdp=2,tp=2,pp=2",
            tp_plan.clone().fully_shard("").pipeline(pipeline.clone()),
        ),
        (
            "fsdp=2,cp=2",
            ParallelizePlan::new()
                .fully_shard("")
                .context_parallel(context.clone()),
        ),
        (
            "fsdp=2,tp=2,cp=2",
            tp_plan
                .clone()
                .fully_shard("")
                .context_parallel(context.clone()),
        ),
        (
            "dp=2,pp=2,cp=2",
            ParallelizePlan::new()
                .pipeline(pipeline.clone())
                .context_parallel(context),
        ),
        (
            "fsdp=2,tp=2",
            tp_plan
                .clone()
                .fully_shard("")
                .pipeline(pipeline.clone())
                .activation_checkpointing(CheckpointPolicy::Full),
        ),
        ("tp=2", sequence.clone()),
        (
            "fsdp=2,tp=2,pp=2",
            sequence.fully_shard("").pipeline(pipeline),
        ),
    ];
    for (mesh, plan) in &layouts {
        let (run, stored, recomputed) = parallel(mesh, plan);
        let loss = flashover::check::stepwise_relative_difference(&reference.0, &run.0);
        let weights = flashover::check::relative_difference(&reference.1, &run.1);
        let paths: Vec<&str> = plan.fully_shard.iter().map(|p| p.as_str()).collect();
        let mut split = String::new();
        if !plan.tensor_parallel.is_empty() {
            split += ", attention, MLP and vocabulary split over tp";
        }
        if !plan.sequence_parallel.is_empty() {
            split += ", sequence parallel";
        }
        if plan.activation_checkpointing != CheckpointPolicy::None {
            let policy = &plan.activation_checkpointing;
            split += &format!(", {recomputed} block forwards recomputed ({policy})");
        }
        if let Some(c) = &plan.context_parallel {
            split += &format!(", sequences split over cp ({} attention)", c.algorithm);
        }
        if let Some(p) = &plan.pipeline {
            split += &format!(", {} over {} micro-batches", p.schedule, p.micro_batches);
        }
        println!(
            "{mesh:<16} fully_shard {paths:?}{split}: stores {stored:?} of {whole} parameters per rank; max relative difference: losses {loss:.2e}, weights {weights:.2e}"
        );
        assert!(loss < 1e-5 && weights < 1e-5, "{mesh} must match one rank");
        let recomputes = plan.activation_checkpointing.recomputes_block(0);
        assert_eq!(
            recomputes,
            recomputed > 0,
            "{mesh}: recomputed {recomputed} blocks"
        );
        assert!(
            stored.iter().all(|s| *s < whole),
            "{mesh}: every rank stores a share"
        );
    }
    println!("match: every plan trains the same model as one rank");
}
