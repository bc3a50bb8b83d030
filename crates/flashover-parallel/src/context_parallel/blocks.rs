//! Attention on blocks of keys, and the log-sum-exp rule that merges blocks' results into the
//! attention over their union (the online softmax of flash and ring attention).

use super::layout::Visibility;
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Tensor, TensorData};
use flashover_kernels::AttentionMask;

/// Attention of some queries over one block of keys: the block's softmax-weighted values and
/// the log of its softmax denominator (`[batch, heads, queries, 1]`).
pub struct Partial {
    /// `softmax(scores) V` over the block's keys: `[batch, heads, queries, head_dim]`.
    pub out: Tensor<4>,
    /// `log(sum(exp(scores)))` per query.
    pub lse: Tensor<4>,
}

/// Attention of `q` over the keys `k` and values `v` (`[batch, heads, len, head_dim]`), as
/// `visibility` says the queries see them; `dropout` is applied to the block's
/// probabilities (dropping an element of the whole row's probabilities is dropping it here,
/// since the merge only rescales rows).
pub fn attend_block(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    visibility: Visibility,
    dropout: impl FnOnce(Tensor<4>) -> Tensor<4>,
) -> Partial {
    let [b, h, tq, hd] = q.dims();
    let tk = k.dims()[2];
    let mut scores = q.matmul(k.swap_dims(2, 3)).div_scalar((hd as f64).sqrt());
    if visibility == Visibility::Diagonal {
        let mask = Tensor::<2, Bool>::tril_mask([tq, tk], 0, &scores.device())
            .reshape([1, 1, tq, tk])
            .expand([b, h, tq, tk]);
        scores = scores.mask_fill(mask, f32::NEG_INFINITY);
    }
    // The shift cancels out of both results; it only keeps exp() in range.
    let max = scores.clone().max_dim(3).detach();
    let exp = (scores - max.clone()).exp();
    let sum = exp.clone().sum_dim(3);
    let probs = dropout(exp / sum.clone());
    Partial {
        out: probs.matmul(v),
        lse: max + sum.log(),
    }
}

/// [`attend_block`] without dropout as the fused op (no score tensor): a diagonal block is
/// causal over as many keys as queries.
pub fn attend_block_fused(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    visibility: Visibility,
) -> Partial {
    let causal = visibility == Visibility::Diagonal;
    let (out, lse) = crate::attention_op::fused_attention(q, k, v, AttentionMask::new(causal));
    Partial { out, lse }
}

/// The attention over the union of `a`'s and `b`'s keys: each block's result weighted by its
/// share `exp(lse_block - lse)` of the joint denominator.
pub fn merge(a: Partial, b: Partial) -> Partial {
    let max = a.lse.clone().max_pair(b.lse.clone()).detach();
    let wa = (a.lse - max.clone()).exp();
    let wb = (b.lse - max.clone()).exp();
    let sum = wa.clone() + wb.clone();
    Partial {
        out: a.out * (wa / sum.clone()) + b.out * (wb / sum.clone()),
        lse: max + sum.log(),
    }
}

/// The causal mask of queries at `q_positions` over keys at `k_positions`, row-major
/// `[queries, keys]`: `true` where the key follows the query (hidden).
pub fn causal_mask(q_positions: &[usize], k_positions: &[usize]) -> Vec<bool> {
    q_positions
        .iter()
        .flat_map(|&qp| k_positions.iter().map(move |&kp| kp > qp))
        .collect()
}

/// Causal attention of queries at positions `q_positions` over keys at `k_positions` (any
/// order; each query must see at least one key), with `dropout` on the probabilities.
pub fn attend_positions(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    q_positions: &[usize],
    k_positions: &[usize],
    dropout: impl FnOnce(Tensor<4>) -> Tensor<4>,
) -> Tensor<4> {
    attend_masked(q, k, v, causal_mask(q_positions, k_positions), dropout)
}

/// Attention of `q` over `k`, `v` with the `[queries, keys]` mask `hidden` (from
/// [`causal_mask`]), with `dropout` on the probabilities.
pub fn attend_masked(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    hidden: Vec<bool>,
    dropout: impl FnOnce(Tensor<4>) -> Tensor<4>,
) -> Tensor<4> {
    let [b, h, tq, hd] = q.dims();
    let tk = k.dims()[2];
    let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((hd as f64).sqrt());
    let mask = Tensor::<2, Bool>::from_data(TensorData::new(hidden, [tq, tk]), &scores.device())
        .reshape([1, 1, tq, tk])
        .expand([b, h, tq, tk]);
    let probs = dropout(softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3));
    probs.matmul(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution};

    fn close(a: Tensor<4>, b: Tensor<4>) {
        let (a, b) = (a.into_data(), b.into_data());
        let (a, b) = (a.as_slice::<f32>().unwrap(), b.as_slice::<f32>().unwrap());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-6 + 1e-5 * y.abs(), "{x} vs {y}");
        }
    }

    #[test]
    fn merged_blocks_equal_attention_over_their_union() {
        let dev = Device::flex();
        let rand = |t: usize| Tensor::<4>::random([2, 3, t, 4], Distribution::Default, &dev);
        // Queries at positions 4..8; keys 0..4 (all visible) and 4..8 (the diagonal).
        let (q, k, v) = (rand(4), rand(8), rand(8));
        let whole = attend_positions(
            q.clone(),
            k.clone(),
            v.clone(),
            &[4, 5, 6, 7],
            &(0..8).collect::<Vec<_>>(),
            |p| p,
        );
        let half = |x: &Tensor<4>, i: usize| x.clone().narrow(2, 4 * i, 4);
        let early = attend_block(q.clone(), half(&k, 0), half(&v, 0), Visibility::All, |p| p);
        let diag = attend_block(q, half(&k, 1), half(&v, 1), Visibility::Diagonal, |p| p);
        close(merge(early, diag).out, whole);
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod fused_tests {
    use super::*;
    use burn::tensor::{Device, DeviceKind, Distribution};

    fn values(t: Tensor<4>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().unwrap()
    }

    /// The fused op (the kernels, on the wgpu device) against the composed tensor operations
    /// of a block: output, log-sum-exp and the gradients of q, k and v
    /// through both, causal and full, at lengths that are not multiples of a tile.
    #[test]
    fn the_fused_attention_has_the_composed_attentions_values_and_gradients() {
        let _serial = crate::attention_op::hold_kernel_use(flashover_kernels::KernelUse::Always);
        let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        assert!(crate::attention_op::fuses(&device));
        let (b, h, n, d) = (2, 3, 37, 16);
        let rand = |shape: [usize; 4]| {
            Tensor::<4>::random(shape, Distribution::Uniform(-1.0, 1.0), &device).detach()
        };
        let inputs = [rand([b, h, n, d]), rand([b, h, n, d]), rand([b, h, n, d])];
        let (r_out, r_lse) = (rand([b, h, n, d]), rand([b, h, n, 1]));
        for visibility in [Visibility::Diagonal, Visibility::All] {
            let run = |fused: bool| {
                let leaves: Vec<Tensor<4>> =
                    inputs.iter().map(|t| t.clone().require_grad()).collect();
                let (q, k, v) = (leaves[0].clone(), leaves[1].clone(), leaves[2].clone());
                let launches = flashover_kernels::attention_kernel_launches();
                let part = match fused {
                    true => attend_block_fused(q, k, v, visibility),
                    false => attend_block(q, k, v, visibility, |p| p),
                };
                let loss = (part.out.clone() * r_out.clone()).sum()
                    + (part.lse.clone() * r_lse.clone()).sum();
                let grads = loss.backward();
                let mut all = vec![values(part.out.inner()), values(part.lse.inner())];
                all.extend(leaves.iter().map(|l| values(l.grad(&grads).unwrap())));
                // The forward and the backward launched kernels, counted as Burn's fusion
                // runs them (by the reads above); the composed path none.
                let launched = flashover_kernels::attention_kernel_launches() - launches;
                assert_eq!(launched >= 2, fused, "kernel launches: {launched}");
                all
            };
            let (fused, composed) = (run(true), run(false));
            let names = ["out", "lse", "d q", "d k", "d v"];
            for ((f, c), name) in fused.iter().zip(&composed).zip(names) {
                for (x, y) in f.iter().zip(c) {
                    assert!(
                        (x - y).abs() <= 1e-4 * y.abs().max(1.0),
                        "{visibility:?} {name}: {x} vs {y}"
                    );
                }
            }
        }
    }
}
