//! `checkpoint` on a user's own module: only its input is kept, and backward recomputes it.
//! (The policies on the reference transformer are tested where it lives: the root crate's
//! `tests/equivalence/recompute_policies.rs`.)

use burn::module::Module;
use burn::tensor::{Device, Tensor, TensorData};
use flashover_parallel::activation_checkpointing::checkpoint;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

#[test]
fn checkpoint_wraps_any_module_and_keeps_only_its_input() {
    // A user's module: a plain Burn Linear, checkpointed with a closure around it.
    let device = Device::flex().autodiff();
    let linear = burn::nn::LinearConfig::new(4, 3).init(&device);
    let linear = flashover_parallel::params::load_flat(
        linear,
        &(0..15).map(|i| (i as f32 * 0.3).sin()).collect::<Vec<_>>(),
    );
    let x = || {
        Tensor::<2>::from_data(
            TensorData::new((0..8).map(|i| i as f32 * 0.1).collect::<Vec<_>>(), [2, 4]),
            &device,
        )
        .require_grad()
    };
    let grads = |y: Tensor<2>, x: &Tensor<2>, m: &burn::nn::Linear| {
        let g = (y.clone() * y).tanh().sum().backward();
        let gx = x.grad(&g).unwrap().into_data();
        let gw = m.weight.grad(&g).unwrap().into_data();
        let gb = m.bias.as_ref().unwrap().grad(&g).unwrap().into_data();
        (gx, gw, gb)
    };
    let (xa, xb) = (x(), x());
    let plain = grads(linear.forward(xa.clone()), &xa, &linear);
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let y = checkpoint(&linear, xb.clone(), move |m: &burn::nn::Linear, x| {
        counter.fetch_add(1, Ordering::Relaxed);
        m.forward(x)
    });
    assert_eq!(calls.load(Ordering::Relaxed), 1, "forward ran once so far");
    let recomputed = grads(y, &xb, &linear);
    assert_eq!(
        calls.load(Ordering::Relaxed),
        2,
        "backward ran the forward again"
    );
    assert_eq!(plain, recomputed);
    assert_eq!(linear.num_params(), 15);
}
