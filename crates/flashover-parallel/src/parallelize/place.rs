//! Placing a model's parameters as a plan says: each parameter cut to this rank's part and
//! given its [`Placed`] record (`crate::placed`), and the buffers a plan keeps whole.

use crate::error::ParallelError;
use crate::placed::{ContextSplit, Elsewhere, ExpertSplit, Placed, RowShard, TpSplit, WholeReads};
use crate::placement::PlacementTable;
use crate::plan::{ParallelizePlan, TpStyle};
use crate::tensor_parallel::split_dim;
use crate::zero::units::UnitGathers;
use burn::module::{Module, ModuleVisitor, Param, ParamId, Reparameterization, Reparameterizer};
use burn::tensor::Tensor;
use flashover_comm::Group;
use flashover_runtime::{Axis, CommStream};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

/// A reparameterization that changes nothing: [`buffers`] attaches it everywhere to see which
/// module tensors keep it.
#[derive(Module, Debug)]
struct Probe {
    #[module(skip)]
    _mark: (),
}

impl Reparameterization for Probe {
    const NAME: &'static str = "probe";

    fn apply<const D: usize>(&self, base: Tensor<D>) -> Tensor<D> {
        base
    }
}

/// The ids of `model`'s module tensors that cannot carry a reparameterization: Burn's
/// `RunningState` (buffers, such as BatchNorm's running statistics), which drops one and is
/// read without `Param::val`, so nothing could gather a shard of it back. A plan keeps them
/// whole (as FSDP shards parameters, not buffers).
pub(super) fn buffers<M: Module>(model: &M) -> HashSet<ParamId> {
    struct ProbeAll;
    impl Reparameterizer for ProbeAll {
        type Reparam = Probe;

        fn reparameterize<const D: usize>(
            &mut self,
            _path: &str,
            param: Param<Tensor<D>>,
        ) -> (Param<Tensor<D>>, Option<Probe>) {
            (param, Some(Probe { _mark: () }))
        }
    }
    // Burn visits a parameter's base, then enters its reparameterization as a module of that
    // container type: a tensor followed by no probe lost it.
    #[derive(Default)]
    struct Unmarked {
        last: Option<ParamId>,
        buffers: HashSet<ParamId>,
    }
    impl ModuleVisitor for Unmarked {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.buffers.insert(param.id);
            self.last = Some(param.id);
        }

        fn enter_module(&mut self, name: &str, container_type: &str) {
            if container_type == "Reparameterization"
                && name == Probe::NAME
                && let Some(id) = self.last.take()
            {
                self.buffers.remove(&id);
            }
        }
    }
    let mut unmarked = Unmarked::default();
    model
        .clone()
        .apply_reparameterization(ProbeAll)
        .visit(&mut unmarked);
    unmarked.buffers
}

/// Rows `rank * chunk .. (rank + 1) * chunk` of `t`'s first dimension, `chunk = ceil(rows /
/// n)`, zero rows past the end (so every rank's shard has the same shape).
fn own_rows<const D: usize>(t: Tensor<D>, rank: usize, n: usize) -> Tensor<D> {
    let rows = t.dims()[0];
    let chunk = rows.div_ceil(n);
    let start = (rank * chunk).min(rows);
    let end = ((rank + 1) * chunk).min(rows);
    let mut dims = t.dims();
    let mut parts = vec![];
    if end > start {
        parts.push(t.clone().narrow(0, start, end - start));
    }
    if end - start < chunk {
        dims[0] = chunk - (end - start);
        parts.push(Tensor::zeros(dims, &t.device()));
    }
    Tensor::cat(parts, 0)
}

/// Cuts every parameter the plan moves to this rank's part, `tp` split first, then `fsdp`
/// rows of what is left, and records each cut in `placements`. The plan was checked against
/// the model first (widths divide, paths name linear layers).
pub(super) struct PlaceParams<'a> {
    pub(super) plan: &'a ParallelizePlan,
    pub(super) fsdp: Group,
    pub(super) tp: Group,
    /// The `tp` group's communication stream (none for a group of one).
    pub(super) tp_stream: Option<Arc<CommStream>>,
    /// The sequence split, when the plan splits sequences over `cp` on this mesh.
    pub(super) context: Option<&'a ContextSplit>,
    /// Per router parameter path of an `expert_parallel` layer, its experts' split.
    pub(super) routers: &'a HashMap<String, ExpertSplit>,
    /// Router parameter paths of every mixture-of-experts layer (they route whole sequences).
    pub(super) all_routers: &'a HashSet<String>,
    pub(super) placements: &'a mut PlacementTable,
    pub(super) whole_reads: WholeReads,
    pub(super) units: UnitGathers,
    /// Parameters other ranks hold (placeholders here), by path, and why: reading them panics.
    pub(super) absent: &'a HashMap<String, Elsewhere>,
    /// Parameters the plan's `keep_whole` leaves whole inside `fully_shard` paths, by path.
    pub(super) kept_whole: &'a BTreeSet<String>,
    /// Module tensors that are buffers ([`buffers`]): never sharded.
    pub(super) buffers: &'a HashSet<ParamId>,
    /// The parameters marked as running on sequence shards, as they are placed.
    pub(super) sequence_partials: &'a mut HashSet<burn::module::ParamId>,
    pub(super) error: &'a mut Option<ParallelError>,
}

impl PlaceParams<'_> {
    /// Whether the parameter at `path` is in a `sequence_split_stacks` stack.
    fn in_stack(&self, path: &str) -> bool {
        (self.plan.sequence_split_stacks.iter()).any(|p| p.contains(path))
    }

    /// Whether the plan runs sequence parallelism on this mesh.
    fn sequence_parallel(&self) -> bool {
        self.tp.size() > 1 && !self.plan.sequence_parallel.is_empty()
    }

    /// Whether a whole parameter sees only this rank's positions under sequence parallelism:
    /// one of a `sequence_parallel` module's, or a row-wise layer's bias (added after the
    /// reduce-scatter).
    fn sequence_partial<const D: usize>(&self, path: &str) -> bool {
        let rowwise_bias = D == 1
            && self
                .plan
                .tp_rule(path)
                .is_some_and(|(rule, _)| rule.style == TpStyle::Rowwise);
        let in_region = self.plan.sequence_parallel.iter().any(|p| p.contains(path));
        self.sequence_parallel() && (rowwise_bias || in_region)
    }

    /// The dimension of a `D`-dimensional parameter of a linear layer the plan splits over
    /// `tp`: a column-wise layer's weight `[d_in, d_out]` by columns and its bias with them; a
    /// row-wise layer's weight by rows, its bias whole (added once, after the sum).
    fn tp_dim<const D: usize>(&self, path: &str) -> Option<(TpStyle, usize)> {
        if self.tp.size() == 1 {
            return None;
        }
        let (rule, _) = self.plan.tp_rule(path)?;
        match (rule.style, D) {
            (TpStyle::Colwise, 2) => Some((TpStyle::Colwise, 1)),
            (TpStyle::Colwise, 1) => Some((TpStyle::Colwise, 0)),
            (TpStyle::Rowwise, 2) => Some((TpStyle::Rowwise, 0)),
            (TpStyle::Vocab, 2) => Some((TpStyle::Vocab, 0)),
            _ => None,
        }
    }
}

/// `t` as a new leaf with `t`'s gradient requirement.
fn leaf<const D: usize>(t: Tensor<D>, f: impl FnOnce(Tensor<D>) -> Tensor<D>) -> Tensor<D> {
    let require_grad = t.is_require_grad();
    f(t.detach()).detach().set_require_grad(require_grad)
}

impl Reparameterizer for PlaceParams<'_> {
    type Reparam = Placed;

    fn reparameterize<const D: usize>(
        &mut self,
        path: &str,
        param: Param<Tensor<D>>,
    ) -> (Param<Tensor<D>>, Option<Placed>) {
        let path = path
            .split('.')
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join(".");
        if let Some(&why) = self.absent.get(&path) {
            let placeholder = Placed {
                name: path,
                fsdp: None,
                tp: None,
                held_elsewhere: Some(why),
                sequence_partial: None,
                context: None,
                experts: None,
                sequence_tp: None,
                whole_reads: self.whole_reads.clone(),
                units: self.units.clone(),
            };
            return (param, Some(placeholder));
        }
        let tp = self.tp_dim::<D>(&path);
        let sequence_partial = self.sequence_partial::<D>(&path).then(|| self.tp.clone());
        if sequence_partial.is_some() {
            self.sequence_partials.insert(param.id);
        }
        // A parameter without elements (an attention core's) has no rows to shard; a buffer
        // could not be gathered back.
        let fully_shard = self.fsdp.size() > 1
            && self.plan.shard_path(&path).is_some()
            && !self.kept_whole.contains(&path)
            && !self.buffers.contains(&param.id)
            && param.shape().num_elements() > 0;
        let routes_whole_sequences = self.all_routers.contains(&path);
        // A stack splitting sequences over cp: its layers find the split on their parameters.
        let context = self
            .context
            .filter(|_| {
                self.plan.attention_core(&path) || routes_whole_sequences || self.in_stack(&path)
            })
            .cloned();
        let experts = self.routers.get(&path).cloned();
        let sequence_tp =
            (self.sequence_parallel() && routes_whole_sequences).then(|| self.tp.clone());
        let moved = tp.is_some()
            || fully_shard
            || sequence_partial.is_some()
            || context.is_some()
            || experts.is_some()
            || sequence_tp.is_some();
        if self.error.is_some() || !moved {
            return (param, None);
        }
        let id = param.id;
        let mut param = param;
        let mut split = None;
        if let Some((style, dim)) = tp {
            let (rank, n) = (self.tp.rank(), self.tp.size());
            let padded = self
                .plan
                .tp_rule(&path)
                .is_some_and(|(rule, _)| rule.padded);
            let mut rows = 0;
            param = param.map(|t| {
                rows = t.dims()[dim];
                leaf(t, |t| match style {
                    // Padded to ceil(vocab / tp) rows, as `VocabShard` numbers them.
                    TpStyle::Vocab => own_rows(t, rank, n),
                    // A padded output head: its columns, padded the same way.
                    _ if padded && D == 1 => own_rows(t, rank, n),
                    _ if padded => own_rows(t.swap_dims(0, 1), rank, n).swap_dims(0, 1),
                    _ => {
                        split_dim(&t, dim, rank, n).expect("the plan was checked against the model")
                    }
                })
            });
            let local = param.val().dims().to_vec();
            if let Err(e) = self.placements.shard(id, id, Axis::Tp, dim, &local) {
                *self.error = Some(e);
            }
            split = Some(TpSplit {
                style,
                dim,
                sequence_parallel: self.sequence_parallel(),
                in_splitting_stack: self.sequence_parallel() && self.in_stack(&path),
                rows,
                group: self.tp.clone(),
                stream: self.tp_stream.clone(),
            });
        }
        let mut rows = None;
        if fully_shard {
            let (rank, n) = (self.fsdp.rank(), self.fsdp.size());
            param = param.map(|t| {
                rows = Some(RowShard {
                    group: self.fsdp.clone(),
                    rows: t.dims()[0],
                });
                leaf(t, |t| own_rows(t, rank, n))
            });
            let local = param.val().dims().to_vec();
            if let Err(e) = self.placements.shard(id, id, Axis::Fsdp, 0, &local) {
                *self.error = Some(e);
            }
        }
        let placed = Placed {
            name: path,
            fsdp: rows,
            tp: split,
            held_elsewhere: None,
            sequence_partial,
            context,
            experts,
            sequence_tp,
            whole_reads: self.whole_reads.clone(),
            units: self.units.clone(),
        };
        (param, Some(placed))
    }
}
