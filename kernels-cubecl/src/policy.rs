//! When the strategies use the kernels: their fused differentiable ops (ring attention's merge,
//! the vocabulary-parallel loss pieces, the MoE combine, AdamW) and packing for host transfers.
//!
//! By default only on a CubeCL device that is a card (a GPU). On a CPU adapter such as Mesa
//! lavapipe the buffers live in host memory and kernels run on the CPU cores: there, the
//! measured training steps were as fast or faster with tensor operations and host loops
//! (`docs/benchmarks.md`), and one host read per tensor beat packing 25-38x.

use burn::tensor::Device;
use std::sync::atomic::{AtomicUsize, Ordering};

/// When [`uses_kernels`] says yes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelUse {
    /// On a CubeCL device that is a card (its identity names a physical device).
    Auto,
    /// On every device: the kernels on a CubeCL device (tests use it to run them on
    /// lavapipe), their references in tensor ops elsewhere (Flex).
    Always,
    /// Never: tensor operations and host loops everywhere.
    Never,
}

static POLICY: AtomicUsize = AtomicUsize::new(0);

/// Sets when the strategies use the kernels, for the whole process (default
/// [`KernelUse::Auto`]).
pub fn set_kernel_use(policy: KernelUse) {
    let code = match policy {
        KernelUse::Auto => 0,
        KernelUse::Always => 1,
        KernelUse::Never => 2,
    };
    POLICY.store(code, Ordering::Relaxed);
}

/// Whether the strategies use the kernels for f32 tensors on `device`, per
/// [`set_kernel_use`]. Off a CubeCL device only under [`KernelUse::Always`], where each
/// kernel's reference (the same operation in tensor ops) runs instead: the device path, with
/// no host loop, on Flex too.
pub fn uses_kernels(device: &Device) -> bool {
    match POLICY.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => crate::is_cube_device(device) && is_card(&device.clone().inner()),
    }
}

/// Whether the CubeCL `device` is a card on a bus (its identity names one), remembered per
/// device (asking opens the device).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn is_card(device: &Device) -> bool {
    static KNOWN: std::sync::Mutex<Vec<(Device, bool)>> = std::sync::Mutex::new(Vec::new());
    let mut known = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, card)) = known.iter().find(|(d, _)| d == device) {
        return *card;
    }
    let card = device
        .identity()
        .is_some_and(|identity| identity.physical.is_some());
    known.push((device.clone(), card));
    card
}

#[cfg(not(any(feature = "wgpu", feature = "cuda")))]
fn is_card(_: &Device) -> bool {
    false
}
