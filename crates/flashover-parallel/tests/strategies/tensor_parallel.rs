//! Tensor-parallel layers against their single-rank counterparts: outputs and gradients of a
//! column-then-row MLP (with and without sequence parallelism), the vocabulary-parallel
//! embedding and cross-entropy (with vocabularies that do not divide by tp), and splits that
//! cannot be made.

use burn::module::Param;
use burn::nn::{Embedding, Linear};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover_parallel::ParallelError;
use flashover_parallel::params::to_f32;
use flashover_parallel::tensor_parallel::comm::{gather_from_tp, scatter_to_tp};
use flashover_parallel::tensor_parallel::{
    ColumnParallelLinear, RowParallelLinear, TensorParallel, VocabParallelEmbedding, VocabShard,
    vocab_parallel_cross_entropy,
};
use flashover_runtime::{Axis, launch};

fn values(n: usize, salt: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 * 0.37 + salt).sin()) * 0.5)
        .collect()
}

fn linear(d_in: usize, d_out: usize, salt: f32, device: &Device) -> Linear {
    Linear {
        weight: Param::from_data(
            TensorData::new(values(d_in * d_out, salt), [d_in, d_out]),
            device,
        ),
        bias: None,
    }
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale;
    assert!(diff < 1e-5, "{what}: relative difference {diff:e}");
}

/// `x: [2, 4, 8]` through `w2(tanh(w1 x))`, 8 -> 12 -> 8: output and the gradient of `x`.
fn mlp_reference(device: &Device) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let x =
        Tensor::<3>::from_data(TensorData::new(values(64, 0.3), [2, 4, 8]), device).require_grad();
    let (w1, w2) = (linear(8, 12, 0.1, device), linear(12, 8, 0.9, device));
    let y = w2.forward(w1.forward(x.clone()).tanh());
    let grads = (y.clone() * y.clone()).sum().backward();
    let gx = to_f32(x.grad(&grads).unwrap());
    let gw1 = to_f32(w1.weight.grad(&grads).unwrap());
    (to_f32(y), gx, gw1)
}

#[test]
fn column_then_row_parallel_mlp_matches_one_rank_with_and_without_sequence_parallel() {
    let device = Device::flex().autodiff();
    let (y_ref, gx_ref, gw1_ref) = mlp_reference(&device);
    for (tp, sp) in [(2, false), (4, false), (2, true), (4, true)] {
        let out = launch(format!("tp={tp}").as_str(), |ctx| {
            let device = Device::flex().autodiff();
            let plan = TensorParallel::new(ctx.group(Axis::Tp)).with_sequence_parallel(sp);
            let group = ctx.group(Axis::Tp);
            let w1 = ColumnParallelLinear::from_full(&linear(8, 12, 0.1, &device), &plan, false)?;
            let w2 = RowParallelLinear::from_full(&linear(12, 8, 0.9, &device), &plan)?;
            let x = Tensor::<3>::from_data(TensorData::new(values(64, 0.3), [2, 4, 8]), &device)
                .require_grad();
            // With sequence parallelism the input and output are split along the sequence.
            let x_in = if sp {
                scatter_to_tp(x.clone(), 1, group)
            } else {
                x.clone()
            };
            let y = w2.forward(w1.forward(x_in).tanh());
            let y = if sp { gather_from_tp(y, 1, group) } else { y };
            let grads = (y.clone() * y.clone()).sum().backward();
            let gw1 = w1.weight.grad(&grads).unwrap();
            let gw1 = group.all_gather_tensor_values(gw1, 1);
            Ok::<_, ParallelError>((to_f32(y), to_f32(x.grad(&grads).unwrap()), gw1))
        })
        .unwrap();
        for (rank, (y, gx, gw1)) in out.iter().enumerate() {
            let what = format!("tp={tp} sp={sp} rank {rank}");
            close(y, &y_ref, &format!("{what}: output"));
            close(gx, &gx_ref, &format!("{what}: input gradient"));
            close(gw1, &gw1_ref, &format!("{what}: column weight gradient"));
        }
    }
}

trait GatherValues {
    fn all_gather_tensor_values(&self, t: Tensor<2>, dim: usize) -> Vec<f32>;
}

impl GatherValues for flashover_runtime::Group {
    fn all_gather_tensor_values(&self, t: Tensor<2>, dim: usize) -> Vec<f32> {
        use flashover_runtime::TensorCollectives;
        to_f32(self.all_gather_tensor(t, dim).unwrap())
    }
}

/// Embedding lookup then the mean cross-entropy of the logits `h W^T` against targets, on one
/// rank: the loss and the table's gradient.
fn vocab_reference(vocab: usize, device: &Device) -> (f32, Vec<f32>) {
    let table = Param::from_data(TensorData::new(values(vocab * 6, 0.2), [vocab, 6]), device);
    let embed = Embedding { weight: table };
    let (tokens, targets) = tokens(vocab, device);
    let h = embed.forward(tokens);
    let logits = h.reshape([8, 6]).matmul(embed.weight.val().transpose());
    let logp = log_softmax(logits, 1);
    let loss = logp.gather(1, targets.reshape([8, 1])).mean().neg();
    let grads = loss.backward();
    (
        to_f32(loss).remove(0),
        to_f32(embed.weight.grad(&grads).unwrap()),
    )
}

fn tokens(vocab: usize, device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let ids: Vec<i64> = (0..8).map(|i| (i * 5 + 3) as i64 % vocab as i64).collect();
    let next: Vec<i64> = (0..8).map(|i| (i * 7 + 1) as i64 % vocab as i64).collect();
    (
        Tensor::from_data(TensorData::new(ids, [2, 4]), device),
        Tensor::from_data(TensorData::new(next, [2, 4]), device),
    )
}

/// The devices the ranks run on: Flex (the tensor operations) and, with the `wgpu` feature,
/// the wgpu adapter, where the loss takes its per-rank pieces from the fused kernel.
fn rank_devices() -> Vec<Device> {
    let mut devices = vec![Device::flex().autodiff()];
    if cfg!(feature = "wgpu") {
        // Lavapipe is a CPU adapter, where the kernels are off by default: force them.
        flashover_kernels::set_kernel_use(flashover_kernels::KernelUse::Always);
        devices.push(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice).autodiff());
    }
    devices
}

#[test]
fn vocab_parallel_embedding_and_loss_match_one_rank_even_when_the_vocabulary_is_padded() {
    let device = Device::flex().autodiff();
    // (5, 4): the last rank holds only padding rows.
    let cases = [(12, 2), (13, 2), (13, 4), (5, 4)];
    for ((vocab, tp), rank_device) in cases
        .into_iter()
        .flat_map(|c| rank_devices().into_iter().map(move |d| (c, d)))
    {
        let (loss_ref, grad_ref) = vocab_reference(vocab, &device);
        let out = launch(format!("tp={tp}").as_str(), |ctx| {
            let device = rank_device.clone();
            let group = ctx.group(Axis::Tp);
            let plan = TensorParallel::new(group);
            let full =
                Param::from_data(TensorData::new(values(vocab * 6, 0.2), [vocab, 6]), &device);
            let embed = VocabParallelEmbedding::from_full(&Embedding { weight: full }, &plan);
            let shard = VocabShard::new(vocab, group.rank(), tp);
            let (tokens, targets) = tokens(vocab, &device);
            // The tied head is a column-parallel region: enter it through f.
            let h = plan.enter(embed.forward(tokens));
            let rows = embed.weight.val().dims()[0];
            let logits = h
                .reshape([8, 6])
                .matmul(embed.weight.val().transpose())
                .reshape([2, 4, rows]);
            let loss = vocab_parallel_cross_entropy(logits, targets, &shard, group);
            let grads = loss.backward();
            let grad = embed.weight.grad(&grads).unwrap();
            let grad = group.all_gather_tensor_values(grad, 0);
            Ok::<_, ParallelError>((to_f32(loss).remove(0), grad[..vocab * 6].to_vec()))
        })
        .unwrap();
        for (rank, (loss, grad)) in out.iter().enumerate() {
            let what = format!("vocab {vocab}, tp={tp}, rank {rank} on {rank_device:?}");
            close(&[*loss], &[loss_ref], &format!("{what}: loss"));
            close(grad, &grad_ref, &format!("{what}: table gradient"));
        }
    }
}

#[test]
fn splits_that_do_not_divide_fail_with_the_sizes() {
    let err = launch("tp=3", |ctx| {
        let device = Device::flex();
        let plan = TensorParallel::new(ctx.group(Axis::Tp));
        ColumnParallelLinear::from_full(&linear(8, 8, 0.1, &device), &plan, false).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("shape [8, 8] cannot be split into 3"), "{err}");
}

fn biased(d_in: usize, d_out: usize, salt: f32, device: &Device) -> Linear {
    Linear {
        bias: Some(Param::from_data(
            TensorData::new(values(d_out, salt + 0.5), [d_out]),
            device,
        )),
        ..linear(d_in, d_out, salt, device)
    }
}

#[test]
fn biased_layers_split_the_column_bias_and_add_the_row_bias_once() {
    let device = Device::flex().autodiff();
    let x = Tensor::<3>::from_data(TensorData::new(values(64, 0.3), [2, 4, 8]), &device);
    let (w1, w2) = (biased(8, 12, 0.1, &device), biased(12, 8, 0.9, &device));
    let y = w2.forward(w1.forward(x).tanh());
    let grads = (y.clone() * y.clone()).sum().backward();
    let reference = (
        to_f32(y),
        to_f32(w1.bias.as_ref().unwrap().grad(&grads).unwrap()),
        to_f32(w2.bias.as_ref().unwrap().grad(&grads).unwrap()),
    );
    for (tp, sp) in [(2, false), (4, false), (2, true)] {
        let out = launch(format!("tp={tp}").as_str(), |ctx| {
            use flashover_runtime::{CommunicatorExt, ReduceOp, TensorCollectives};
            let device = Device::flex().autodiff();
            let group = ctx.group(Axis::Tp);
            let plan = TensorParallel::new(group).with_sequence_parallel(sp);
            let w1 = ColumnParallelLinear::from_full(&biased(8, 12, 0.1, &device), &plan, false)?;
            let w2 = RowParallelLinear::from_full(&biased(12, 8, 0.9, &device), &plan)?;
            let x = Tensor::<3>::from_data(TensorData::new(values(64, 0.3), [2, 4, 8]), &device);
            let x = if sp { scatter_to_tp(x, 1, group) } else { x };
            let y = w2.forward(w1.forward(x).tanh());
            let y = if sp { gather_from_tp(y, 1, group) } else { y };
            let grads = (y.clone() * y.clone()).sum().backward();
            let b1 = w1.bias.as_ref().unwrap().grad(&grads).unwrap();
            let b1 = to_f32(group.all_gather_tensor(b1, 0).unwrap());
            let mut b2 = to_f32(w2.bias.as_ref().unwrap().grad(&grads).unwrap());
            if sp {
                // Each rank added the bias to its own positions only.
                group.all_reduce(&mut b2, ReduceOp::Sum)?;
            }
            Ok::<_, ParallelError>((to_f32(y), b1, b2))
        })
        .unwrap();
        for (rank, (y, b1, b2)) in out.iter().enumerate() {
            let what = format!("tp={tp} sp={sp} rank {rank}");
            close(y, &reference.0, &format!("{what}: output"));
            close(b1, &reference.1, &format!("{what}: column bias gradient"));
            close(b2, &reference.2, &format!("{what}: row bias gradient"));
        }
    }
}
