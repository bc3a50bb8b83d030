//! AdamW on a flat f32 slice: the optimizer a sharded strategy (ZeRO) runs on the shard of the
//! flattened parameters each rank owns.
//!
//! The arithmetic follows Burn 0.22.1's `AdamW` operation for operation (moments, bias
//! correction with `powi`, `m / (sqrt(v) + eps)`, decoupled decay `x * (1 - lr * wd)`); on Flex
//! the results are bit-identical to Burn's (tested), so a sharded run can be compared with a
//! single-device run that uses Burn's optimizer.

use burn::config::Config;
use burn::tensor::Tensor;
use flashover_kernels::{AdamWScalars, adamw_step};
use std::borrow::Cow;

/// Hyper-parameters of [`FlatAdamW`], with Burn's `AdamWConfig` defaults.
#[derive(Config, Debug, PartialEq)]
pub struct FlatAdamWConfig {
    /// First-moment decay.
    #[config(default = 0.9)]
    pub beta_1: f32,
    /// Second-moment decay.
    #[config(default = 0.999)]
    pub beta_2: f32,
    /// Added to the root of the second moment.
    #[config(default = 1e-5)]
    pub epsilon: f32,
    /// Decoupled weight decay.
    #[config(default = 1e-4)]
    pub weight_decay: f32,
}

impl FlatAdamWConfig {
    /// The same hyper-parameters as a Burn `AdamWConfig`, for the single-device reference.
    pub fn to_burn(&self) -> burn::optim::AdamWConfig {
        burn::optim::AdamWConfig::new()
            .with_beta_1(self.beta_1)
            .with_beta_2(self.beta_2)
            .with_epsilon(self.epsilon)
            .with_weight_decay(self.weight_decay)
    }
}

/// AdamW moments for one contiguous slice of parameters.
///
/// The moments live on the host, or, once [`FlatAdamW::step_on_device`] has run, on the
/// parameters' device (the fused AdamW kernel's state); [`FlatAdamW::moments`] reads them back
/// either way, and a host step first brings them home.
#[derive(Debug, Clone)]
pub struct FlatAdamW {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
    /// Steps taken (0 before the first).
    time: i32,
    moment_1: Vec<f32>,
    moment_2: Vec<f32>,
    /// The moments on the device, when the last step ran there (the host ones are then stale).
    on_device: Option<(Tensor<1>, Tensor<1>)>,
}

impl FlatAdamW {
    /// Zero moments for `len` parameters.
    pub fn new(config: &FlatAdamWConfig, len: usize) -> Self {
        FlatAdamW {
            beta_1: config.beta_1,
            beta_2: config.beta_2,
            epsilon: config.epsilon,
            weight_decay: config.weight_decay,
            time: 0,
            moment_1: vec![0.0; len],
            moment_2: vec![0.0; len],
            on_device: None,
        }
    }

    /// The first and second moments (read back from the device where they live there).
    pub fn moments(&self) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        match &self.on_device {
            Some((m, v)) => (
                Cow::Owned(crate::params::to_f32(m.clone())),
                Cow::Owned(crate::params::to_f32(v.clone())),
            ),
            None => (Cow::Borrowed(&self.moment_1), Cow::Borrowed(&self.moment_2)),
        }
    }

    /// Brings device moments back to the host (before a host step).
    fn moments_home(&mut self) {
        if let Some((m, v)) = self.on_device.take() {
            self.moment_1 = crate::params::to_f32(m);
            self.moment_2 = crate::params::to_f32(v);
        }
    }

    /// Steps taken so far (what bias correction depends on).
    pub fn steps_taken(&self) -> i32 {
        self.time
    }

    /// Restores a saved state: the step count and both moments (of this optimizer's length).
    pub fn restore(
        &mut self,
        steps_taken: i32,
        moment_1: Vec<f32>,
        moment_2: Vec<f32>,
    ) -> Result<(), String> {
        if moment_1.len() != self.moment_1.len() || moment_2.len() != self.moment_2.len() {
            return Err(format!(
                "restoring AdamW state of {}/{} elements into one of {}",
                moment_1.len(),
                moment_2.len(),
                self.moment_1.len()
            ));
        }
        self.time = steps_taken;
        self.on_device = None;
        self.moment_1 = moment_1;
        self.moment_2 = moment_2;
        Ok(())
    }

    /// Bytes of optimizer state held (two f32 moments per parameter).
    pub fn state_bytes(&self) -> usize {
        (self.moment_1.len() + self.moment_2.len()) * 4
    }

    /// One step: updates `params` in place from `grads` (same length as the moments).
    pub fn step(&mut self, lr: f64, params: &mut [f32], grads: &[f32]) {
        self.moments_home();
        assert_eq!(params.len(), self.moment_1.len(), "parameter slice length");
        assert_eq!(grads.len(), self.moment_1.len(), "gradient slice length");
        let (b1, b2) = (self.beta_1, self.beta_2);
        let (f1, f2) = (1.0 - b1, 1.0 - b2);
        let first = self.time == 0;
        self.time += 1;
        let c1 = 1f32 - b1.powi(self.time);
        let c2 = 1f32 - b2.powi(self.time);
        let decay = (1.0 - lr * self.weight_decay as f64) as f32;
        let decays = lr * self.weight_decay as f64 != 0.0;
        let k = Kernel {
            b1,
            b2,
            f1,
            f2,
            c1,
            c2,
            epsilon: self.epsilon,
            decay,
            lr: lr as f32,
        };
        let (m, v) = (&mut self.moment_1[..], &mut self.moment_2[..]);
        // The branches are decided once per step, so the element loop has none and vectorizes
        // (IEEE division and square root are exact in SIMD too: results stay bit-identical).
        match (first, decays) {
            (true, true) => k.run::<true, true>(params, grads, m, v),
            (true, false) => k.run::<true, false>(params, grads, m, v),
            (false, true) => k.run::<false, true>(params, grads, m, v),
            (false, false) => k.run::<false, false>(params, grads, m, v),
        }
    }
}

impl FlatAdamW {
    /// One step with the fused AdamW kernel on the parameters' device (CubeCL): `params` and
    /// `grads` are flat f32 tensors there; the moments move there on the first such step and
    /// stay. Returns the updated parameters. The same arithmetic as [`FlatAdamW::step`].
    pub fn step_on_device(&mut self, lr: f64, params: Tensor<1>, grads: Tensor<1>) -> Tensor<1> {
        assert_eq!(params.dims()[0], self.moment_1.len(), "parameter length");
        assert_eq!(grads.dims()[0], self.moment_1.len(), "gradient length");
        let (m, v) = match self.on_device.take() {
            Some(moments) => moments,
            // Before the first step the moments are zero: made there, not uploaded.
            None if self.time == 0 => {
                let zeros = || Tensor::zeros([self.moment_1.len()], &params.device());
                (zeros(), zeros())
            }
            None => {
                let device = params.device();
                let upload = |values: &[f32]| crate::params::upload(values, &device);
                (upload(&self.moment_1), upload(&self.moment_2))
            }
        };
        self.time += 1;
        let scalars = AdamWScalars {
            lr: lr as f32,
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            epsilon: self.epsilon,
            weight_decay: self.weight_decay,
            time: self.time,
        };
        let (params, m, v) = adamw_step(params, grads, m, v, scalars);
        self.on_device = Some((m, v));
        params
    }
}

impl FlatAdamW {
    /// One step of `params` with `grads` (flat f32 tensors of this optimizer's length on one
    /// device); returns the updated parameters. Where the strategies use the kernels
    /// (`flashover_kernels::uses_kernels`) the fused kernel steps them there
    /// ([`Self::step_on_device`]); elsewhere (a CPU, where host loops measured faster) the
    /// host loop runs on their values, read and written back as flat vectors.
    pub fn step_tensor(&mut self, lr: f64, params: Tensor<1>, grads: Tensor<1>) -> Tensor<1> {
        let device = params.device();
        if flashover_kernels::uses_kernels(&device) {
            return self.step_on_device(lr, params, grads);
        }
        let mut values = crate::params::to_f32(params);
        self.step(lr, &mut values, &crate::params::to_f32(grads));
        crate::params::upload(&values, &device)
    }
}

/// One step's constants.
struct Kernel {
    b1: f32,
    b2: f32,
    f1: f32,
    f2: f32,
    c1: f32,
    c2: f32,
    epsilon: f32,
    decay: f32,
    lr: f32,
}

impl Kernel {
    #[inline(always)]
    fn run<const FIRST: bool, const DECAY: bool>(
        &self,
        params: &mut [f32],
        grads: &[f32],
        moment_1: &mut [f32],
        moment_2: &mut [f32],
    ) {
        for (((x, &g), m), v) in params
            .iter_mut()
            .zip(grads)
            .zip(moment_1.iter_mut())
            .zip(moment_2.iter_mut())
        {
            if FIRST {
                *m = g * self.f1;
                *v = (g * g) * self.f2;
            } else {
                *m = *m * self.b1 + g * self.f1;
                *v = *v * self.b2 + (g * g) * self.f2;
            }
            let delta = (*m / self.c1) / ((*v / self.c2).sqrt() + self.epsilon);
            let decayed = if DECAY { *x * self.decay } else { *x };
            *x = decayed - delta * self.lr;
        }
    }
}

/// AdamW over every float parameter of a module, as one flat vector in layout order
/// ([`crate::params::ParamLayout`]): the replicated strategies' optimizer. Equal to Burn's
/// `AdamW` bit for bit on Flex, with its state in the open, so checkpoints can save and reshard
/// it.
#[derive(Debug, Clone)]
pub struct ModuleAdamW {
    adam: FlatAdamW,
}

impl ModuleAdamW {
    /// Zero moments for `module`'s parameters.
    pub fn new<M: burn::module::Module>(config: &FlatAdamWConfig, module: &M) -> Self {
        let numel = crate::params::ParamLayout::of(module).numel;
        ModuleAdamW {
            adam: FlatAdamW::new(config, numel),
        }
    }

    /// One step of `module` with `grads`. Every parameter must have a gradient (Burn's AdamW
    /// would leave one without untouched; here that is refused rather than silently differing).
    pub fn step<M: burn::module::Module>(
        &mut self,
        lr: f64,
        module: M,
        grads: &burn::optim::GradientsParams,
    ) -> Result<M, crate::ParallelError> {
        // Where the kernels run, with every gradient there: pack both on the device.
        if let Some(params) = crate::params::pack_params(&module)
            && let Some(flat_grads) = crate::params::pack_grads(&module, grads)
        {
            let params = self.adam.step_on_device(lr, params, flat_grads);
            return Ok(crate::params::load_packed(module, params));
        }
        let Some(device) = module.devices().into_iter().next() else {
            return Ok(module);
        };
        let zeros = crate::params::zero_grads(&module, &device.inner());
        let (flat_grads, found) = crate::params::accumulate_grads(&module, grads, zeros, &[]);
        if let Some(i) = found.iter().position(|f| !f) {
            // Names are only needed for the error: no layout is built on the step's path.
            let layout = crate::params::ParamLayout::of(&module);
            return Err(crate::ParallelError::Invalid(format!(
                "parameter `{}` has no gradient for the optimizer step",
                layout.slots[i].name
            )));
        }
        self.step_flat(lr, module, flat_grads)
    }

    /// One step of `module` with gradients flat in layout order (f32, on the parameters'
    /// device). Where the strategies use the kernels the parameters are packed on the device
    /// and stepped by the fused AdamW kernel, no parameter crossing to the host; elsewhere (a
    /// CPU, where host loops measured faster: `flashover_kernels::uses_kernels`) the loop
    /// above runs on host copies.
    pub fn step_flat<M: burn::module::Module>(
        &mut self,
        lr: f64,
        module: M,
        flat_grads: burn::tensor::Tensor<1>,
    ) -> Result<M, crate::ParallelError> {
        let numel = self.adam.moment_1.len();
        if flat_grads.dims()[0] != numel {
            return Err(crate::ParallelError::Invalid(format!(
                "{} gradient elements for {numel} parameters",
                flat_grads.dims()[0],
            )));
        }
        if let Some(params) = crate::params::pack_params(&module) {
            let params = self.adam.step_on_device(lr, params, flat_grads);
            return Ok(crate::params::load_packed(module, params));
        }
        let mut params = crate::params::flatten_params(&module);
        self.adam
            .step(lr, &mut params, &crate::params::to_f32(flat_grads));
        Ok(crate::params::load_flat(module, &params))
    }

    /// The flat optimizer (moments in layout order, step count).
    pub fn flat(&self) -> &FlatAdamW {
        &self.adam
    }

    /// The flat optimizer, to restore a saved state.
    pub fn flat_mut(&mut self) -> &mut FlatAdamW {
        &mut self.adam
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;
    use burn::nn::Linear;
    use burn::optim::GradientsParams;
    use burn::tensor::{Device, Tensor, TensorData};

    #[test]
    fn flat_adamw_matches_burns_adamw() {
        let device = Device::flex().autodiff();
        let w0: Vec<f32> = (0..12).map(|i| (i as f32 * 0.7).sin()).collect();
        let mut layer = Linear {
            weight: Param::from_data(TensorData::new(w0.clone(), [3, 4]), &device),
            bias: None,
        };
        let config = FlatAdamWConfig::new().with_weight_decay(0.05);
        let mut burn_optim = config.to_burn().init();
        let mut flat = FlatAdamW::new(&config, 12);
        let mut params = w0;
        for step in 0..6 {
            let x: Vec<f32> = (0..6).map(|i| ((i + step) as f32 * 0.3).cos()).collect();
            let x = Tensor::<2>::from_data(TensorData::new(x, [2, 3]), &device);
            let loss = layer.forward(x).powi_scalar(2).mean();
            let grads = GradientsParams::from_grads(loss.backward(), &layer);
            let g: Vec<f32> = grads
                .get::<2>(layer.weight.id)
                .unwrap()
                .into_data()
                .try_to_vec()
                .unwrap();
            let lr = 0.01 * (step + 1) as f64;
            flat.step(lr, &mut params, &g);
            layer = burn_optim.step(lr, layer, grads);
            let burn_params: Vec<f32> = layer.weight.val().into_data().try_to_vec().unwrap();
            let diff = params
                .iter()
                .zip(&burn_params)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert_eq!(
                diff, 0.0,
                "step {step}: flat AdamW must equal Burn's bit for bit"
            );
        }
        assert_eq!(flat.state_bytes(), 96);
    }

    /// The fused kernel on the wgpu device against the host loop, several steps with and
    /// without decay; the moments read back from the device equal the host's.
    #[cfg(feature = "wgpu")]
    #[test]
    fn the_device_step_matches_the_host_step() {
        let device = burn::tensor::Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
        for weight_decay in [0.0, 0.01] {
            let config = FlatAdamWConfig::new().with_weight_decay(weight_decay);
            let n = 1000;
            let (mut host, mut dev) = (FlatAdamW::new(&config, n), FlatAdamW::new(&config, n));
            let mut params: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let upload = |v: &[f32]| crate::params::upload(v, &device);
            let mut on_device = upload(&params);
            for step in 0..4 {
                let grads: Vec<f32> = (0..n).map(|i| ((i + step) as f32 * 0.11).cos()).collect();
                host.step(1e-2, &mut params, &grads);
                on_device = dev.step_on_device(1e-2, on_device, upload(&grads));
            }
            let close = |a: &[f32], b: &[f32], what: &str| {
                for (x, y) in a.iter().zip(b) {
                    assert!(
                        (x - y).abs() <= 1e-6 * y.abs().max(1.0),
                        "{what}: {x} vs {y}"
                    );
                }
            };
            close(&crate::params::to_f32(on_device), &params, "parameters");
            let ((hm, hv), (dm, dv)) = (host.moments(), dev.moments());
            close(&dm, &hm, "first moment");
            close(&dv, &hv, "second moment");
            assert_eq!(dev.steps_taken(), 4);
        }
    }
}
