//! Choosing the compute device: `flex | wgpu | cuda`, from a flag or `BURN_DEVICE`.

use burn::tensor::Device;
use std::fmt;
use std::str::FromStr;

/// The Burn device family a job computes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// Burn's Flex CPU backend (always built).
    #[default]
    Flex,
    /// Burn's wgpu backend: Vulkan/Metal/DX12 GPUs, or a CPU adapter such as Mesa lavapipe
    /// (needs the `wgpu` cargo feature).
    Wgpu,
    /// Burn's CUDA backend; rank `local_rank` uses GPU `local_rank` (needs the `cuda` feature).
    Cuda,
}

/// Why a device cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// Unknown device name.
    #[error("unknown device `{0}`: expected flex, wgpu or cuda")]
    Unknown(String),
    /// The backend was not compiled in.
    #[error(
        "device `{device}` needs the `{feature}` cargo feature: rebuild with `--features {feature}`"
    )]
    NotBuilt {
        /// The device asked for.
        device: DeviceChoice,
        /// The feature to enable.
        feature: &'static str,
    },
    /// The backend was built but this machine cannot run it (no driver, library or GPU).
    #[error("device `{device}` cannot be used here: {why}")]
    Unavailable {
        /// The device asked for.
        device: DeviceChoice,
        /// What is missing, and how to get it.
        why: String,
    },
}

impl DeviceChoice {
    /// The device named by `BURN_DEVICE` (`flex`, `wgpu`, `cuda`), if set.
    pub fn from_env() -> Result<Option<Self>, DeviceError> {
        match std::env::var("BURN_DEVICE") {
            Ok(v) if !v.trim().is_empty() => v.parse().map(Some),
            _ => Ok(None),
        }
    }

    /// The Burn device for a rank with this local (per-node) index: for CUDA, GPU `local_rank`,
    /// refused with what is missing where the driver, NVRTC or that GPU is not there.
    pub fn device(self, local_rank: usize) -> Result<Device, DeviceError> {
        let _ = local_rank;
        match self {
            DeviceChoice::Flex => Ok(Device::flex()),
            #[cfg(feature = "wgpu")]
            DeviceChoice::Wgpu => Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
            #[cfg(not(feature = "wgpu"))]
            DeviceChoice::Wgpu => Err(DeviceError::NotBuilt {
                device: self,
                feature: "wgpu",
            }),
            #[cfg(feature = "cuda")]
            DeviceChoice::Cuda => flashover_comm::cuda::check_gpu(local_rank)
                .map(|()| Device::cuda(local_rank))
                .map_err(|why| DeviceError::Unavailable {
                    device: self,
                    why: why.to_string(),
                }),
            #[cfg(not(feature = "cuda"))]
            DeviceChoice::Cuda => Err(DeviceError::NotBuilt {
                device: self,
                feature: "cuda",
            }),
        }
    }
}

impl FromStr for DeviceChoice {
    type Err = DeviceError;
    fn from_str(s: &str) -> Result<Self, DeviceError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "flex" => Ok(DeviceChoice::Flex),
            "wgpu" => Ok(DeviceChoice::Wgpu),
            "cuda" => Ok(DeviceChoice::Cuda),
            other => Err(DeviceError::Unknown(other.to_string())),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceChoice::Flex => "flex",
            DeviceChoice::Wgpu => "wgpu",
            DeviceChoice::Cuda => "cuda",
        })
    }
}

/// Relative error above which a device's f32 matrix products are not f32 arithmetic: f32
/// accumulation of the probe's products stays near 1e-6; TF32 tensor cores (10-bit mantissa,
/// what Burn's CUDA matmul uses for f32 wherever the GPU has them) give about 1e-3.
pub const F32_MATMUL_ERROR_LIMIT: f64 = 1e-5;

/// The largest relative error of `device`'s f32 matrix products against the same products in
/// f64 on the host, over a few shapes (a backend may pick its kernel by shape). Measured, not
/// assumed from the device's name: [`F32_MATMUL_ERROR_LIMIT`] says what is f32.
pub fn f32_matmul_error(device: &Device) -> f64 {
    use burn::tensor::Tensor;
    let mut worst = 0f64;
    for (m, k, n) in [(8, 64, 64), (64, 172, 64), (128, 256, 128), (512, 512, 512)] {
        // Values with full mantissas, so that rounding the inputs shows.
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 1.337)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 104729 % 1013) as f32 / 1013.0 - 0.5) * 0.911)
            .collect();
        let on_device = Tensor::<1>::from_floats(a.as_slice(), device)
            .reshape([m, k])
            .matmul(Tensor::<1>::from_floats(b.as_slice(), device).reshape([k, n]));
        let Ok(got) = on_device.into_data().try_to_vec::<f32>() else {
            return f64::INFINITY;
        };
        let (mut diff, mut scale) = (0f64, 0f64);
        let mut exact = vec![0f64; n];
        for i in 0..m {
            // Row `i` of the f64 product, accumulated along `b`'s rows (contiguous reads).
            exact.iter_mut().for_each(|e| *e = 0.0);
            for p in 0..k {
                let a_ip = a[i * k + p] as f64;
                let b_row = &b[p * n..(p + 1) * n];
                exact
                    .iter_mut()
                    .zip(b_row)
                    .for_each(|(e, &b_pj)| *e += a_ip * b_pj as f64);
            }
            for (j, e) in exact.iter().enumerate() {
                diff = diff.max((got[i * n + j] as f64 - e).abs());
                scale = scale.max(e.abs());
            }
        }
        worst = worst.max(diff / scale);
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flex_multiplies_f32_as_f32_and_a_tf32_rounding_would_show() {
        let error = f32_matmul_error(&Device::flex());
        assert!(
            error <= F32_MATMUL_ERROR_LIMIT,
            "Flex f32 matmul error {error:e}"
        );
        // The probe's inputs carry full mantissas: rounding them to TF32's 10 bits, as tensor
        // cores do, moves a product by far more than the limit.
        let tf32 = |x: f32| f32::from_bits(x.to_bits() & !0x1fff);
        let (a, b) = (0.5 * 1.337 * 0.123_456_79_f32, 0.911 * 0.376_543_2_f32);
        let rel = ((tf32(a) * tf32(b)) as f64 - (a * b) as f64).abs() / (a * b) as f64;
        assert!(rel > F32_MATMUL_ERROR_LIMIT, "{rel:e}");
    }
}
