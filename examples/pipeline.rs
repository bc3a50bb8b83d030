//! Pipeline parallelism on *your own* sequential Burn model: cut its layers into stages, pick
//! a schedule, and each rank runs its stage's forwards and backwards in the schedule's order.
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
use flashover::{Axis, CommunicatorExt, ReduceOp, launch};
use flashover_parallel::pipeline::{
    Costs, PipelineExecutor, Schedule, ScheduleKind, StageOutput, render_table, simulate,
};

const LAYERS: usize = 8;
const STAGES: usize = 4;
const MICRO: usize = 8;
const ROWS: usize = 4; // per micro-batch
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

fn inputs(step: usize, micro: usize, device: &Device) -> Tensor<2> {
    let first = (step * MICRO + micro) * ROWS * WIDTH;
    let v: Vec<f32> = (first..first + ROWS * WIDTH)
        .map(|i| (i as f32 * 0.13).cos())
        .collect();
    Tensor::from_data(TensorData::new(v, [ROWS, WIDTH]), device)
}

fn loss(y: Tensor<2>) -> Tensor<1> {
    (y - 0.5).powi_scalar(2).mean()
}

/// One rank, the whole batch (all micro-batches at once).
fn train_single() -> Vec<f32> {
    let device = Device::flex().autodiff();
    let mut model = Stack::new(0..LAYERS, &device);
    let mut optim = AdamWConfig::new().init();
    let mut losses = vec![];
    for step in 0..STEPS {
        let x = Tensor::cat((0..MICRO).map(|m| inputs(step, m, &device)).collect(), 0);
        let l = loss(model.forward(x));
        losses.push(l.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(l.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    losses
}

/// `pp=4`: the lines marked `+` are what changed.
fn train_pipeline(schedule: &Schedule) -> (Vec<f32>, Vec<f64>) {
    let results = launch(format!("pp={STAGES}").as_str(), |ctx| {
        let device = Device::flex().autodiff();
        let pp = ctx.group(Axis::Pp); // +
        let per = LAYERS / STAGES;
        let stage = pp.rank() * per..(pp.rank() + 1) * per; // + this rank's layers
        let mut chunks = vec![Stack::new(stage, &device)];
        let executor = PipelineExecutor::new(schedule, pp)?; // +
        let mut optim = AdamWConfig::new().init();
        let (mut losses, mut bubble) = (vec![], 0.0);
        for step in 0..STEPS {
            let last = pp.rank() == STAGES - 1;
            // + the schedule calls this per micro-batch: the first stage reads the data,
            // + the last computes the loss.
            let forward = |_chunk: usize, model: &Stack, input: Option<Tensor<2>>, micro| {
                let x = input.unwrap_or_else(|| inputs(step, micro, &device));
                let y = model.forward(x);
                if last {
                    StageOutput::Loss(loss(y))
                } else {
                    StageOutput::Activation(y)
                }
            };
            let (mut grads, report) = executor.step(&chunks, [ROWS, WIDTH], &device, forward)?;
            let mut l = [report.loss_sum / MICRO as f64];
            pp.all_reduce(&mut l, ReduceOp::Sum)?; // + the loss lives on the last stage
            losses.push(l[0] as f32);
            let busy = report.forward + report.backward;
            bubble = 1.0 - busy.as_secs_f64() / report.wall.as_secs_f64();
            let model = chunks.remove(0);
            chunks.push(optim.step(1e-2, model, grads.remove(0)));
        }
        Ok::<_, flashover_parallel::ParallelError>((losses, bubble))
    })
    .expect("pipeline training");
    let losses = results[0].0.clone();
    (losses, results.iter().map(|r| r.1).collect())
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
    let single = train_single();
    let (pipelined, bubbles) = train_pipeline(&schedule);
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
    println!("max relative loss difference {worst:.2e}");
    assert!(worst < 1e-5, "the pipeline must train as one rank");
    assert!(single[STEPS - 1] < single[0], "the model must learn");
    println!("match: {STAGES} pipeline stages train the same model as one rank");
}
