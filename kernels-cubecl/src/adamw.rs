//! AdamW on a flat shard in one pass: the update ZeRO's sharded optimizer applies to the
//! parameters a rank owns.

use burn::backend::{Backend, Dispatch, Flex, backend_extension, tensor::FloatTensor};
use burn::tensor::Tensor;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn_cubecl::CubeBackend;

static CUBE_LAUNCHES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many AdamW kernels this process has launched on the CubeCL backend (for tests that
/// check a strategy's optimizer took the fused path).
pub fn adamw_kernel_launches() -> usize {
    CUBE_LAUNCHES.load(std::sync::atomic::Ordering::Relaxed)
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) fn count_launch() {
    CUBE_LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// The step's hyper-parameters, as Flashover's `FlatAdamW` (and Burn's `AdamW`) use them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScalars {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta_1: f32,
    /// Second-moment decay.
    pub beta_2: f32,
    /// Added to the root of the second moment.
    pub epsilon: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// The step number, from 1 (bias correction).
    pub time: i32,
}

impl AdamWScalars {
    /// `(1 - beta_1, 1 - beta_2, 1 - beta_1^t, 1 - beta_2^t, 1 - lr wd)`, computed as
    /// `FlatAdamW` computes them.
    pub fn derived(&self) -> [f32; 5] {
        [
            1.0 - self.beta_1,
            1.0 - self.beta_2,
            1.0 - self.beta_1.powi(self.time),
            1.0 - self.beta_2.powi(self.time),
            (1.0 - self.lr as f64 * self.weight_decay as f64) as f32,
        ]
    }
}

#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Fusion: cfg(any(feature = "wgpu", feature = "cuda"))
)]
pub trait AdamWOps: Backend {
    /// `(params, moment_1, moment_2)` after one step with `grads`; all `[n]`.
    #[fusion(meta = |params, _grads, moment_1, moment_2, _scalars| (params.clone(), moment_1.clone(), moment_2.clone()))]
    fn adamw_step(
        params: FloatTensor<Self>,
        grads: FloatTensor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        scalars: AdamWScalars,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// The step in plain Burn tensor operations (on any device), in `FlatAdamW`'s order of
/// operations.
pub fn adamw_step_reference(
    params: Tensor<1>,
    grads: Tensor<1>,
    moment_1: Tensor<1>,
    moment_2: Tensor<1>,
    s: AdamWScalars,
) -> (Tensor<1>, Tensor<1>, Tensor<1>) {
    let [f1, f2, c1, c2, decay] = s.derived();
    let m = moment_1.mul_scalar(s.beta_1) + grads.clone().mul_scalar(f1);
    let v = moment_2.mul_scalar(s.beta_2) + (grads.clone() * grads).mul_scalar(f2);
    let delta = m.clone().div_scalar(c1) / (v.clone().div_scalar(c2).sqrt().add_scalar(s.epsilon));
    let decayed = if s.lr as f64 * s.weight_decay as f64 != 0.0 {
        params.mul_scalar(decay)
    } else {
        params
    };
    (decayed - delta.mul_scalar(s.lr), m, v)
}

impl AdamWOps for Flex {
    fn adamw_step(
        params: FloatTensor<Self>,
        grads: FloatTensor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        scalars: AdamWScalars,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (p, m, v) = adamw_step_reference(
            crate::from_flex(params),
            crate::from_flex(grads),
            crate::from_flex(moment_1),
            crate::from_flex(moment_2),
            scalars,
        );
        (crate::to_flex(p), crate::to_flex(m), crate::to_flex(v))
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl AdamWOps for CubeBackend {
    fn adamw_step(
        params: FloatTensor<Self>,
        grads: FloatTensor<Self>,
        moment_1: FloatTensor<Self>,
        moment_2: FloatTensor<Self>,
        scalars: AdamWScalars,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        crate::cube::adamw_step(params, grads, moment_1, moment_2, scalars)
    }
}

/// One AdamW step on a flat shard: returns `(params, moment_1, moment_2)`. One kernel launch
/// on CubeCL devices; [`adamw_step_reference`] on Flex.
pub fn adamw_step(
    params: Tensor<1>,
    grads: Tensor<1>,
    moment_1: Tensor<1>,
    moment_2: Tensor<1>,
    scalars: AdamWScalars,
) -> (Tensor<1>, Tensor<1>, Tensor<1>) {
    let (p, m, v) = <Dispatch as AdamWOps>::adamw_step(
        params.into_dispatch(),
        grads.into_dispatch(),
        moment_1.into_dispatch(),
        moment_2.into_dispatch(),
        scalars,
    );
    (
        Tensor::from_dispatch(p),
        Tensor::from_dispatch(m),
        Tensor::from_dispatch(v),
    )
}
