//! The tensor collectives on Burn CUDA tensors, world size 1 (one GPU), for the GPU machine
//! (`scripts/gpu_check.sh`); exits 2 where CUDA or NCCL cannot be loaded, 1 on a wrong result.
//!
//! 1. With the NCCL engine, [`TensorCollectives`] hands CUDA tensors' device buffers to NCCL
//!    (its private `cuda_memory` module): every operation's result is checked against the
//!    input (at world size 1 each one is an identity or a copy), none may stage through host
//!    memory, and the flight recorder must see every call.
//! 2. With a thread group (no device collectives) the same tensors are staged through host
//!    memory: the results are checked and the staging counted.
//!
//! The tensors are shaped to catch layout mistakes: CubeCL pads the rows of CUDA tensors of
//! rank 2 and more (a row of 5 f32 takes 8), so `[6, 5]` and `[2, 3, 5]` have gaps in their
//! buffers; a view cut from a larger tensor starts past its buffer's start. At world size 1 an
//! in-place all-reduce or broadcast leaves any buffer as it was, so only the out-of-place
//! operations (all-gather, reduce-scatter, all-to-all) can show a wrong address. Send and
//! receive run as one batch (`exchange_flat`, as pipelines send): at world size 1 the rank
//! sends to itself, which NCCL completes only inside one group of calls. The thread engine
//! refuses a send to oneself, so the staged check leaves it out.

use burn::tensor::{DType as BurnDType, Device, Tensor};
use flashover_comm::{FlightRecorder, NcclWorld, ThreadWorld};
use flashover_runtime::transfers::{self, Cause};
use flashover_runtime::{Communicator, DeviceChoice, Incoming, ReduceOp, TensorCollectives};
use std::time::Duration;

/// The inputs: a padded 2-D tensor, a padded 3-D one, and a view into a larger buffer.
fn inputs(device: &Device, dtype: BurnDType) -> Vec<(&'static str, Tensor<3>)> {
    let ramp = |n: usize| -> Vec<f32> { (0..n).map(|i| i as f32 * 0.25 - 3.0).collect() };
    let t = |n: usize, shape: [usize; 3]| {
        Tensor::<1>::from_floats(ramp(n).as_slice(), device)
            .reshape(shape)
            .cast(dtype)
    };
    vec![
        ("[6, 1, 5]", t(30, [6, 1, 5])),
        ("[2, 3, 5]", t(30, [2, 3, 5])),
        ("rows 1..7 of [8, 1, 5]", t(40, [8, 1, 5]).narrow(0, 1, 6)),
    ]
}

/// Runs every tensor collective on `x` over `group` (one rank) and counts the wrong results.
fn check_all<C: Communicator + ?Sized>(group: &C, what: &str, x: &Tensor<3>) -> usize {
    let expected = x.clone().cast(BurnDType::F32).into_data();
    let rows = x.dims()[0];
    let sum = ReduceOp::Sum;
    let results = [
        ("all_reduce", group.all_reduce_tensor(x.clone(), sum)),
        ("broadcast", group.broadcast_tensor(x.clone(), 0)),
        ("all_gather dim 0", group.all_gather_tensor(x.clone(), 0)),
        ("all_gather dim 2", group.all_gather_tensor(x.clone(), 2)),
        (
            "reduce_scatter dim 0",
            group.reduce_scatter_tensor(x.clone(), 0, sum),
        ),
        (
            "reduce_scatter dim 2",
            group.reduce_scatter_tensor(x.clone(), 2, sum),
        ),
        (
            "all_to_all",
            group.all_to_all_tensor(x.clone(), &[rows], &[rows]),
        ),
    ];
    let mut wrong = 0;
    for (op, result) in results {
        let got = result
            .unwrap_or_else(|e| panic!("{op} on {what}: {e}"))
            .cast(BurnDType::F32)
            .into_data();
        if got != expected {
            println!("cuda_collectives: WRONG {op} on {what}: {got:?}");
            wrong += 1;
        }
    }
    wrong
}

/// `x` sent to this rank and received from it in one batch (NCCL only: see the top); the
/// wrong results counted.
fn check_exchange<C: Communicator + ?Sized>(group: &C, what: &str, x: &Tensor<3>) -> usize {
    let numel = x.shape().num_elements();
    let incoming = Incoming {
        numel,
        dtype: x.dtype(),
        src: 0,
    };
    let flat = x.clone().reshape([numel]);
    let got = group
        .exchange_flat(&[(flat, 0)], &[incoming], &x.device())
        .unwrap_or_else(|e| panic!("exchange_flat on {what}: {e}"));
    let got = got[0]
        .clone()
        .reshape(x.dims())
        .cast(BurnDType::F32)
        .into_data();
    if got != x.clone().cast(BurnDType::F32).into_data() {
        println!("cuda_collectives: WRONG exchange_flat on {what}: {got:?}");
        return 1;
    }
    0
}

fn main() {
    if let Err(e) = NcclWorld::available() {
        eprintln!("cuda_collectives: {e}");
        std::process::exit(2);
    }
    let device = DeviceChoice::Cuda.device(0).unwrap_or_else(|e| {
        eprintln!("cuda_collectives: {e}");
        std::process::exit(2);
    });
    let recorder = FlightRecorder::new(0, 256);
    let nccl = NcclWorld::group(0, 1, 0, Duration::from_secs(60), |id| Ok(vec![id.to_vec()]))
        .expect("NCCL world of one")
        .recorded(recorder.clone());
    assert!(
        nccl.device_collectives().is_some(),
        "the NCCL engine has device collectives"
    );
    let threads = ThreadWorld::new(1).build().pop().expect("one thread rank");

    let mut wrong = 0;
    let mut checked = 0;
    for dtype in [BurnDType::F32, BurnDType::BF16] {
        for (shape, x) in inputs(&device, dtype) {
            let before = transfers::snapshot();
            wrong += check_all(&*nccl, &format!("{shape} {dtype:?} (NCCL)"), &x);
            wrong += check_exchange(&*nccl, &format!("{shape} {dtype:?} (NCCL)"), &x);
            let staged = transfers::snapshot().since(&before).of(Cause::Collective);
            if (staged.to_host.count, staged.to_device.count) != (0, 0) {
                println!(
                    "cuda_collectives: NCCL staged {shape} {dtype:?} through host memory: \
                     {staged:?}"
                );
                wrong += 1;
            }

            let before = transfers::snapshot();
            wrong += check_all(&threads, &format!("{shape} {dtype:?} (staged)"), &x);
            let staged = transfers::snapshot().since(&before).of(Cause::Collective);
            assert_eq!(
                staged.to_host.count, 7,
                "the thread group stages every call"
            );
            checked += 8 + 7;
        }
    }
    // Every NCCL call is recorded; an all-gather or reduce-scatter along dim 2 is one call, and
    // so is a batch.
    let recorded = recorder.dump_data().entries.len();
    let expected_entries = 2 * 3 * 8;
    if recorded != expected_entries {
        println!("cuda_collectives: {recorded} flight entries, expected {expected_entries}");
        wrong += 1;
    }
    println!(
        "cuda_collectives: {} of {checked} results right (f32, bf16; padded, 3-D and offset \
         tensors); NCCL staged nothing through host memory; {recorded} flight entries",
        checked - wrong.min(checked)
    );
    if wrong > 0 {
        std::process::exit(1);
    }
}
