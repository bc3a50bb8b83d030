//! Bucket pack / unpack with scaling: many tensors copied into one flat buffer (and back out),
//! each element times a factor on the way (an average's 1/N, a loss scale). A bucket then
//! crosses to the host, or to a collective, as one buffer instead of one per tensor: on a GPU
//! that is one device-to-host transfer and one synchronisation instead of one per parameter.
//!
//! On Burn's CubeCL backend one launch copies up to [`PACK_GROUP`] tensors (a kernel reads a
//! fixed set of buffers, and adapters bound how many one shader may bind), so a bucket of `n`
//! tensors takes `ceil(n / PACK_GROUP)` launches into one output; unpacking is one launch per
//! tensor (each output is its own buffer). Elsewhere, and for tensors that are not f32 or not
//! all on one CubeCL device, plain Burn operations do the same.

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn::backend::Cube;
use burn::tensor::Tensor;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Source tensors one pack launch reads on the CubeCL backend.
pub const PACK_GROUP: usize = 4;

static CUBE_LAUNCHES: AtomicUsize = AtomicUsize::new(0);

/// How many pack and unpack kernels this process has launched on the CubeCL backend (for tests
/// and benchmarks that check the kernels, not the fallback, ran).
pub fn bucket_kernel_launches() -> usize {
    CUBE_LAUNCHES.load(Ordering::Relaxed)
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) fn count_launches(n: usize) {
    CUBE_LAUNCHES.fetch_add(n, Ordering::Relaxed);
}

/// `parts` concatenated into one flat tensor, every element times `scale`. `parts` must not be
/// empty; pass tensors outside any autodiff graph (`Tensor::inner`).
///
/// ```
/// use burn::tensor::{Device, Tensor};
/// use flashover_kernels::{pack_scaled, unpack_scaled};
///
/// let device = Device::flex();
/// let a = Tensor::<1>::from_floats([1.0, 2.0], &device);
/// let b = Tensor::<1>::from_floats([4.0], &device);
/// let flat = pack_scaled(vec![a, b], 0.5);
/// assert_eq!(flat.clone().into_data().try_to_vec::<f32>().unwrap(), vec![0.5, 1.0, 2.0]);
/// let parts = unpack_scaled(flat, &[2, 1], 2.0);
/// assert_eq!(parts[1].clone().into_data().try_to_vec::<f32>().unwrap(), vec![4.0]);
/// ```
pub fn pack_scaled(parts: Vec<Tensor<1>>, scale: f32) -> Tensor<1> {
    assert!(!parts.is_empty(), "pack_scaled needs at least one tensor");
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if let Some(cube) = cube_parts(&parts) {
        let packed = crate::cube::pack_scaled(cube, scale);
        return Tensor::from_primitive::<Cube>(crate::fusion_bridge::register(packed));
    }
    pack_scaled_reference(parts, scale)
}

/// [`pack_scaled`] in plain Burn tensor operations (on any device).
pub fn pack_scaled_reference(parts: Vec<Tensor<1>>, scale: f32) -> Tensor<1> {
    let flat = Tensor::cat(parts, 0);
    if scale == 1.0 {
        flat
    } else {
        flat.mul_scalar(scale)
    }
}

/// `flat` cut into consecutive pieces of `lens` elements (their sum must be `flat`'s length),
/// each element times `scale`.
pub fn unpack_scaled(flat: Tensor<1>, lens: &[usize], scale: f32) -> Vec<Tensor<1>> {
    let total: usize = lens.iter().sum();
    assert_eq!(
        total,
        flat.dims()[0],
        "unpack_scaled: the pieces ({total} elements) must cover the flat tensor"
    );
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if let Some(mut cube) = cube_parts(std::slice::from_ref(&flat)) {
        let pieces = crate::cube::unpack_scaled(cube.remove(0), lens, scale);
        return pieces
            .into_iter()
            .map(|piece| Tensor::from_primitive::<Cube>(crate::fusion_bridge::register(piece)))
            .collect();
    }
    unpack_scaled_reference(flat, lens, scale)
}

/// [`unpack_scaled`] in plain Burn tensor operations (on any device).
pub fn unpack_scaled_reference(flat: Tensor<1>, lens: &[usize], scale: f32) -> Vec<Tensor<1>> {
    let mut at = 0;
    lens.iter()
        .map(|&len| {
            let piece = flat.clone().narrow(0, at, len);
            at += len;
            if scale == 1.0 {
                piece
            } else {
                piece.mul_scalar(scale)
            }
        })
        .collect()
}

/// The parts as CubeCL tensors when every one is an f32 tensor on the same CubeCL device.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn cube_parts(parts: &[Tensor<1>]) -> Option<Vec<burn_cubecl::tensor::CubeTensor>> {
    let first = parts.first()?.device();
    let same = parts
        .iter()
        .all(|p| p.device() == first && p.dtype() == burn::tensor::DType::F32);
    if !same {
        return None;
    }
    parts
        .iter()
        .map(|p| {
            p.clone()
                .try_into_primitive::<Cube>()
                .ok()
                .map(crate::fusion_bridge::resolve)
        })
        .collect()
}
