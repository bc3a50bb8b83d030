//! A plan's mixed precision on one rank ([`super::ParallelizePlan::mixed_precision`]): the
//! policy, the running loss scale, and the checks that a step's forward computed in the
//! policy's dtype and its backward scaled the loss, so that a forward or backward run around
//! [`super::Parallelized`] trains in f32 or unscaled loudly, not silently.

use crate::error::ParallelError;
use crate::grad_clip::GradNorm;
use crate::precision::{LossScale, LossScaler, MixedPrecision, Precision};
use burn::module::Module;
use burn::tensor::{Gradients, Tensor};
use flashover_runtime::transfers::Cause;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A plan's mixed precision on one rank (`Parallelized::precision`): the policy and the
/// running loss scale, and what the step's checks count (see the module docs).
#[derive(Default)]
pub struct PlanPrecision {
    policy: MixedPrecision,
    /// The running loss scale, under a policy that scales the loss (f16).
    scaler: Mutex<Option<LossScaler>>,
    /// Forwards that ran on the compute view since the last reduction.
    forwards: AtomicUsize,
    /// Backwards of a scaled loss since the last reduction.
    backwards: AtomicUsize,
}

impl PlanPrecision {
    pub(super) fn new(policy: MixedPrecision) -> Self {
        PlanPrecision {
            policy,
            scaler: Mutex::new((policy.loss_scale != LossScale::None).then(|| policy.scaler())),
            ..Default::default()
        }
    }

    /// The plan's precision policy (f32 throughout without `mixed_precision`).
    pub fn policy(&self) -> MixedPrecision {
        self.policy
    }

    /// Whether forwards compute in another dtype than f32.
    fn casts(&self) -> bool {
        self.policy.param_dtype != Precision::F32
    }

    /// `model` cast to the compute dtype for one forward, counted for the step's check; `None`
    /// under an f32 policy.
    pub(super) fn forward_view<M: Module>(&self, model: &M) -> Option<M> {
        if !self.casts() {
            return None;
        }
        self.forwards.fetch_add(1, Ordering::Relaxed);
        Some(self.policy.compute_view(model.clone()))
    }

    pub(super) fn scaler(&self) -> std::sync::MutexGuard<'_, Option<LossScaler>> {
        self.scaler.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The loss scale the next step runs with, under a `mixed_precision` that scales the loss.
    pub fn loss_scale(&self) -> Option<f32> {
        self.scaler().as_ref().map(LossScaler::scale)
    }

    /// The running loss scale and its overflow-free steps, under a `mixed_precision` that
    /// scales the loss: what a checkpoint keeps so that a resumed run scales as the
    /// uninterrupted one.
    pub fn loss_scale_state(&self) -> Option<(f32, usize)> {
        self.scaler().as_ref().map(LossScaler::state)
    }

    /// Resumes the running loss scale from [`Self::loss_scale_state`]. Fails without a
    /// policy that scales the loss.
    pub fn restore_loss_scale(&self, state: (f32, usize)) -> Result<(), ParallelError> {
        let mut scaler = self.scaler();
        let scaler = scaler.as_mut().ok_or_else(|| {
            ParallelError::Invalid(
                "no loss scale to restore: the plan's mixed_precision scales no loss".into(),
            )
        })?;
        scaler.restore(state);
        Ok(())
    }

    /// `loss.backward()` of the loss scaled by the running scale (counted for the step's
    /// check), or of `loss` itself without one.
    pub(super) fn backward(&self, loss: Tensor<1>) -> Gradients {
        let scaled = match self.scaler().as_ref() {
            Some(scaler) => {
                self.backwards.fetch_add(1, Ordering::Relaxed);
                scaler.scale_loss(loss)
            }
            None => loss,
        };
        scaled.backward()
    }

    /// Before a step's reduction of gradients that the user's forwards and backwards computed
    /// (not a pipeline's, which computes them itself): fails when the policy computes in
    /// another dtype and no forward ran on its view, or scales the loss and no backward scaled
    /// it, since the last reduction. Returns the scale to divide the gradients by.
    pub(super) fn begin_reduction(&self) -> Result<Option<f32>, ParallelError> {
        let forwards = self.forwards.swap(0, Ordering::Relaxed);
        let backwards = self.backwards.swap(0, Ordering::Relaxed);
        if self.casts() && forwards == 0 {
            return Err(ParallelError::Invalid(format!(
                "the plan computes in {} (mixed_precision), but no forward ran in it this \
                 step: run the forward inside Parallelized::forward, which computes on the \
                 model cast to {}",
                self.policy.param_dtype, self.policy.param_dtype
            )));
        }
        let scale = self.loss_scale();
        if scale.is_some() && backwards == 0 {
            return Err(ParallelError::Invalid(
                "the plan's mixed_precision scales the loss, but no backward scaled it this \
                 step: take the gradients with Parallelized::backward(loss), which scales the \
                 loss before backward (the reduction unscales them)"
                    .into(),
            ));
        }
        Ok(scale)
    }

    /// After a step's gradients were reduced to their global `norm` (the same on every rank):
    /// whether to apply the step. Under loss scaling an overflow (a norm that is not finite)
    /// skips it, and a dynamic scale moves as [`LossScaler::update`] says: the one decision
    /// that reads the norm to the host before the optimizer step (counted as a loss-scale
    /// read); without loss scaling nothing is read.
    pub(super) fn apply(&self, norm: &GradNorm) -> bool {
        self.scaler()
            .as_mut()
            .is_none_or(|scaler| scaler.update(norm.read(Cause::LossScale).is_finite()))
    }
}

impl super::Parallelized {
    /// `loss.backward()`, with the loss first scaled by the running loss scale when the plan's
    /// `mixed_precision` scales it (f16): [`Self::gradients`] then unscales the gradients and
    /// skips a step that overflowed. Take every backward of a step with it under such a
    /// plan (the reduction refuses gradients of an unscaled loss there). Under
    /// `replicate_hot_experts` it also takes the hot-expert copies' gradients for the
    /// reduction (which refuses a step whose copies' gradients it did not get).
    pub fn backward(&self, loss: Tensor<1>) -> Gradients {
        let mut grads = self.precision.backward(loss);
        if let Some((replicas, _)) = &self.hot_experts {
            replicas.take_grads(&mut grads);
        }
        grads
    }

    /// The plan's mixed precision on this rank: its policy (f32 throughout without
    /// `mixed_precision`) and its running loss scale.
    pub fn precision(&self) -> &PlanPrecision {
        &self.precision
    }
}
