//! ZeRO stage 1 against DDP: the same model, data and seed; optimizer state sharded over the
//! data-parallel group. FlatAdamW is bit-identical to Burn's AdamW and every rank updates its
//! shard from the same averaged gradient, so the parameters must equal DDP's bit for bit, also
//! when the parameter count does not divide by the world size (padding).

mod common;

use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use common::Net;
use flashover_parallel::data_parallel::DataParallelConfig;
use flashover_parallel::params::flatten_params;
use flashover_parallel::zero::ZeroOptimizer;
use flashover_parallel::{FlatAdamWConfig, ParallelError};
use flashover_runtime::{Axis, launch};

const GLOBAL_BATCH: usize = 6;

/// Every rank's final parameters after 6 steps, with ZeRO-1 or with Burn's AdamW (DDP).
fn train(world: usize, zero: bool) -> (Vec<Vec<f32>>, usize) {
    let out = launch(world, |ctx| {
        let device = Device::flex().autodiff();
        let net = Net::new(&device);
        let dp = ctx.group(Axis::Dp);
        let (mut net, mut ddp) = DataParallelConfig::new()
            .with_bucket_bytes(128)
            .init(net, dp)?;
        let config = FlatAdamWConfig::new().with_weight_decay(0.01);
        let mut burn_adamw = config.to_burn().init();
        let mut sharded = ZeroOptimizer::new(&net, dp, &config);
        let per_rank = GLOBAL_BATCH / dp.size();
        for step in 0..6 {
            let rows: Vec<f32> = (0..per_rank * 6)
                .map(|i| {
                    ((step * GLOBAL_BATCH * 6 + dp.rank() * per_rank * 6 + i) as f32 * 0.13).cos()
                })
                .collect();
            let x = Tensor::<2>::from_data(TensorData::new(rows, [per_rank, 6]), &device);
            ddp.begin_step(1);
            let loss = ddp.prepare(&net).forward(x).powi_scalar(2).mean();
            ddp.backward_done(&net, GradientsParams::from_grads(loss.backward(), &net));
            let lr = 0.02;
            if zero {
                ddp.finish_flat(Some(1.0))?;
                net = sharded.step(lr, net, ddp.flat_grads())?;
            } else {
                let grads = ddp.finish(&net, Some(1.0))?.grads;
                net = burn_adamw.step(lr, net, grads);
            }
        }
        Ok::<_, ParallelError>((flatten_params(&net), sharded.state_bytes()))
    })
    .unwrap();
    let state = out[0].1;
    (out.into_iter().map(|(p, _)| p).collect(), state)
}

#[test]
fn zero1_matches_ddp_bit_for_bit_at_world_2_and_3() {
    for world in [2, 3] {
        let (ddp, _) = train(world, false);
        let (zero, state_bytes) = train(world, true);
        assert!(
            zero.iter().all(|p| p == &zero[0]),
            "world {world}: ranks must agree"
        );
        assert_eq!(
            zero[0], ddp[0],
            "world {world}: ZeRO-1 must equal DDP bit for bit"
        );
        // 128 parameters: each rank keeps two f32 moments for ceil(128 / world) of them.
        assert_eq!(state_bytes, 8 * 128usize.div_ceil(world));
    }
}
