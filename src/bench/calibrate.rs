//! `flashover bench plan`: the planner's predictions against what `train` measures on this
//! machine, for a few meshes of the reference model: model-state memory per rank (as the
//! strategies count it), working heap per rank, and step time. The hardware is the `cpu`
//! preset with its peak replaced by a matrix-product rate measured first, in the same run.

use super::working_memory::measure;
use burn::tensor::{Device, Distribution, Tensor};
use flashover::plan::{Hardware, Precision, cost, layout_of, model_spec, workload};
use flashover::train::TrainConfig;
use serde::Serialize;
use std::time::Instant;

/// One mesh's prediction and measurement.
#[derive(Debug, Clone, Serialize)]
pub struct CalibrationRecord {
    /// The mesh and options.
    pub layout: String,
    /// Predicted parameters + gradients + optimizer state per rank (bytes).
    pub predicted_state: f64,
    /// Measured by the strategies on rank 0 (bytes).
    pub measured_state: f64,
    /// Predicted activations per rank (bytes).
    pub predicted_activations: f64,
    /// Measured working heap per rank (bytes): activations, gradients in flight, buffers.
    pub measured_working: f64,
    /// Predicted step time (seconds).
    pub predicted_step: f64,
    /// Measured median step time (seconds).
    pub measured_step: f64,
}

/// fp32 FLOP/s of Flex matrix products of `n x n` by `n x n`, over about `seconds`.
pub fn matmul_rate(n: usize, seconds: f64) -> f64 {
    let device = Device::flex();
    let a = Tensor::<2>::random([n, n], Distribution::Default, &device);
    let b = Tensor::<2>::random([n, n], Distribution::Default, &device);
    let _ = a.clone().matmul(b.clone()).into_data();
    let start = Instant::now();
    let mut runs = 0;
    while start.elapsed().as_secs_f64() < seconds {
        let _ = a.clone().matmul(b.clone()).into_data();
        runs += 1;
    }
    2.0 * (n * n * n) as f64 * runs as f64 / start.elapsed().as_secs_f64()
}

/// Measures each `(mesh, zero)` of `config` and predicts it.
pub fn run(
    config: &TrainConfig,
    layouts: &[(String, u8)],
) -> Result<(f64, Vec<CalibrationRecord>), String> {
    let rate = matmul_rate(256, 0.5);
    let mut out = vec![];
    for (mesh, zero) in layouts {
        let mut c = config.clone();
        c.parallel.mesh = mesh.clone();
        c.parallel.zero = *zero;
        let errors = c.validate();
        if !errors.is_empty() {
            return Err(format!("{mesh}: {}", errors.join("; ")));
        }
        let layout = layout_of(&c)?;
        let model = model_spec(&c)?;
        let work = workload(&c)?;
        let mut hardware = Hardware::preset("cpu").expect("the cpu preset");
        hardware.peak_flops = rate;
        let memory = cost::memory(&model, &work, &layout, Precision::Fp32);
        let time = cost::step_time(&model, &work, &layout, &hardware, Precision::Fp32);
        let m = measure(&c)?;
        let ranks = layout.world() as f64;
        let measured = m.report.memory[0];
        out.push(CalibrationRecord {
            layout: layout.to_string(),
            predicted_state: memory.model_state(),
            measured_state: (measured.params + measured.grads + measured.optimizer) as f64,
            predicted_activations: memory.activations,
            measured_working: m.working_bytes as f64 / ranks,
            predicted_step: time.step(),
            measured_step: m.step_s,
        });
    }
    Ok((rate, out))
}
