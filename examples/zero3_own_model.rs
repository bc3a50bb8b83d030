//! Sharded data parallel on *your own* Burn model: ZeRO-2 on the unchanged model, and ZeRO-3 /
//! HSDP with each layer wrapped as a fully sharded unit.
//!
//! The MLP of `ddp_own_model` is trained on one rank with a plain Burn loop, then with ZeRO-2
//! over four ranks (`dp=4`), then with ZeRO-3 sharded over two ranks and replicated over two
//! (`dp=2,fsdp=2`). Loss curves and final weights match the single rank (fp32, 1e-5 relative),
//! and each rank's memory for parameters, gradients and optimizer state is printed against
//! DDP's (which holds all of it on every rank).
//!
//! Run: `cargo run --example zero3_own_model`

mod common;

use burn::module::Module;
use burn::nn::Linear;
use burn::optim::GradientsParams;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use common::{GLOBAL_BATCH, Mlp, STEPS, batch, differences, mse, train_single};
use flashover::{Axis, CommunicatorExt, Launch, ReduceOp};
use flashover_parallel::params::{ParamLayout, flatten_params};
use flashover_parallel::zero::{
    FullyShardConfig, FullyShardedOptimizer, FullyShardedUnit, ShardGroup, ZeroConfig,
};
use flashover_parallel::{FlatAdamWConfig, ParallelError};

/// The MLP with each layer a fully sharded unit: the layers themselves are unchanged.
#[derive(Module, Debug)]
struct ShardedMlp {
    l1: FullyShardedUnit<Linear>,
    l2: FullyShardedUnit<Linear>,
}

impl ShardedMlp {
    fn forward(&self, x: Tensor<2>) -> Result<Tensor<2>, ParallelError> {
        self.l2.prefetch(); // gather l2 while l1 computes
        let h = self.l1.forward(x, |l1: &Linear, x| relu(l1.forward(x)))?;
        // In backward l2 runs first: when it starts, prefetch l1's parameters.
        let l1 = Some(self.l1.prefetch_handle());
        self.l2
            .forward_prefetching(h, |l2: &Linear, h| l2.forward(h), l1)
    }
}

/// Losses, the first layer's final weights, and rank 0's bytes of parameters, gradients and
/// optimizer state (as the strategy measured them).
type Run = (Vec<f32>, Vec<f32>, usize);

/// ZeRO-2 (`stage = 2`, mesh `dp=4`) or ZeRO-3/HSDP (`stage = 3`, mesh `dp=2,fsdp=2`).
fn train_sharded(stage: usize) -> Run {
    let mesh = if stage == 3 { "dp=2,fsdp=2" } else { "dp=4" };
    let results = Launch::new(mesh)
        .expect("mesh")
        .run(|ctx| {
            let device = Device::flex().autodiff();
            let batch_group = ctx.subgroup(&[Axis::Dp, Axis::Fsdp])?;
            let per_rank = GLOBAL_BATCH / batch_group.size();
            let adamw = FlatAdamWConfig::new(); // = Burn's AdamWConfig::new(), bit for bit
            let mut losses = vec![];
            let data = |step: usize| {
                let start = step * GLOBAL_BATCH + batch_group.rank() * per_rank;
                batch(start..start + per_rank, &device)
            };
            let mut record = |loss: &Tensor<1>| -> Result<(), ParallelError> {
                let mut l = [loss.clone().into_scalar::<f32>()];
                batch_group.all_reduce(&mut l, ReduceOp::Avg)?;
                losses.push(l[0]);
                Ok(())
            };
            let (weights, bytes) = if stage == 3 {
                let units = ShardGroup::new(ctx.group(Axis::Fsdp));
                let config = FullyShardConfig::new();
                let mlp = Mlp::new(7, &device);
                let mut model = ShardedMlp {
                    l1: config.init(mlp.l1, &units)?,
                    l2: config.init(mlp.l2, &units)?,
                };
                let replicas = Some(ctx.group(Axis::Dp));
                let mut optim = FullyShardedOptimizer::new(
                    &model,
                    ctx.group(Axis::Fsdp),
                    replicas,
                    &adamw,
                    true,
                );
                for step in 0..STEPS {
                    let (x, y) = data(step);
                    let loss = mse(model.forward(x)?, y);
                    record(&loss)?;
                    optim.accumulate(
                        &model,
                        &GradientsParams::from_grads(loss.backward(), &model),
                    );
                    model = optim.step(1e-2, model, None)?.0;
                }
                let shard = ParamLayout::of(&model).numel * 4;
                let bytes = shard + optim.grad_bytes() + optim.state_bytes();
                (
                    flatten_params(&model.l1.gather()?)[..8 * 32].to_vec(),
                    bytes,
                )
            } else {
                let zero = ZeroConfig::stage(2, adamw)?;
                let (mut model, mut zero) = zero.init(Mlp::new(7, &device), ctx.group(Axis::Dp))?;
                for step in 0..STEPS {
                    let (x, y) = data(step);
                    zero.begin_step(1);
                    let loss = mse(zero.prepare(&model).forward(x), y);
                    record(&loss)?;
                    zero.backward_done(
                        &model,
                        GradientsParams::from_grads(loss.backward(), &model),
                    )?;
                    model = zero.step(1e-2, model, None)?.0;
                }
                let m = zero.memory();
                let bytes = m.params + m.grads + m.optimizer;
                (flatten_params(&model.l1)[..8 * 32].to_vec(), bytes)
            };
            Ok::<_, ParallelError>((losses, weights, bytes))
        })
        .expect("sharded training");
    results.into_iter().next().unwrap()
}

fn main() {
    let single = train_single();
    let zero2 = train_sharded(2);
    let zero3 = train_sharded(3);
    println!("step  loss(1 rank)  loss(ZeRO-2 dp=4)  loss(ZeRO-3 dp=2,fsdp=2)");
    for i in (0..STEPS).filter(|i| i % 5 == 0 || *i == STEPS - 1) {
        println!(
            "{i:>4}  {:>12.6}  {:>17.6}  {:>24.6}",
            single.0[i], zero2.0[i], zero3.0[i]
        );
    }
    // DDP holds every parameter, its gradient and two AdamW moments on every rank.
    let ddp = ParamLayout::of(&Mlp::new(7, &Device::flex())).numel * (4 + 4 + 8);
    println!(
        "bytes per rank for parameters + gradients + optimizer state: DDP {ddp}, ZeRO-2 over 4 ranks {}, ZeRO-3 over 2 shards {}",
        zero2.2, zero3.2
    );
    assert!(
        zero2.2 < ddp && zero3.2 < ddp,
        "sharding must hold less than DDP"
    );
    for (name, run) in [("ZeRO-2", &zero2), ("ZeRO-3/HSDP", &zero3)] {
        let run = (run.0.clone(), run.1.clone());
        let (loss_diff, w_diff) = differences(&single, &run);
        println!("{name}: max relative loss difference {loss_diff:.2e}; weights {w_diff:.2e}");
        assert!(
            loss_diff < 1e-5 && w_diff < 1e-5,
            "{name} must match one rank"
        );
    }
    println!("match: sharded training trains the same model as one rank");
}
