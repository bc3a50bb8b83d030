//! Hot-expert replication: before each step, the experts that received the most tokens in the
//! previous step (per layer, from the global loads every rank holds alike) are copied from their
//! owners to every rank of the ep group. Each rank then keeps its own tokens for those experts
//! and runs them on its copy, so the hottest experts neither draw traffic nor pile work on one
//! rank. After backward the copies' gradients are summed over the group and added to the owner's
//! expert, which steps as usual; the next step copies the new weights. The result is the
//! unreplicated computation, with gradients summed in another order.

use super::ExpertParallel;
use crate::error::ParallelError;
use crate::params::{accumulate_grads, flatten_params};
use burn::module::{Module, Param, ParamId};
use burn::nn::Linear;
use burn::optim::GradientsParams;
use burn::tensor::Gradients;
use burn::tensor::{Tensor, TensorData};
use flashover_comm::{CommunicatorExt, ReduceOp};
use flashover_models::{Block, SwiGlu};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// This step's expert copies, shared by an [`ExpertParallel`] and its clones.
#[derive(Debug, Clone, Default)]
pub struct Replicas(Arc<Mutex<ReplicaState>>);

#[derive(Debug, Default)]
struct ReplicaState {
    /// Per layer (keyed by its router's parameter): this step's hot experts, ascending, and
    /// their copies.
    layers: HashMap<ParamId, (Vec<usize>, Vec<SwiGlu>)>,
    /// Per layer: assignments per expert in the last step, over the global batch.
    loads: HashMap<ParamId, Vec<u64>>,
    /// Per layer: the copies' gradients summed over the step's micro-batches, in hot order.
    grads: HashMap<ParamId, Vec<f32>>,
}

impl Replicas {
    fn state(&self) -> std::sync::MutexGuard<'_, ReplicaState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The hot experts of the layer whose router is `router` and their copies (none if the
    /// layer replicates nothing this step).
    pub(crate) fn layer(&self, router: ParamId) -> (Vec<usize>, Vec<SwiGlu>) {
        self.state()
            .layers
            .get(&router)
            .cloned()
            .unwrap_or_default()
    }
}

/// A copy of `template`'s shape holding `flat`, as new parameters (new ids: the copy's
/// gradients must not mix with the owner's), trainable where the template's are.
pub(super) fn fresh_copy(template: &SwiGlu, flat: &[f32]) -> SwiGlu {
    let mut at = 0;
    let mut linear = |l: &Linear| {
        let w = l.weight.val();
        let (dims, device) = (w.dims(), w.device());
        let n = dims[0] * dims[1];
        let t = Tensor::<2>::from_data(TensorData::new(flat[at..at + n].to_vec(), dims), &device);
        at += n;
        let t = match w.is_require_grad() {
            true => t.require_grad(),
            false => t,
        };
        Linear {
            weight: Param::from_tensor(t),
            bias: None,
        }
    };
    SwiGlu {
        w_gate: linear(&template.w_gate),
        w_up: linear(&template.w_up),
        w_down: linear(&template.w_down),
    }
}

impl ExpertParallel {
    /// Before a step's forwards: in every MoE layer of `blocks`, copies the `n` experts that
    /// took the most assignments last step (ties: lower index) from their owners to every rank
    /// (one broadcast each; collective). The first step, with no loads yet, copies none; nor
    /// does a group of one.
    pub fn replicate_hot(&self, blocks: &[Block], n: usize) -> Result<(), ParallelError> {
        let mut state = self.replicas.state();
        state.layers.clear();
        state.grads.clear();
        // One rank holds every expert already.
        if n == 0 || self.group.size() == 1 {
            return Ok(());
        }
        let me = self.group.rank();
        for moe in blocks.iter().filter_map(|b| b.moe.as_ref()) {
            let id = moe.router.weight.id;
            let Some(loads) = state.loads.get(&id) else {
                continue;
            };
            let mut by_load: Vec<usize> = (0..self.n_experts).collect();
            by_load.sort_by(|&a, &b| loads[b].cmp(&loads[a]).then(a.cmp(&b)));
            let mut hot = by_load[..n.min(self.n_experts)].to_vec();
            hot.sort_unstable();
            let template = &moe.experts[0];
            let len = template.num_params();
            let mut copies = Vec::with_capacity(hot.len());
            for &x in &hot {
                let owner = x / self.per_rank();
                let mut weights = if owner == me {
                    flatten_params(&moe.experts[x - moe.first_expert])
                } else {
                    vec![0.0; len]
                };
                self.group.broadcast(&mut weights, owner)?;
                copies.push(fresh_copy(template, &weights));
            }
            state.layers.insert(id, (hot, copies));
        }
        Ok(())
    }

    /// After a micro-batch's backward: moves the copies' gradients out of `grads` (before the
    /// model's are read) into the step's sums.
    pub fn take_replica_grads(&self, grads: &mut Gradients) {
        let mut state = self.replicas.state();
        let ReplicaState {
            layers,
            grads: sums,
            ..
        } = &mut *state;
        for (id, (_, copies)) in layers.iter() {
            let Some(len) = copies.first().map(Module::num_params) else {
                continue;
            };
            let sum = sums
                .entry(*id)
                .or_insert_with(|| vec![0.0; len * copies.len()]);
            for (i, copy) in copies.iter().enumerate() {
                let g = GradientsParams::from_module(grads, copy);
                accumulate_grads(copy, &g, &mut sum[i * len..(i + 1) * len], &[]);
            }
        }
    }

    /// After the step's backwards: sums every rank's copy gradients over the group (one
    /// all-reduce per layer; collective) and adds them to the owners' experts in `flat`, the
    /// flat gradient of `model` whose blocks are `blocks`.
    pub fn fold_replica_grads<M: Module>(
        &self,
        model: &M,
        blocks: &[Block],
        flat: &mut [f32],
    ) -> Result<(), ParallelError> {
        let mut state = self.replicas.state();
        let me = self.group.rank();
        for moe in blocks.iter().filter_map(|b| b.moe.as_ref()) {
            let id = moe.router.weight.id;
            let Some((hot, len)) = state
                .layers
                .get(&id)
                .and_then(|(hot, copies)| Some((hot.clone(), copies.first()?.num_params())))
            else {
                continue;
            };
            let mut sums = state
                .grads
                .remove(&id)
                .unwrap_or_else(|| vec![0.0; len * hot.len()]);
            self.group.all_reduce(&mut sums, ReduceOp::Sum)?;
            let mut owned = GradientsParams::new();
            for (i, &x) in hot.iter().enumerate() {
                if x / self.per_rank() != me {
                    continue;
                }
                let expert = &moe.experts[x - moe.first_expert];
                let mut at = i * len;
                for linear in [&expert.w_gate, &expert.w_up, &expert.w_down] {
                    let w = linear.weight.val();
                    let dims = w.dims();
                    let n = dims[0] * dims[1];
                    let data = TensorData::new(sums[at..at + n].to_vec(), dims);
                    owned.register::<2>(linear.weight.id, Tensor::from_data(data, &w.device()));
                    at += n;
                }
            }
            if !owned.is_empty() {
                accumulate_grads(model, &owned, flat, &[]);
            }
        }
        Ok(())
    }

    /// After a step: the assignments per expert of each MoE layer of `blocks` over the global
    /// batch (the same on every rank), from which the next step's hot experts are chosen.
    pub fn record_loads(&self, blocks: &[Block], routed: &[Vec<u64>]) {
        let mut state = self.replicas.state();
        for (moe, loads) in blocks.iter().filter_map(|b| b.moe.as_ref()).zip(routed) {
            state.loads.insert(moe.router.weight.id, loads.clone());
        }
    }
}
