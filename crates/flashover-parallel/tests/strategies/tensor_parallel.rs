//! The vocabulary-parallel embedding, tied head and cross-entropy (`flashover::nn::Embedding`
//! under a plan's `vocab` rule) against one rank, with vocabularies that do not divide by tp,
//! on Flex and on the wgpu adapter's fused loss kernel. Split linear layers are tested as
//! models in `parallelize.rs`.

use burn::module::{Module, Param};
use burn::nn::Embedding;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover_parallel::ParallelError;
use flashover_parallel::nn;
use flashover_parallel::parallelize::{ParallelizePlan, TensorParallelRule, parallelize};
use flashover_parallel::params::to_f32;
use flashover_runtime::{Axis, TensorCollectives, launch};

fn values(n: usize, salt: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 * 0.37 + salt).sin()) * 0.5)
        .collect()
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale;
    assert!(diff < 1e-5, "{what}: relative difference {diff:e}");
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

/// A table used as the embedding and the tied output head.
#[derive(Module, Debug)]
struct TiedTable {
    embed: nn::Embedding,
}

#[test]
fn a_vocabulary_split_by_a_plan_embeds_and_computes_the_loss_as_one_rank_even_when_padded() {
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
            let full =
                Param::from_data(TensorData::new(values(vocab * 6, 0.2), [vocab, 6]), &device);
            let model = TiedTable {
                embed: nn::Embedding { weight: full },
            };
            let plan =
                ParallelizePlan::new().tensor_parallel(TensorParallelRule::vocab(&["embed"]));
            let (model, par) = parallelize(model, &plan, &ctx)?;
            let (tokens, targets) = tokens(vocab, &device);
            let embed = &model.embed;
            let loss = embed.cross_entropy(embed.logits(embed.forward(tokens)), targets);
            let (grads, _) = par.gradients(&model, loss.backward(), None, &ctx)?;
            // This rank's rows of the table's gradient, the last rank's padded: gathered whole.
            let grad: Tensor<2> = grads.get(embed.weight.id).expect("the table's gradient");
            let grad = to_f32(ctx.group(Axis::Tp).all_gather_tensor(grad, 0)?);
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
