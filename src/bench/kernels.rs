//! `flashover bench kernels`: each fused kernel of `flashover-kernels` against the unfused
//! sequence of Burn operations it replaces (its reference path), on the same device, with the
//! bytes each must move at least and the rate the fused one reaches.

use burn::tensor::{Device, Distribution, Tensor};
use flashover_kernels::{
    AdamWScalars, adamw_step, adamw_step_reference, cross_entropy_pieces,
    cross_entropy_pieces_reference, merge_partials, merge_partials_reference, pack_scaled,
    pack_scaled_reference, permute_rows, permute_rows_reference, unpermute_rows,
    unpermute_rows_reference,
};
use serde::Serialize;
use std::time::Instant;

/// One operation at one size.
#[derive(Debug, Clone, Serialize)]
pub struct KernelBenchRecord {
    /// The operation.
    pub op: String,
    /// Its size.
    pub size: String,
    /// Median time of the fused kernel (seconds).
    pub fused_s: f64,
    /// Median time of the unfused Burn operations (seconds).
    pub unfused_s: f64,
    /// Bytes the operation must read and write at least.
    pub bytes: f64,
}

/// Median seconds of `f` over `repeats` runs after one warm-up, waiting for `device` each time.
fn median(device: &Device, repeats: usize, mut f: impl FnMut()) -> Result<f64, String> {
    f();
    device.sync().map_err(|e| format!("device sync: {e:?}"))?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        f();
        device.sync().map_err(|e| format!("device sync: {e:?}"))?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Times `fused` and `unfused` side by side on `device` as one record.
fn compare(
    (device, repeats): (&Device, usize),
    op: &str,
    size: String,
    bytes: f64,
    fused: impl FnMut(),
    unfused: impl FnMut(),
) -> Result<KernelBenchRecord, String> {
    Ok(KernelBenchRecord {
        op: op.into(),
        size,
        fused_s: median(device, repeats, fused)?,
        unfused_s: median(device, repeats, unfused)?,
        bytes,
    })
}

/// Measures every kernel at a few sizes on `device`.
pub fn run(device: &Device, repeats: usize) -> Result<Vec<KernelBenchRecord>, String> {
    let rand = |shape: Vec<usize>| {
        Tensor::<1>::random(
            [shape.iter().product::<usize>()],
            Distribution::Default,
            device,
        )
    };
    let mut out = vec![];
    for (rows, width) in [(4096, 64), (16384, 128)] {
        let oa = rand(vec![rows, width]).reshape([rows, width]);
        let ob = rand(vec![rows, width]).reshape([rows, width]);
        let (la, lb) = (rand(vec![rows]), rand(vec![rows]));
        let args = || (oa.clone(), la.clone(), ob.clone(), lb.clone());
        out.push(compare(
            (device, repeats),
            "online-softmax merge",
            format!("{rows} x {width}"),
            4.0 * (3 * rows * width + 3 * rows) as f64,
            || {
                let (a, b, c, d) = args();
                let _ = merge_partials(a, b, c, d);
            },
            || {
                let (a, b, c, d) = args();
                let _ = merge_partials_reference(a, b, c, d);
            },
        )?);
    }
    for n in [1 << 20, 1 << 23] {
        let s = AdamWScalars {
            lr: 1e-3,
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-8,
            weight_decay: 0.01,
            time: 3,
        };
        let (p, g, m, v) = (rand(vec![n]), rand(vec![n]), rand(vec![n]), rand(vec![n]));
        let args = || (p.clone(), g.clone(), m.clone(), v.clone());
        out.push(compare(
            (device, repeats),
            "AdamW on a flat shard",
            format!("{n} parameters"),
            4.0 * 7.0 * n as f64,
            || {
                let (a, b, c, d) = args();
                let _ = adamw_step(a, b, c, d, s);
            },
            || {
                let (a, b, c, d) = args();
                let _ = adamw_step_reference(a, b, c, d, s);
            },
        )?);
    }
    for (rows, width) in [(2048, 1000), (8192, 4000)] {
        let logits = rand(vec![rows, width]).reshape([rows, width]);
        let targets =
            Tensor::<1>::random([rows], Distribution::Uniform(0.0, width as f64), device).floor();
        out.push(compare(
            (device, repeats),
            "cross-entropy pieces",
            format!("{rows} x {width}"),
            4.0 * (rows * width + 4 * rows) as f64,
            || {
                let _ = cross_entropy_pieces(logits.clone(), targets.clone());
            },
            || {
                let _ = cross_entropy_pieces_reference(logits.clone(), targets.clone());
            },
        )?);
    }
    for (tokens, width, k) in [(4096, 256, 2), (16384, 512, 2)] {
        let n = tokens * k;
        let x = rand(vec![tokens, width]).reshape([tokens, width]);
        let order =
            Tensor::<1>::random([n], Distribution::Uniform(0.0, tokens as f64), device).floor();
        let positions = Tensor::<1>::random([n], Distribution::Uniform(0.0, n as f64), device)
            .floor()
            .reshape([tokens, k]);
        let weights = rand(vec![n]).reshape([tokens, k]);
        let permuted = permute_rows_reference(x.clone(), order.clone());
        out.push(compare(
            (device, repeats),
            "MoE permute",
            format!("{tokens} x {width}, top-{k}"),
            4.0 * (2 * n * width + n) as f64,
            || {
                let _ = permute_rows(x.clone(), order.clone());
            },
            || {
                let _ = permute_rows_reference(x.clone(), order.clone());
            },
        )?);
        out.push(compare(
            (device, repeats),
            "MoE un-permute (weighted)",
            format!("{tokens} x {width}, top-{k}"),
            4.0 * (n * width + tokens * width + 2 * n) as f64,
            || {
                let _ = unpermute_rows(permuted.clone(), positions.clone(), weights.clone());
            },
            || {
                let _ =
                    unpermute_rows_reference(permuted.clone(), positions.clone(), weights.clone());
            },
        )?);
    }
    for (count, len) in [(32, 65536), (256, 4096)] {
        let parts: Vec<Tensor<1>> = (0..count).map(|_| rand(vec![len])).collect();
        let total = count * len;
        out.push(compare(
            (device, repeats),
            "bucket pack x 1/N",
            format!("{count} tensors x {len}"),
            4.0 * 2.0 * total as f64,
            || {
                let _ = pack_scaled(parts.clone(), 0.5);
            },
            || {
                let _ = pack_scaled_reference(parts.clone(), 0.5);
            },
        )?);
        // What the strategies do with it: a module's gradients (or parameters) to the host as
        // one packed read against one read per tensor.
        out.push(compare(
            (device, repeats),
            "tensors to host: packed vs each",
            format!("{count} tensors x {len}"),
            4.0 * 2.0 * total as f64,
            || {
                let _ = pack_scaled(parts.clone(), 1.0).into_data();
            },
            || {
                for p in &parts {
                    let _ = p.clone().into_data();
                }
            },
        )?);
    }
    Ok(out)
}

/// Training steps of the reference transformer on `device` through the layouts whose
/// strategies use fused ops (AdamW everywhere, ring attention's merge at cp=2, the
/// vocabulary-parallel loss at tp=2, the MoE combine at ep=2), with the fused ops and with
/// tensor operations (`KernelUse::Always` against `Never`), alternating
/// `rounds` times; the median step time of each (first step of each run left out).
pub fn run_training(
    device: flashover::DeviceChoice,
    steps: usize,
    rounds: usize,
) -> Result<Vec<KernelBenchRecord>, String> {
    let job = |mesh: &str| {
        let mut c = flashover::train::TrainConfig::default();
        c.model.preset = "tiny".into();
        c.data.seq_len = 64;
        c.run.steps = steps.max(2);
        c.run.global_batch = 8;
        c.run.device = device;
        c.parallel.mesh = mesh.into();
        if mesh.contains("ep") {
            c.moe.experts = 4;
        }
        c
    };
    let mut out = vec![];
    for (mesh, what) in [
        ("dp=2", "training step: fused AdamW"),
        ("cp=2", "training step: ring merge + AdamW"),
        ("tp=2", "training step: loss pieces + AdamW"),
        ("ep=2", "training step: MoE combine + AdamW"),
    ] {
        let (mut fused, mut plain) = (vec![], vec![]);
        for _ in 0..rounds.max(1) {
            for (on, times) in [(true, &mut fused), (false, &mut plain)] {
                flashover_kernels::set_kernel_use(if on {
                    flashover_kernels::KernelUse::Always
                } else {
                    flashover_kernels::KernelUse::Never
                });
                let report = flashover::train::train(&job(mesh), &|_| {});
                flashover_kernels::set_kernel_use(flashover_kernels::KernelUse::Auto);
                let report = report?;
                times.extend(report.steps.iter().skip(1).map(|s| s.step_time_s));
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        out.push(KernelBenchRecord {
            op: what.into(),
            size: format!("{mesh}, tiny model, 8 x 64 tokens"),
            fused_s: median(&mut fused),
            unfused_s: median(&mut plain),
            bytes: 0.0,
        });
    }
    Ok(out)
}
