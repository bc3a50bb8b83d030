//! `flashover bench attention`: causal attention's forward and backward as the fused op
//! (`flashover_parallel::nn::fused_causal_attention`, no score tensor) against Burn's own
//! `module::attention` (whose autodiff path is its fallback: scores and probabilities kept for
//! backward), side by side on one device, per sequence length: time, and the device memory
//! the forward leaves for backward.

use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{DType, Device, Distribution, Tensor};
use flashover_parallel::nn::fused_causal_attention;
use serde::Serialize;
use std::time::Instant;

/// One (sequence length, way) measurement.
#[derive(Debug, Clone, Serialize)]
pub struct AttentionBenchRecord {
    /// Tokens per sequence.
    pub seq: usize,
    /// `fused` or `burn`.
    pub way: String,
    /// Median seconds of a forward and backward.
    pub step_s: f64,
    /// Device memory the forward's graph holds for backward (MiB; `None` where the device
    /// reports none, Flex).
    pub kept_mib: Option<f64>,
    /// Why this way failed at this length (out of memory, a buffer over the device's limit),
    /// if it did: its time is then NaN.
    pub error: Option<String>,
}

/// An attention core: `q`, `k`, `v` -> the output.
type AttentionFn = dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>;

/// What one forward and backward on `q`, `k`, `v` costs: seconds, and MiB the forward left
/// in use (after a sync) until backward; or why it failed.
type Measure = Result<(f64, Option<f64>), String>;

fn in_use_mib(device: &Device) -> Option<f64> {
    device
        .memory_pool_usage()
        .map(|u| u.bytes_in_use as f64 / (1 << 20) as f64)
}

/// Forward, sync, memory, backward, sync: the time and the memory kept.
fn measure(device: &Device, forward: &AttentionFn, [q, k, v]: [&Tensor<4>; 3]) -> Measure {
    let sync = || device.sync().map_err(|e| format!("device sync: {e:?}"));
    sync()?;
    let before = in_use_mib(device);
    let started = Instant::now();
    let (q, k, v) = (
        q.clone().require_grad(),
        k.clone().require_grad(),
        v.clone().require_grad(),
    );
    let out = forward(q.clone(), k.clone(), v.clone());
    sync()?;
    let kept = in_use_mib(device)
        .zip(before)
        .map(|(after, before)| after - before);
    let grads = out.sum().backward();
    let _ = (k.grad(&grads), v.grad(&grads));
    // Read one value back: a backend reports a failed allocation when a result is read, and
    // would otherwise skip the work unnoticed.
    let d_q = q.grad(&grads).ok_or("q got no gradient")?;
    let total = d_q.sum().into_scalar::<f32>();
    let elapsed = started.elapsed().as_secs_f64();
    match total.is_finite() {
        true => Ok((elapsed, kept)),
        false => Err(format!("q's gradient sums to {total}")),
    }
}

/// [`measure`], a panic (a backend's allocation failure) caught as the failure's message.
fn measure_caught(device: &Device, forward: &AttentionFn, qkv: [&Tensor<4>; 3]) -> Measure {
    let run = std::panic::AssertUnwindSafe(|| measure(device, forward, qkv));
    std::panic::catch_unwind(run).unwrap_or_else(|panic| {
        let message = (panic.downcast_ref::<String>().cloned())
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()));
        Err(message.unwrap_or_else(|| "panicked".into()))
    })
}

/// Measures both ways at each of `seqs` on `device` (autodiff is added), `heads` heads of
/// `head_dim`, in `dtype`, `repeats` times each after a warm-up, alternating. A way that
/// fails at a length (out of memory) is reported as failed; give the lengths in increasing
/// order, as the device may not recover for the ones after.
pub fn run(
    device: &Device,
    seqs: &[usize],
    heads: usize,
    head_dim: usize,
    dtype: DType,
    repeats: usize,
) -> Result<Vec<AttentionBenchRecord>, String> {
    let device = device.clone().autodiff();
    let options = AttentionModuleOptions {
        scale: None,
        softcap: None,
        is_causal: true,
    };
    let burn_attention =
        move |q: Tensor<4>, k: Tensor<4>, v: Tensor<4>| attention(q, k, v, None, None, options);
    let ways: [(&str, &AttentionFn); 2] = [
        ("fused", &fused_causal_attention),
        ("burn", &burn_attention),
    ];
    let mut out = vec![];
    for &seq in seqs {
        let rand = || {
            Tensor::<4>::random([1, heads, seq, head_dim], Distribution::Default, &device)
                .cast(dtype)
                .detach()
        };
        let (q, k, v) = (rand(), rand(), rand());
        // A failure in the warm-up round counts too: a backend that failed an allocation may
        // run what follows on a broken device.
        let mut failed: Vec<Option<String>> = vec![None; ways.len()];
        let measured = super::alternate(ways.len(), repeats, 1, |way| {
            let m = measure_caught(&device, ways[way].1, [&q, &k, &v]);
            if let Err(e) = &m {
                failed[way].get_or_insert_with(|| e.clone());
            }
            Ok::<_, String>(m)
        })?;
        for (((name, _), runs), error) in ways.iter().zip(measured).zip(failed) {
            let done: Vec<_> = match error {
                Some(_) => vec![],
                None => runs.iter().filter_map(|m| m.as_ref().ok()).collect(),
            };
            let kept = (done.iter().filter_map(|m| m.1))
                .fold(None, |a: Option<f64>, x| Some(a.map_or(x, |a| a.max(x))));
            out.push(AttentionBenchRecord {
                seq,
                way: name.to_string(),
                step_s: super::median(done.iter().map(|m| m.0).collect()),
                kept_mib: kept,
                error,
            });
        }
    }
    Ok(out)
}
