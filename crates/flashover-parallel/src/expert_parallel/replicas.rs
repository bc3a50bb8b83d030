//! Hot-expert replication (a plan's `replicate_hot_experts`): each step, the experts of a layer
//! that received the most tokens in the previous step are copied from their owners to every
//! rank of the ep group. Each rank then keeps its own tokens for those experts and runs them on
//! its copy, so the hottest experts neither draw traffic nor pile work on one rank. After
//! backward the copies' gradients are summed over the group and added to the owner's expert,
//! which steps as usual; the next step copies the new weights. The result is the unreplicated
//! computation, with gradients summed in another order.
//!
//! The copies are made lazily: a layer's first dispatch of a step (which every `ep` rank runs
//! at the same point: it is a collective) broadcasts the hot experts from the weights the layer
//! computes with, wherever they came from (a pipeline stage, a gathered unit, a compute-dtype
//! view). The dispatch counts this rank's assignments, and the step's fold
//! ([`Replicas::fold`]) sums them over the group with the copies' gradients, so the next
//! step's hot experts are the same on every `ep` rank.

use crate::error::ParallelError;
use crate::moe::Moe;
use crate::moe::SwiGlu;
use crate::nn::Linear;
use crate::params::{accumulate_grads, in_context_of, params_on_device, part, zero_grads};
use burn::module::{Module, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Gradients;
use burn::tensor::Tensor;
use flashover_comm::{CommError, CommunicatorExt, Group, ReduceOp, control};
use flashover_runtime::TensorCollectives;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// This step's hot-expert copies, shared by a plan's `ep` dispatches; the default copies none.
#[derive(Debug, Clone, Default)]
pub struct Replicas(Option<Arc<Mutex<HotCopies>>>);

/// A plan's hot-expert copies: what a step has dispatched, counted, copied and trained so far.
#[derive(Debug, Default)]
struct HotCopies {
    /// Experts copied per layer.
    n: usize,
    /// Per layer (keyed by its router's parameter): assignments per expert in the last step,
    /// summed over the ep group.
    loads: HashMap<ParamId, Vec<u64>>,
    /// This step's layers, in the order of their first dispatch: the same on every `ep`
    /// rank, which is the order their sums are reduced in.
    order: Vec<ParamId>,
    /// Per layer: this rank's assignments per expert this step (a rerun in backward not
    /// counted again).
    counted: HashMap<ParamId, Vec<u64>>,
    /// Per layer: this step's hot experts, ascending, and their weights as their owners
    /// broadcast them (flat, f32, on the device).
    weights: HashMap<ParamId, (Vec<usize>, Vec<Tensor<1>>)>,
    /// Per layer: the copies of experts this rank owns.
    owned: HashMap<ParamId, Vec<OwnedCopy>>,
    /// Per layer: this step's hot experts and their trained copies (shared by every forward
    /// that trains, so their gradients add up).
    trained: HashMap<ParamId, (Vec<usize>, Vec<SwiGlu>)>,
    /// Per layer: each trained copy's gradient summed over the step's backwards (flat, f32,
    /// on the device), in hot order.
    grads: HashMap<ParamId, Vec<Tensor<1>>>,
    /// Whether a backward's gradients were handed to [`Replicas::take_grads`] this step.
    taken: bool,
}

/// A copy of an expert this rank owns: where its gradient goes.
#[derive(Debug)]
struct OwnedCopy {
    /// Its slot among the layer's copies.
    slot: usize,
    /// The owner's weights (id, shape), in the copy's parameter order.
    weights: Vec<(ParamId, [usize; 2])>,
}

impl Replicas {
    /// Whether these are a plan's copies (`replicate_hot_experts`), not the default that
    /// copies none.
    pub(crate) fn is_active(&self) -> bool {
        self.0.is_some()
    }

    /// Copies of the `n` hottest experts of every layer dispatching through it, made lazily
    /// at each step's first dispatch of the layer (a plan's `replicate_hot_experts`).
    pub(crate) fn lazy(n: usize) -> Self {
        let copies = HotCopies {
            n,
            ..HotCopies::default()
        };
        Replicas(Some(Arc::new(Mutex::new(copies))))
    }

    /// The copies' state, when there are copies to make.
    fn state(&self) -> Option<std::sync::MutexGuard<'_, HotCopies>> {
        let state = self.0.as_ref()?;
        Some(state.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The hot experts of `moe` for this step and their copies (none if the layer replicates
    /// nothing this step), `counts` being this dispatch's assignments per expert. The layer's
    /// first dispatch of a step broadcasts them from their owners (one broadcast each,
    /// collective over `group`, whose ranks hold `per_rank` experts each), and every dispatch
    /// but a recomputation's counts its assignments. A forward that trains (its experts
    /// tracked) shares the step's copies, whose gradients the step folds; one that does not
    /// (validation, the untracked first run of a recomputed layer) gets untracked copies of
    /// the same weights.
    pub(crate) fn copies_for(
        &self,
        moe: &Moe,
        group: &Group,
        per_rank: usize,
        counts: &[usize],
    ) -> Result<(Vec<usize>, Vec<SwiGlu>), CommError> {
        let (Some(mut state), Some(template)) = (self.state(), moe.experts.first()) else {
            return Ok(Default::default());
        };
        let state = &mut *state;
        let id = moe.router.weight.id;
        let replay = crate::recompute::replaying();
        if !replay {
            let counted = state.counted.entry(id).or_insert_with(|| {
                state.order.push(id);
                vec![0; counts.len()]
            });
            counted
                .iter_mut()
                .zip(counts)
                .for_each(|(c, &n)| *c += n as u64);
        }
        // Tracked: a parameter or a compute-dtype view of one (a cast is no leaf).
        let trains = template.w_gate.weight.val().is_tracked();
        if trains && replay {
            // Their gradients come out of the recomputation's own backward, not the step's.
            let replicas = self.clone();
            crate::recompute::claim_gradients(Box::new(move |grads| replicas.take_grads(grads)));
        }
        if let Some(made) = state.trained.get(&id).filter(|_| trains) {
            return Ok(made.clone());
        }
        if !state.weights.contains_key(&id) {
            let Some(loads) = state
                .loads
                .get(&id)
                .filter(|_| group.size() > 1 && state.n > 0)
            else {
                return Ok(Default::default());
            };
            let hot = hottest(loads, state.n);
            let me = group.rank();
            let device = template.w_gate.weight.val().device().inner();
            let (mut weights, mut owned) = (vec![], vec![]);
            for (slot, &x) in hot.iter().enumerate() {
                let owner = x / per_rank;
                let flat = if owner == me {
                    let expert = &moe.experts[x - moe.first_expert];
                    let linears = [&expert.w_gate, &expert.w_up, &expert.w_down];
                    let ids = linears.map(|l| (l.weight.id, l.weight.val().dims()));
                    owned.push(OwnedCopy {
                        slot,
                        weights: ids.to_vec(),
                    });
                    params_on_device(expert).expect("an expert has parameters")
                } else {
                    Tensor::zeros([template.num_params()], &device)
                };
                weights.push(group.broadcast_tensor(flat, owner)?);
            }
            state.owned.insert(id, owned);
            state.weights.insert(id, (hot, weights));
        }
        let (hot, weights) = &state.weights[&id];
        let copies: Vec<SwiGlu> = weights.iter().map(|w| fresh_copy(template, w)).collect();
        if trains {
            state.trained.insert(id, (hot.clone(), copies.clone()));
        }
        Ok((hot.clone(), copies))
    }

    /// After a step's backwards: sums every rank's copy gradients and assignments over
    /// `group` (per layer this step dispatched, in dispatch order; collective) and returns the
    /// copies' gradients, times `scale`, as the gradients of the experts this rank owns. The
    /// summed assignments choose each layer's next hot experts. Fails when copies were
    /// trained but no backward's gradients reached [`Self::take_grads`].
    pub(crate) fn fold(&self, group: &Group, scale: f32) -> Result<GradientsParams, ParallelError> {
        let mut folded = GradientsParams::new();
        let Some(mut state) = self.state() else {
            return Ok(folded);
        };
        let state = &mut *state;
        // The step's state ends here, whatever happens below.
        let trained = std::mem::take(&mut state.trained);
        let mut sums_of = std::mem::take(&mut state.grads);
        let taken = std::mem::take(&mut state.taken);
        let order = std::mem::take(&mut state.order);
        let owned = std::mem::take(&mut state.owned);
        let mut counted = std::mem::take(&mut state.counted);
        state.weights.clear();
        if trained.values().any(|(hot, _)| !hot.is_empty()) && !taken {
            return Err(ParallelError::Invalid(
                "hot-expert copies (replicate_hot_experts) trained this step, but no backward \
                 pass handed over their gradients: take the backward with \
                 Parallelized::backward (or reduce with Parallelized::gradients)"
                    .into(),
            ));
        }
        for id in order {
            let mut loads = counted.remove(&id).unwrap_or_default();
            control(|| group.all_reduce(&mut loads, ReduceOp::Sum))?;
            state.loads.insert(id, loads);
            let Some((hot, copies)) = trained.get(&id).filter(|(hot, _)| !hot.is_empty()) else {
                continue;
            };
            let len = copies[0].num_params();
            // The copies live where their owners' weights do.
            let device = copies[0].w_gate.weight.val().device().inner();
            let sums = match sums_of.remove(&id) {
                Some(parts) => Tensor::cat(parts, 0),
                None => Tensor::zeros([len * hot.len()], &device),
            };
            let sums = group.all_reduce_tensor(sums, ReduceOp::Sum)?;
            for copy in owned.get(&id).into_iter().flatten() {
                let mut at = copy.slot * len;
                for (weight, dims) in &copy.weights {
                    let n = dims[0] * dims[1];
                    let g = part(&sums, at, n).mul_scalar(scale).reshape(*dims);
                    folded.register::<2>(*weight, g);
                    at += n;
                }
            }
        }
        Ok(folded)
    }

    /// After a backward: moves the trained copies' gradients out of `grads` (before the
    /// model's are read) into the step's sums.
    pub(crate) fn take_grads(&self, grads: &mut Gradients) {
        let Some(mut state) = self.state() else {
            return;
        };
        let state = &mut *state;
        state.taken = true;
        for (id, (_, copies)) in &state.trained {
            let sums = state.grads.entry(*id).or_default();
            for (i, copy) in copies.iter().enumerate() {
                let g = GradientsParams::from_module(grads, copy);
                let device = copy.w_gate.weight.val().device().inner();
                let (flat, _) = accumulate_grads(copy, &g, zero_grads(copy, &device), &[]);
                match sums.get_mut(i) {
                    Some(sum) => *sum = sum.clone().add(flat),
                    None => sums.push(flat),
                }
            }
        }
    }
}

/// The `n` experts with the most `loads` (ties: lower index), ascending.
fn hottest(loads: &[u64], n: usize) -> Vec<usize> {
    let mut by_load: Vec<usize> = (0..loads.len()).collect();
    by_load.sort_by(|&a, &b| loads[b].cmp(&loads[a]).then(a.cmp(&b)));
    let mut hot = by_load[..n.min(loads.len())].to_vec();
    hot.sort_unstable();
    hot
}

/// A copy of `template`'s shape holding `flat`, as new parameters (new ids: the copy's
/// gradients must not mix with the owner's), trainable where the template's are tracked (a
/// parameter, or a compute-dtype view of one).
fn fresh_copy(template: &SwiGlu, flat: &Tensor<1>) -> SwiGlu {
    let mut at = 0;
    let mut linear = |l: &Linear| {
        let w = l.weight.val();
        let dims = w.dims();
        let n = dims[0] * dims[1];
        let t = in_context_of(part(flat, at, n).reshape(dims), &w);
        at += n;
        let t = match w.is_tracked() {
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
