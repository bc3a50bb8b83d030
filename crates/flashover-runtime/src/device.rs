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
