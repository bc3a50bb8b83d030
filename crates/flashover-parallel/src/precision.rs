//! Mixed precision: which dtype the forward and backward compute in, which dtype gradients
//! are reduced in, and loss scaling for f16, in the spirit of FSDP2's `MixedPrecisionPolicy`
//! and Megatron's `--bf16` / `--fp16` options.
//!
//! The strategies keep their parameters ("master weights") and the optimizer state in f32.
//! Each micro-batch runs on [`MixedPrecision::compute_view`] of the model: every parameter cast
//! to the compute dtype *inside* the autodiff graph, so backward casts each parameter's
//! gradient back to f32 on its way to the leaf. Gradient reduction, clipping and AdamW are then
//! unchanged, and the f32 leaves stay the only copy a checkpoint sees. The reference model
//! computes its softmaxes, norms' statistics and the loss in f32 under any policy.
//!
//! ```
//! use burn::tensor::{Device, Tensor, TensorData};
//! use burn::nn::LinearConfig;
//! use burn::module::Module;
//! use flashover_parallel::precision::{MixedPrecision, Precision};
//!
//! let device = Device::flex().autodiff();
//! let layer = LinearConfig::new(4, 2).init(&device);
//! let policy = MixedPrecision::new(Precision::BF16);
//! policy.check(&device).unwrap();
//! let compute = policy.compute_view(layer.clone());
//! assert_eq!(compute.weight.val().dtype(), burn::tensor::DType::BF16);
//! let x = Tensor::<2>::from_data(TensorData::new(vec![1.0f32; 8], [2, 4]), &device);
//! let loss = compute.forward(x.cast(Precision::BF16.float_dtype())).sum();
//! let grads = loss.backward();
//! // The gradient reaches the f32 master weight in f32.
//! assert_eq!(layer.weight.grad(&grads).unwrap().dtype(), burn::tensor::DType::F32);
//! ```

use crate::ParallelError;
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Device, FloatDType, Tensor};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A floating-point precision for compute or for gradient reduction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// 32-bit float (the default: no reduced precision).
    #[default]
    F32,
    /// bfloat16: f32's range with 8 bits of mantissa; needs no loss scaling.
    BF16,
    /// IEEE half: 11 bits of mantissa but a narrow range; gradients need loss scaling.
    F16,
}

impl Precision {
    /// Burn's float dtype for this precision.
    pub fn float_dtype(self) -> FloatDType {
        match self {
            Precision::F32 => FloatDType::F32,
            Precision::BF16 => FloatDType::BF16,
            Precision::F16 => FloatDType::F16,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::BF16 => "bf16",
            Precision::F16 => "f16",
        })
    }
}

impl FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Ok(Precision::F32),
            "bf16" | "bfloat16" => Ok(Precision::BF16),
            "f16" | "fp16" | "float16" | "half" => Ok(Precision::F16),
            other => Err(format!(
                "unknown precision `{other}`: expected f32, bf16 or f16"
            )),
        }
    }
}

/// How the loss is scaled before backward so that small f16 gradients do not flush to zero.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossScale {
    /// No scaling (f32 and bf16).
    None,
    /// A fixed factor.
    Static(f32),
    /// Start at `initial`; halve and skip the step when a gradient overflows, double after
    /// `growth_interval` steps in a row without overflow (as PyTorch's `GradScaler`).
    Dynamic {
        /// The first scale.
        initial: f32,
        /// Overflow-free steps before the scale doubles.
        growth_interval: usize,
    },
}

impl LossScale {
    /// PyTorch's `GradScaler` defaults: 2^16, doubling every 2000 clean steps.
    pub fn dynamic() -> Self {
        LossScale::Dynamic {
            initial: 65536.0,
            growth_interval: 2000,
        }
    }
}

/// A precision policy: what the forward and backward compute in, and what gradients are
/// reduced in. Parameters and optimizer state stay f32.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MixedPrecision {
    /// The dtype parameters are cast to for forward and backward.
    pub param_dtype: Precision,
    /// The dtype gradient buckets are reduced in (f32 by default; bf16 halves the bytes).
    pub reduce_dtype: Precision,
    /// Loss scaling (dynamic by default for f16, none otherwise).
    pub loss_scale: LossScale,
}

impl Default for MixedPrecision {
    fn default() -> Self {
        MixedPrecision::new(Precision::F32)
    }
}

impl MixedPrecision {
    /// Compute in `param_dtype`, reduce in f32, scale the loss dynamically for f16.
    pub fn new(param_dtype: Precision) -> Self {
        MixedPrecision {
            param_dtype,
            reduce_dtype: Precision::F32,
            loss_scale: if param_dtype == Precision::F16 {
                LossScale::dynamic()
            } else {
                LossScale::None
            },
        }
    }

    /// Whether anything differs from plain f32 training.
    pub fn is_full_precision(&self) -> bool {
        self.param_dtype == Precision::F32
            && self.reduce_dtype == Precision::F32
            && self.loss_scale == LossScale::None
    }

    /// Fails, naming the device and dtype, where `device` cannot compute in the policy's
    /// dtype, and for settings that cannot work anywhere ([`MixedPrecision::validate`]).
    pub fn check(&self, device: &Device) -> Result<(), ParallelError> {
        let dtype = self.param_dtype.float_dtype();
        if !device.supports_dtype(dtype) {
            return Err(ParallelError::Invalid(format!(
                "the device {device:?} does not support {} tensors (precision param_dtype = \
                 \"{}\"): use f32, or a device that supports it",
                self.param_dtype, self.param_dtype
            )));
        }
        self.validate()
    }

    /// Fails for settings that cannot work on any device: a loss scale that is not a positive
    /// finite number, a dynamic scale that never grows.
    pub fn validate(&self) -> Result<(), ParallelError> {
        match self.loss_scale {
            LossScale::Static(s) | LossScale::Dynamic { initial: s, .. }
                if !(s.is_finite() && s > 0.0) =>
            {
                Err(ParallelError::Invalid(format!(
                    "loss scale {s} must be a positive finite number"
                )))
            }
            LossScale::Dynamic {
                growth_interval: 0, ..
            } => Err(ParallelError::Invalid(
                "the dynamic loss scale's growth interval must be at least 1 step".into(),
            )),
            _ => Ok(()),
        }
    }

    /// `model` with every float parameter cast to the compute dtype, inside the autodiff graph
    /// (the parameters keep their ids, so `GradientsParams::from_grads(.., &master)` finds the
    /// f32 gradients). `model` itself when the compute dtype is f32.
    pub fn compute_view<M: Module>(&self, model: M) -> M {
        if self.param_dtype == Precision::F32 {
            return model;
        }
        cast_params(model, self.param_dtype.float_dtype())
    }

    /// [`Self::compute_view`] of the parameters `part` marks (one flag per parameter, in layout
    /// order), the others as they are: a layer of a whole model cast inside its recomputation.
    pub(crate) fn compute_view_of<M: Module>(&self, model: M, part: &[bool]) -> M {
        if self.param_dtype == Precision::F32 {
            return model;
        }
        model.map(&mut CastPart {
            dtype: self.param_dtype.float_dtype(),
            part,
            index: 0,
        })
    }

    /// A loss scaler for this policy.
    pub fn scaler(&self) -> LossScaler {
        LossScaler::new(self.loss_scale)
    }

    /// The settings that describe this policy (what a TOML table of it holds).
    pub fn settings(&self) -> PrecisionSettings {
        let defaults = PrecisionSettings::default();
        let (loss_scale, initial, interval) = match self.loss_scale {
            LossScale::None => ("none".into(), defaults.initial_loss_scale, 2000),
            LossScale::Static(s) => (s.to_string(), defaults.initial_loss_scale, 2000),
            LossScale::Dynamic {
                initial,
                growth_interval,
            } => ("dynamic".into(), initial as f64, growth_interval),
        };
        PrecisionSettings {
            param_dtype: self.param_dtype,
            reduce_dtype: self.reduce_dtype,
            loss_scale,
            initial_loss_scale: initial,
            loss_scale_growth_interval: interval,
        }
    }
}

/// A precision policy as a TOML table (a job file's `[precision]`, a plan's
/// `[mixed_precision]`): what forward and backward compute in (parameters and optimizer state
/// stay f32), what gradients are reduced in, and loss scaling. Every key has a default:
/// `param_dtype = "bf16"` alone is bf16 compute with f32 reduction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrecisionSettings {
    /// Compute dtype: `f32`, `bf16` or `f16`.
    pub param_dtype: Precision,
    /// Gradient reduction dtype: `f32` (the default), `bf16` or `f16`.
    pub reduce_dtype: Precision,
    /// `auto` (dynamic for f16, none otherwise), `none`, `dynamic`, or a fixed factor.
    pub loss_scale: String,
    /// The first dynamic loss scale.
    pub initial_loss_scale: f64,
    /// Overflow-free steps before a dynamic loss scale doubles.
    pub loss_scale_growth_interval: usize,
}

impl Default for PrecisionSettings {
    fn default() -> Self {
        PrecisionSettings {
            param_dtype: Precision::F32,
            reduce_dtype: Precision::F32,
            loss_scale: "auto".into(),
            initial_loss_scale: 65536.0,
            loss_scale_growth_interval: 2000,
        }
    }
}

impl PrecisionSettings {
    /// The policy these settings describe; fails naming a malformed setting.
    pub fn policy(&self) -> Result<MixedPrecision, String> {
        let mut policy = MixedPrecision::new(self.param_dtype);
        policy.reduce_dtype = self.reduce_dtype;
        let dynamic = LossScale::Dynamic {
            initial: self.initial_loss_scale as f32,
            growth_interval: self.loss_scale_growth_interval,
        };
        policy.loss_scale = match self.loss_scale.as_str() {
            "auto" if self.param_dtype == Precision::F16 => dynamic,
            "auto" | "none" => LossScale::None,
            "dynamic" => dynamic,
            fixed => match fixed.parse::<f32>() {
                Ok(s) => LossScale::Static(s),
                Err(_) => {
                    return Err(format!(
                        "precision.loss_scale = `{fixed}`: expected auto, none, dynamic or a number"
                    ));
                }
            },
        };
        policy.validate().map_err(|e| format!("precision: {e}"))?;
        Ok(policy)
    }
}

/// `module` with every float parameter cast to `dtype` inside the autodiff graph (ids kept:
/// gradients reach the original parameters in their own dtype). No-op casts cost nothing.
pub fn cast_params<M: Module>(module: M, dtype: FloatDType) -> M {
    module.map(&mut CastParams(dtype))
}

/// Casts every float parameter's value, keeping the parameter (its id) and the graph.
struct CastParams(FloatDType);

impl ModuleMapper for CastParams {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let dtype = self.0;
        param.map(|t| t.cast(dtype))
    }
}

/// Casts the float parameters `part` marks, keeping each parameter (its id) and the graph.
struct CastPart<'a> {
    dtype: FloatDType,
    part: &'a [bool],
    index: usize,
}

impl ModuleMapper for CastPart<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let marked = self.part.get(self.index).copied().unwrap_or(false);
        self.index += 1;
        match marked {
            true => {
                let dtype = self.dtype;
                param.map(|t| t.cast(dtype))
            }
            false => param,
        }
    }
}

/// The running loss scale of one training job: every rank holds one and updates it from the
/// same (globally reduced) overflow flag, so they stay equal.
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    kind: LossScale,
    scale: f32,
    clean_steps: usize,
    skipped: usize,
}

impl LossScaler {
    /// A scaler starting at the policy's initial scale.
    pub fn new(kind: LossScale) -> Self {
        let scale = match kind {
            LossScale::None => 1.0,
            LossScale::Static(s) => s,
            LossScale::Dynamic { initial, .. } => initial,
        };
        LossScaler {
            kind,
            scale,
            clean_steps: 0,
            skipped: 0,
        }
    }

    /// The factor the loss is multiplied by before backward (1 without scaling).
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Whether the loss is scaled at all.
    pub fn is_active(&self) -> bool {
        self.kind != LossScale::None
    }

    /// Steps skipped so far because a gradient overflowed.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// `loss` times the scale, for backward.
    pub fn scale_loss(&self, loss: Tensor<1>) -> Tensor<1> {
        if self.is_active() {
            loss.mul_scalar(self.scale)
        } else {
            loss
        }
    }

    /// After a step's gradients were reduced: `finite` says whether every gradient (on every
    /// rank; the global gradient norm carries that) is finite. Returns whether to apply the
    /// step. An overflow with scaling skips the step (and halves a dynamic scale); without
    /// scaling the step is applied as it would be without a policy.
    pub fn update(&mut self, finite: bool) -> bool {
        match self.kind {
            LossScale::None => true,
            LossScale::Static(_) => {
                if !finite {
                    self.skipped += 1;
                }
                finite
            }
            LossScale::Dynamic {
                growth_interval, ..
            } => {
                if finite {
                    self.clean_steps += 1;
                    if self.clean_steps == growth_interval {
                        self.scale *= 2.0;
                        self.clean_steps = 0;
                    }
                } else {
                    self.scale = (self.scale * 0.5).max(f32::MIN_POSITIVE);
                    self.clean_steps = 0;
                    self.skipped += 1;
                }
                finite
            }
        }
    }

    /// The scale and the count of clean steps, for a checkpoint.
    pub fn state(&self) -> (f32, usize) {
        (self.scale, self.clean_steps)
    }

    /// Restores [`LossScaler::state`].
    pub fn restore(&mut self, (scale, clean_steps): (f32, usize)) {
        self.scale = scale;
        self.clean_steps = clean_steps;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precisions_parse_and_print() {
        for p in [Precision::F32, Precision::BF16, Precision::F16] {
            assert_eq!(p.to_string().parse::<Precision>().unwrap(), p);
        }
        assert_eq!("bfloat16".parse::<Precision>().unwrap(), Precision::BF16);
        let err = "f8".parse::<Precision>().unwrap_err();
        assert!(err.contains("f32, bf16 or f16"), "{err}");
    }

    #[test]
    fn a_dynamic_scale_halves_on_overflow_and_grows_after_clean_steps() {
        let mut s = LossScaler::new(LossScale::Dynamic {
            initial: 1024.0,
            growth_interval: 2,
        });
        assert!(!s.update(false));
        assert_eq!((s.scale(), s.skipped()), (512.0, 1));
        assert!(s.update(true));
        assert_eq!(s.scale(), 512.0);
        assert!(s.update(true));
        assert_eq!(s.scale(), 1024.0);
        // An overflow resets the count of clean steps.
        assert!(s.update(true));
        assert!(!s.update(false));
        assert!(s.update(true));
        assert_eq!(s.scale(), 512.0);
    }

    #[test]
    fn without_scaling_every_step_applies() {
        let mut s = LossScaler::new(LossScale::None);
        assert!(s.update(false));
        assert_eq!((s.scale(), s.skipped()), (1.0, 0));
        let mut fixed = LossScaler::new(LossScale::Static(8.0));
        assert!(!fixed.update(false));
        assert_eq!((fixed.scale(), fixed.skipped()), (8.0, 1));
    }

    #[test]
    fn bad_scales_are_refused() {
        let device = Device::flex();
        let mut p = MixedPrecision::new(Precision::F16);
        p.loss_scale = LossScale::Static(0.0);
        assert!(p.check(&device).is_err());
        p.loss_scale = LossScale::Dynamic {
            initial: 8.0,
            growth_interval: 0,
        };
        assert!(p.check(&device).is_err());
        assert!(MixedPrecision::new(Precision::BF16).check(&device).is_ok());
    }
}
