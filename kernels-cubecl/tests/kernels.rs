//! Every kernel on the wgpu device (Mesa lavapipe in CI) against its plain-tensor reference
//! on Flex, for shapes that are and are not multiples of the 256-unit cube, down to one
//! element.
#![cfg(feature = "wgpu")]

use burn::tensor::{Bool, Device, DeviceKind, Tensor, TensorData};
use flashover_kernels::{
    AdamWScalars, AttentionMask, adamw_step, adamw_step_reference, attention_backward,
    attention_backward_reference, attention_delta, attention_forward, attention_forward_reference,
    cross_entropy_pieces, cross_entropy_pieces_reference, merge_partials, merge_partials_reference,
};

fn wgpu() -> Device {
    Device::wgpu(DeviceKind::DefaultDevice)
}

fn values(n: usize, salt: f32, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 * 0.61 + salt).sin()) * scale)
        .collect()
}

fn tensor<const D: usize>(v: Vec<f32>, shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::from_data(TensorData::new(v, shape), device)
}

fn close<const D: usize>(kernel: Tensor<D>, reference: Tensor<D>, what: &str) {
    close_within(kernel, reference, 1e-5, what);
}

const SHAPES: [(usize, usize); 5] = [(1, 1), (3, 7), (17, 64), (33, 129), (257, 5)];

#[test]
fn merge_kernel_matches_the_reference() {
    // The last shape needs more than 65535 cubes of 256 units: the grid spreads over two
    // dimensions.
    for (rows, width) in SHAPES.into_iter().chain([(65_601, 256)]) {
        let data = [
            values(rows * width, 0.1, 1.0),
            values(rows, 0.2, 3.0),
            values(rows * width, 0.3, 1.0),
            values(rows, 0.4, 3.0),
        ];
        let run = |device: &Device, kernel: bool| {
            let oa = tensor(data[0].clone(), [rows, width], device);
            let la = tensor(data[1].clone(), [rows], device);
            let ob = tensor(data[2].clone(), [rows, width], device);
            let lb = tensor(data[3].clone(), [rows], device);
            if kernel {
                merge_partials(oa, la, ob, lb)
            } else {
                merge_partials_reference(oa, la, ob, lb)
            }
        };
        let (out, lse) = run(&wgpu(), true);
        let (out_ref, lse_ref) = run(&Device::flex(), false);
        close(out, out_ref, &format!("merge {rows}x{width}: out"));
        close(lse, lse_ref, &format!("merge {rows}x{width}: lse"));
    }
}

#[test]
fn adamw_kernel_matches_the_reference_with_and_without_decay() {
    for n in [1, 255, 256, 1000] {
        for (weight_decay, time) in [(0.0, 1), (0.01, 7)] {
            let s = AdamWScalars {
                lr: 1e-2,
                beta_1: 0.9,
                beta_2: 0.999,
                epsilon: 1e-8,
                weight_decay,
                time,
            };
            let data = [
                values(n, 0.1, 1.0),
                values(n, 0.2, 0.5),
                values(n, 0.3, 0.1),
                values(n, 0.4, 0.01).iter().map(|v| v.abs()).collect(),
            ];
            let run = |device: &Device, kernel: bool| {
                let [p, g, m, v] = data.clone().map(|d| tensor(d, [n], device));
                if kernel {
                    adamw_step(p, g, m, v, s)
                } else {
                    adamw_step_reference(p, g, m, v, s)
                }
            };
            let (p, m, v) = run(&wgpu(), true);
            let (p_ref, m_ref, v_ref) = run(&Device::flex(), false);
            let what = format!("adamw n={n} wd={weight_decay} t={time}");
            close(p, p_ref, &format!("{what}: params"));
            close(m, m_ref, &format!("{what}: moment_1"));
            close(v, v_ref, &format!("{what}: moment_2"));
        }
    }
}

#[test]
fn cross_entropy_kernel_matches_the_reference_with_targets_held_and_not() {
    for (rows, width) in SHAPES {
        let logits = values(rows * width, 0.7, 4.0);
        // Every third row's target is on another rank.
        let targets: Vec<f32> = (0..rows)
            .map(|r| {
                if r % 3 == 2 {
                    -1.0
                } else {
                    ((r * 5) % width) as f32
                }
            })
            .collect();
        let run = |device: &Device, kernel: bool| {
            let l = tensor(logits.clone(), [rows, width], device);
            let t = tensor(targets.clone(), [rows], device);
            if kernel {
                cross_entropy_pieces(l, t)
            } else {
                cross_entropy_pieces_reference(l, t)
            }
        };
        let (max, sum, target) = run(&wgpu(), true);
        let (max_ref, sum_ref, target_ref) = run(&Device::flex(), false);
        let what = format!("cross-entropy {rows}x{width}");
        close(max, max_ref, &format!("{what}: max"));
        close(sum, sum_ref, &format!("{what}: sum"));
        close(target, target_ref, &format!("{what}: target"));
    }
}

#[test]
fn on_flex_the_ops_are_their_references() {
    let d = Device::flex();
    let (rows, width) = (3, 5);
    let l = || tensor(values(rows * width, 0.7, 4.0), [rows, width], &d);
    let t = || tensor(vec![0.0, -1.0, 4.0], [rows], &d);
    let (a, b, c) = cross_entropy_pieces(l(), t());
    let (x, y, z) = cross_entropy_pieces_reference(l(), t());
    close(a, x, "max");
    close(b, y, "sum");
    close(c, z, "target");
}

#[test]
fn moe_permute_kernels_match_the_reference_with_dropped_choices() {
    use flashover_kernels::{
        permute_rows, permute_rows_reference, unpermute_rows, unpermute_rows_reference,
    };
    for (tokens, width, k) in [(1, 1, 1), (7, 33, 2), (300, 17, 2), (64, 256, 4)] {
        let x = values(tokens * width, 0.2, 1.0);
        // Each token's k choices land in rows of the permuted buffer; every fifth is dropped.
        let n = tokens * k;
        let order: Vec<f32> = (0..n).map(|i| ((i * 7) % tokens) as f32).collect();
        let positions: Vec<f32> = (0..n)
            .map(|i| {
                if i % 5 == 4 {
                    -1.0
                } else {
                    ((i * 3) % n) as f32
                }
            })
            .collect();
        let weights = values(n, 0.9, 0.5);
        let run = |device: &Device, kernel: bool| {
            let x = tensor(x.clone(), [tokens, width], device);
            let order = tensor(order.clone(), [n], device);
            let permuted = if kernel {
                permute_rows(x, order)
            } else {
                permute_rows_reference(x, order)
            };
            let p = tensor(positions.clone(), [tokens, k], device);
            let w = tensor(weights.clone(), [tokens, k], device);
            let combined = if kernel {
                unpermute_rows(permuted.clone(), p, w)
            } else {
                unpermute_rows_reference(permuted.clone(), p, w)
            };
            (permuted, combined)
        };
        let (permuted, combined) = run(&wgpu(), true);
        let (permuted_ref, combined_ref) = run(&Device::flex(), false);
        let what = format!("moe {tokens}x{width} k={k}");
        close(permuted, permuted_ref, &format!("{what}: permuted"));
        close(combined, combined_ref, &format!("{what}: combined"));
    }
}

#[test]
fn bucket_pack_and_unpack_kernels_match_the_reference() {
    use flashover_kernels::{
        PACK_GROUP, bucket_kernel_launches, pack_scaled, pack_scaled_reference, unpack_scaled,
        unpack_scaled_reference,
    };
    // Groups that fill PACK_GROUP and ones that do not, one-element and cube-crossing sizes,
    // and a bucket past 65535 cubes.
    let buckets: [&[usize]; 5] = [
        &[1],
        &[3, 257, 1, 64],
        &[5, 7, 11, 13, 17, 19],
        &[300; 9],
        &[17_000_000, 3],
    ];
    for (b, lens) in buckets.iter().enumerate() {
        let data: Vec<Vec<f32>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| values(n, i as f32, 2.0))
            .collect();
        for scale in [1.0, 0.125] {
            let parts = |device: &Device| -> Vec<Tensor<1>> {
                data.iter()
                    .map(|v| tensor(v.clone(), [v.len()], device))
                    .collect()
            };
            let before = bucket_kernel_launches();
            let packed = pack_scaled(parts(&wgpu()), scale);
            let launches = bucket_kernel_launches() - before;
            assert_eq!(
                launches,
                lens.len().div_ceil(PACK_GROUP),
                "bucket {b}: pack launches"
            );
            let expected = pack_scaled_reference(parts(&Device::flex()), scale);
            close(
                packed.clone(),
                expected.clone(),
                &format!("pack bucket {b} x{scale}"),
            );
            let pieces = unpack_scaled(packed, lens, 1.0 / scale);
            let reference = unpack_scaled_reference(expected, lens, 1.0 / scale);
            assert_eq!(bucket_kernel_launches() - before, launches + lens.len());
            for (i, (p, r)) in pieces.into_iter().zip(reference).enumerate() {
                close(p, r, &format!("unpack bucket {b} piece {i}"));
            }
        }
    }
}

/// `close` within `tolerance` (relative to the larger of the value and 1).
fn close_within<const D: usize>(
    kernel: Tensor<D>,
    reference: Tensor<D>,
    tolerance: f32,
    what: &str,
) {
    let (a, b) = (
        kernel.into_data().try_to_vec::<f32>().unwrap(),
        reference.into_data().try_to_vec::<f32>().unwrap(),
    );
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= tolerance * y.abs().max(1.0),
            "{what}[{i}]: kernel {x} vs reference {y}"
        );
    }
}

/// Key padding for `heads` heads of two samples over `n_k` keys: the first sample's last third
/// of keys (at least one) are padding; with `all_padding`, every key of the second sample is.
fn key_padding(heads: usize, n_k: usize, all_padding: bool, device: &Device) -> Tensor<2, Bool> {
    let rows = if heads.is_multiple_of(2) { 2 } else { 1 };
    let real = n_k - (n_k / 3).max(1);
    let padded: Vec<bool> = (0..rows * n_k)
        .map(|i| match i / n_k {
            0 => i % n_k >= real,
            _ => all_padding || i % n_k == 0,
        })
        .collect();
    Tensor::from_data(TensorData::new(padded, [rows, n_k]), device)
}

#[test]
fn attention_kernels_match_the_reference_causal_and_full_at_odd_lengths() {
    // (heads, queries, keys, head dim): lengths that are not multiples of a tile or of a
    // cube's 64 rows, more queries than one cube, fewer queries than keys (causal aligns the
    // last query with the last key), and the head dims 64 and 128. Each without and with key
    // padding (Burn's score for it, -1e4), one case with a sample of padding only.
    let shapes = [
        (3, 37, 37, 64),
        (2, 70, 70, 64),
        (2, 5, 37, 64),
        (1, 37, 20, 128),
        (2, 33, 33, 128),
        (4, 9, 9, 64),
        (1, 1, 1, 16),
    ];
    let paddings = [None, Some(false), Some(true)];
    for ((heads, n_q, n_k, d), padding) in shapes.into_iter().flat_map(|s| paddings.map(|p| (s, p)))
    {
        if padding.is_some() && n_k < 2 {
            continue;
        }
        for causal in [true, false] {
            if causal && n_q > n_k {
                continue;
            }
            let mask_on = |device: &Device| match padding {
                Some(all) => AttentionMask::new(causal)
                    .with_padding(key_padding(heads, n_k, all, device), -1.0e4),
                None => AttentionMask::new(causal),
            };
            let scale = 1.0 / (d as f32).sqrt();
            let data = [
                values(heads * n_q * d, 0.1, 1.5),
                values(heads * n_k * d, 0.2, 1.5),
                values(heads * n_k * d, 0.3, 1.0),
                values(heads * n_q * d, 0.4, 1.0),
                values(heads * n_q, 0.5, 1.0),
            ];
            let what = format!("{heads}x{n_q}x{n_k}x{d} causal {causal} padding {padding:?}");
            let run = |device: &Device, kernel: bool| {
                let mask = &mask_on(device);
                let q = tensor(data[0].clone(), [heads, n_q, d], device);
                let k = tensor(data[1].clone(), [heads, n_k, d], device);
                let v = tensor(data[2].clone(), [heads, n_k, d], device);
                let d_out = tensor(data[3].clone(), [heads, n_q, d], device);
                let d_lse = tensor(data[4].clone(), [heads, n_q], device);
                if kernel {
                    let (out, lse) =
                        attention_forward(q.clone(), k.clone(), v.clone(), mask, scale);
                    let delta = attention_delta(out.clone(), d_out.clone(), Some(d_lse.clone()));
                    let grads = attention_backward(q, k, v, lse.clone(), delta, d_out, mask, scale);
                    (out, lse, grads)
                } else {
                    let (out, lse) =
                        attention_forward_reference(q.clone(), k.clone(), v.clone(), mask, scale);
                    let delta = attention_delta(out.clone(), d_out.clone(), Some(d_lse.clone()));
                    let grads = attention_backward_reference(
                        q,
                        k,
                        v,
                        lse.clone(),
                        delta,
                        d_out,
                        mask,
                        scale,
                    );
                    (out, lse, grads)
                }
            };
            let (out, lse, (d_q, d_k, d_v)) = run(&wgpu(), true);
            let (out_r, lse_r, (d_q_r, d_k_r, d_v_r)) = run(&Device::flex(), false);
            close_within(out, out_r, 1e-4, &format!("{what}: out"));
            close_within(lse, lse_r, 1e-4, &format!("{what}: lse"));
            close_within(d_q, d_q_r, 1e-4, &format!("{what}: d_q"));
            close_within(d_k, d_k_r, 1e-4, &format!("{what}: d_k"));
            close_within(d_v, d_v_r, 1e-4, &format!("{what}: d_v"));
        }
    }
}

#[test]
fn causal_attentions_first_query_sees_only_the_first_key() {
    // The reference's mask, checked by hand: query 0 of a causal attention over as many
    // keys as queries attends to key 0 alone, so its output is value row 0.
    let (n, d) = (4, 3);
    let device = Device::flex();
    let q = tensor(values(n * d, 0.1, 1.0), [1, n, d], &device);
    let k = tensor(values(n * d, 0.2, 1.0), [1, n, d], &device);
    let v = tensor(values(n * d, 0.3, 1.0), [1, n, d], &device);
    let (out, _) = attention_forward_reference(q, k, v.clone(), &AttentionMask::new(true), 1.0);
    close(out.narrow(1, 0, 1), v.narrow(1, 0, 1), "causal query 0");
}

#[test]
fn the_attention_backward_is_autodiffs_gradient_of_the_forward() {
    // On Flex's autodiff: the gradients of `sum(out * r) + sum(lse * s)` through the
    // reference forward against the reference backward with `s` folded into the delta.
    let (heads, n_q, n_k, d) = (4, 5, 7, 4);
    let device = Device::flex().autodiff();
    for (causal, padded) in [(true, false), (false, false), (true, true), (false, true)] {
        // Key padding on the second sample's keys 1 and 4 (heads 2 and 3 of 4).
        let pads: Vec<bool> = (0..2 * n_k).map(|i| i == n_k + 1 || i == n_k + 4).collect();
        let pads = Tensor::from_data(TensorData::new(pads, [2, n_k]), &device);
        let mask = match padded {
            true => AttentionMask::new(causal).with_padding(pads, -3.0),
            false => AttentionMask::new(causal),
        };
        let mask = &mask;
        let leaf = |n, salt, shape: [usize; 3]| tensor(values(n, salt, 1.0), shape, &device);
        let q = leaf(heads * n_q * d, 0.1, [heads, n_q, d]).require_grad();
        let k = leaf(heads * n_k * d, 0.2, [heads, n_k, d]).require_grad();
        let v = leaf(heads * n_k * d, 0.3, [heads, n_k, d]).require_grad();
        let r = leaf(heads * n_q * d, 0.4, [heads, n_q, d]);
        let s = tensor(values(heads * n_q, 0.5, 1.0), [heads, n_q], &device);
        let (out, lse) = attention_forward_reference(q.clone(), k.clone(), v.clone(), mask, 0.7);
        let loss = (out.clone() * r.clone()).sum() + (lse.clone() * s.clone()).sum();
        let grads = loss.backward();
        let delta = attention_delta(out.detach(), r.clone(), Some(s));
        let (d_q, d_k, d_v) = attention_backward_reference(
            q.clone().detach(),
            k.clone().detach(),
            v.clone().detach(),
            lse.detach(),
            delta,
            r,
            mask,
            0.7,
        );
        for (leaf, mine, what) in [(q, d_q, "d_q"), (k, d_k, "d_k"), (v, d_v, "d_v")] {
            let autodiff = leaf.grad(&grads).expect("a gradient");
            close_within(
                mine.inner(),
                autodiff,
                1e-5,
                &format!("causal {causal} padded {padded}: {what}"),
            );
        }
    }
}
