//! Pipeline parallelism on *your own* sequential Burn model: write its forward in three parts
//! (`PipelineModel`: what comes before the layers, one layer, the loss after them), name its
//! layers in a plan's pipeline rule with a schedule, and each rank runs its stage's forwards
//! and backwards in the schedule's order.
//!
//! A stack of 8 layers is trained on one rank with a plain Burn loop over the whole batch, then
//! as 4 pipeline stages of 2 layers with 1F1B over 8 micro-batches (`pp=4`). The schedule is
//! printed as a time x stage table with its simulated bubble, then the bubble each rank
//! measured; losses and weights match the single rank (fp32, 1e-5 relative).
//!
//! Run: `cargo run --example pipeline`

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use flashover::launch;
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::{ParallelizePlan, PipelineModel, PipelineRule, parallelize};
use flashover_parallel::params::flatten_params;
use flashover_parallel::pipeline::{Costs, Schedule, ScheduleKind, render_table, simulate};

const LAYERS: usize = 8;
const STAGES: usize = 4;
const MICRO: usize = 8;
const ROWS: usize = 4; // per micro-batch
const BATCH: usize = MICRO * ROWS;
const WIDTH: usize = 16;
const STEPS: usize = 10;

/// Your model: a plain stack of layers; nothing in it knows about pipelines.
#[derive(Module, Debug)]
struct Stack {
    layers: Vec<Linear>,
}

impl Stack {
    /// Layers `range` of the whole model, initialised by their global index.
    fn new(range: std::ops::Range<usize>, device: &Device) -> Self {
        let layer = |i: usize| {
            let w: Vec<f32> = (0..WIDTH * WIDTH)
                .map(|k| {
                    (k % (WIDTH + 1) == 0) as u8 as f32 + (k as f32 * 0.37 + i as f32).sin() * 0.2
                })
                .collect();
            Linear {
                weight: Param::from_data(TensorData::new(w, [WIDTH, WIDTH]), device),
                bias: None,
            }
        };
        Stack {
            layers: range.map(layer).collect(),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.layers.iter().fold(x, |x, l| l.forward(x).tanh())
    }
}

/// + The forward in the parts a pipeline runs: the input as it is, one layer, the loss.
impl PipelineModel for Stack {
    type Activation = Tensor<2>;
    type Batch = Tensor<2>;

    fn embed(&self, x: &Tensor<2>) -> Tensor<2> {
        x.clone()
    }

    fn layer(&self, index: usize, x: Tensor<2>) -> Tensor<2> {
        self.layers[index].forward(x).tanh()
    }

    fn head_loss(&self, y: Tensor<2>, _x: &Tensor<2>) -> Tensor<1> {
        loss(y)
    }
}

/// Samples `range` of the data set (numbered over the whole run), `[range.len(), WIDTH]`.
fn samples(range: std::ops::Range<usize>, device: &Device) -> Tensor<2> {
    let v: Vec<f32> = (range.start * WIDTH..range.end * WIDTH)
        .map(|i| (i as f32 * 0.13).cos())
        .collect();
    Tensor::from_data(TensorData::new(v, [range.len(), WIDTH]), device)
}

fn loss(y: Tensor<2>) -> Tensor<1> {
    (y - 0.5).powi_scalar(2).mean()
}

/// One rank, the whole batch (all micro-batches at once).
fn train_single() -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let mut model = Stack::new(0..LAYERS, &device);
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
        let x = samples(step * BATCH..(step + 1) * BATCH, &device);
        let l = loss(model.forward(x));
        losses.push(l.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(l.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    (losses, flatten_params(&model))
}

/// `pp=4`: the lines marked `+` are what changed.
/// The loop with the layers cut into stages: the lines marked `+` changed. Returns the losses,
/// the final weights, and each rank's measured bubble in the last step.
fn train_pipeline() -> (Vec<f32>, Vec<f32>, Vec<f64>) {
    let results = launch(format!("pp={STAGES}").as_str(), |ctx| {
        let device = Device::flex().autodiff();
        // + `layers` cut into STAGES stages, run 1F1B over MICRO micro-batches
        let rule = PipelineRule::new("layers", ScheduleKind::OneFOneB, MICRO);
        let plan = ParallelizePlan::new().pipeline(rule);
        let (mut model, par) = parallelize(Stack::new(0..LAYERS, &device), &plan, &ctx)?; // +
        let mut optim = AdamWConfig::new().init();
        let (mut losses, mut bubble) = (vec![], 0.0);
        for step in 0..STEPS {
            let micro_batch = |range| samples(range, &device);
            let run = par
                .pipeline()?
                .step(&model, BATCH, step, &micro_batch, None, &ctx)?; // +
            losses.push(run.scalars.read().loss);
            let busy = run.report.forward + run.report.backward;
            bubble = 1.0 - busy.as_secs_f64() / run.report.wall.as_secs_f64();
            // Each rank steps its stage's layers (the others are placeholders without gradients).
            model = optim.step(1e-2, model, run.grads);
        }
        let weights = flatten_params(&par.sharded().whole(model)?); // + every stage's layers
        Ok::<_, ParallelError>((losses, weights, bubble))
    })
    .expect("pipeline training");
    let bubbles = results.iter().map(|r| r.2).collect();
    let (losses, weights, _) = results.into_iter().next().unwrap();
    (losses, weights, bubbles)
}

fn main() {
    let schedule = Schedule::build(ScheduleKind::OneFOneB, STAGES, MICRO, 1).expect("a schedule");
    let timeline = simulate(&schedule, &Costs::default()).expect("a valid schedule");
    println!(
        "1F1B, {STAGES} stages, {MICRO} micro-batches (F forward, B backward; one row per time unit):"
    );
    print!("{}", render_table(&timeline, 1.0));
    let simulated: Vec<String> = timeline
        .bubbles()
        .iter()
        .map(|b| format!("{:.0}%", b * 100.0))
        .collect();
    println!(
        "simulated idle per stage: {} (formula (p-1)/(m+p-1) = {:.0}%)",
        simulated.join(" "),
        100.0 * (STAGES - 1) as f64 / (MICRO + STAGES - 1) as f64
    );
    let (single, single_weights) = train_single();
    let (pipelined, weights, bubbles) = train_pipeline();
    let measured: Vec<String> = bubbles
        .iter()
        .map(|b| format!("{:.0}%", b * 100.0))
        .collect();
    println!(
        "measured idle per stage in the last step: {} (ranks are threads on this machine's cores)",
        measured.join(" ")
    );
    println!("step  loss(1 rank)  loss(pp={STAGES})");
    for (i, (a, b)) in single.iter().zip(&pipelined).enumerate() {
        println!("{i:>4}  {a:>12.6}  {b:>11.6}");
    }
    let worst = flashover::check::stepwise_relative_difference(&single, &pipelined);
    let weights = flashover::check::relative_difference(&single_weights, &weights);
    println!("max relative difference: losses {worst:.2e}, weights {weights:.2e}");
    assert!(
        worst < 1e-5 && weights < 1e-5,
        "the pipeline must train as one rank"
    );
    assert!(single[STEPS - 1] < single[0], "the model must learn");
    println!("match: {STAGES} pipeline stages train the same model as one rank");
}
