//! The sharded model: where each parameter of the parallelized model lives, how its parts are
//! gathered back whole, and the fully sharded units a forward gathers one at a time.

use crate::error::ParallelError;
use crate::params::{ParamLayout, ParamSlot, flatten_params, load_shaped, upload};
use crate::placed::WholeReads;
use crate::placement::{ParamPlacement, PlacementTable};
use crate::zero::units::FullyShardedUnits;
use burn::module::Module;
use burn::tensor::Tensor;
use flashover_comm::{Group, ReduceOp};
use flashover_runtime::TensorCollectives;
use std::collections::{BTreeSet, HashSet};

/// What [`super::parallelize`] cut of the model on this rank, and how to put it back together
/// ([`super::Parallelized::sharded`]): every parameter's placement, the parameters other
/// ranks hold, the whole model gathered on every rank, and the fully sharded units.
pub struct ShardedModel {
    pub(super) placements: PlacementTable,
    pub(super) whole_reads: WholeReads,
    /// The fully sharded units (one collective per unit inside
    /// [`super::Parallelized::forward`]).
    pub(super) units: FullyShardedUnits,
    /// The parameters this rank keeps placeholders for (other stages', other ep ranks'
    /// experts), by path.
    pub(super) absent: HashSet<String>,
    /// For a model cut into stages or experts: the parts other ranks hold.
    pub(super) held_elsewhere: Option<HeldElsewhere>,
    /// Parameters under `fully_shard` paths the plan's `keep_whole` leaves whole.
    pub(super) kept_whole: BTreeSet<String>,
}

/// The parts of a model cut into pipeline stages or experts that other ranks hold.
pub(super) struct HeldElsewhere {
    /// The ranks that hold the model's other parts (`pp` x `ep`), which `whole` gathers over.
    pub(super) group: Group,
    /// The whole model's parameters.
    pub(super) whole: ParamLayout,
    /// Per parameter (layout order), whether this rank's value is the one counted when the
    /// whole model is gathered: its stage's and its expert's holder, one rank each.
    pub(super) counted: Vec<bool>,
}

impl ShardedModel {
    /// Where every parameter of the parallelized model lives (for norms, checkpoints).
    pub fn placements(&self) -> &PlacementTable {
        &self.placements
    }

    /// The parameters under the plan's `fully_shard` paths that its `keep_whole` rule leaves
    /// whole, by path: nothing else under those paths is kept whole. (Mixture-of-experts
    /// layers' routed experts are sharded: `expert_parallel::MoeForward` gathers them all
    /// before routing, on every rank.)
    pub fn kept_whole(&self) -> &BTreeSet<String> {
        &self.kept_whole
    }

    /// The parameters of `model` this rank holds (all but other pipeline stages'
    /// placeholders), each with its slot in `model`'s flat layout and its placement: what a
    /// checkpoint saves and restores on this rank.
    pub fn held_entries<'a, M: Module>(
        &'a self,
        model: &M,
    ) -> Result<Vec<(ParamSlot, &'a ParamPlacement)>, ParallelError> {
        Ok(self
            .placements
            .entries_of(model)?
            .into_iter()
            .filter(|(slot, _)| !self.absent.contains(&slot.name))
            .collect())
    }

    /// The whole model on every rank: each split or sharded parameter gathered, each
    /// pipeline stage's parameters from the rank that holds them (collective: every rank
    /// calls it). To read or export the weights, or to evaluate on one rank. The parameters
    /// are new leaves (their gradient requirement kept): nothing differentiates through the
    /// gathers.
    pub fn whole<M: Module>(&self, model: M) -> Result<M, ParallelError> {
        let model = {
            let _allowed = self.whole_reads.allow();
            model.materialize()
        };
        let Some(elsewhere) = &self.held_elsewhere else {
            return Ok(model);
        };
        let local = ParamLayout::of(&model);
        let Some(device) = model.devices().into_iter().next() else {
            return Ok(model);
        };
        let local_values = flatten_params(&model);
        let values = sum_counted(elsewhere, &local_values, &local, &device.inner())?;
        Ok(load_shaped(model, &elsewhere.whole, &values))
    }

    /// The plan's fully sharded units on this rank, by module path, in the order
    /// [`super::Parallelized::forward`] prefetches them.
    pub fn units(&self) -> &[String] {
        self.units.paths()
    }

    /// The counters of this rank's unit collectives (all-gathers, prefetches, reduce-scatters,
    /// gathered bytes alive and at most), when the plan shards parameters over `fsdp`.
    pub fn unit_stats(&self) -> Option<&crate::zero::GatherStats> {
        self.units.stats()
    }

    /// `f` run with every parameter of the parallelized model reading as what this rank
    /// stores (its shard or split part, a placeholder's zeros) through `Param::val`, with no
    /// collective: for code that records a module's parameters as they are stored, such as
    /// Burn's `Module::into_record` of this rank's part. Not for a forward.
    pub fn with_stored_reads<T>(&self, f: impl FnOnce() -> T) -> T {
        let _stored = self.whole_reads.stored_parts();
        f()
    }
}

/// The whole model's parameter values in `elsewhere.whole`'s layout, from this rank's `local`
/// ones (laid out as `local_layout`, parameter for parameter, each gathered whole over `tp`
/// and `fsdp` already): the parameters this rank counts copied, the rest zero, summed over
/// the ranks that hold the other parts on `device`. Each parameter is counted by exactly one
/// rank of the group (collective).
fn sum_counted(
    elsewhere: &HeldElsewhere,
    local: &[f32],
    local_layout: &ParamLayout,
    device: &burn::tensor::Device,
) -> Result<Tensor<1>, ParallelError> {
    let mut values = vec![0.0; elsewhere.whole.numel];
    let slots = elsewhere.whole.slots.iter().zip(&local_layout.slots);
    for ((slot, here), _) in slots.zip(&elsewhere.counted).filter(|(_, c)| **c) {
        values[slot.offset..slot.offset + slot.numel]
            .copy_from_slice(&local[here.offset..here.offset + here.numel]);
    }
    let values = upload(&values, device);
    match elsewhere.group.size() > 1 {
        true => Ok(elsewhere.group.all_reduce_tensor(values, ReduceOp::Sum)?),
        false => Ok(values),
    }
}
