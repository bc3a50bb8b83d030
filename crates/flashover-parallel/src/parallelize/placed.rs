//! How a plan moves parameters without changing the model: Burn's parameter
//! reparameterization. The stored parameter (its *base*) is this rank's part of the whole
//! tensor, and a [`Placed`] reparameterization attached to it says how to get the value a layer
//! computes with:
//! - **fully sharded** (`fsdp`): the base is this rank's rows of dimension 0, and
//!   [`Param::val`], which every Burn layer calls in its forward, all-gathers them. The gather
//!   is differentiable: its backward reduce-scatters (sums) the gradient over `fsdp`, so each
//!   rank's base receives the gradient of its own rows and any optimizer steps the shard.
//!   Inside [`super::Parallelized::forward`] (and a pipeline's layers) the first read of a
//!   unit's parameter gathers the whole unit in one collective, and the unit's reads take
//!   their part of it (`parallelize::units`).
//! - **tensor parallel** (`tp`): the base is this rank's columns or rows of a linear layer,
//!   and [`crate::nn::Linear`] computes with that part (gathered over `fsdp` first when both
//!   apply), putting the collectives of Megatron's column- and row-parallel layers around it.
//!   `Param::val` would gather it whole, which only [`super::Parallelized::whole`] may do: a
//!   layer that read the whole weight in its forward would silently run unsplit, so
//!   `Param::val` of a tensor-parallel weight panics elsewhere, naming the parameter.
//!
//! Burn's autodiff keeps a gathered weight until its backward has used it (as FSDP's
//! `reshard_after_forward = false`): between steps a rank holds `1/fsdp` of the parameters,
//! gradients and optimizer state, during forward and backward also the gathered parameters.

pub(crate) use super::units::UnitGathers;
use crate::context_parallel::{AttentionWork, ContextParallel, CpAttention, SequenceLayout};
use crate::error::ParallelError;
use crate::placement::PlacementTable;
use crate::plan::{ContextParallelRule, ParallelizePlan, TpStyle};
use crate::tensor_parallel::comm::{copy_to_tp, gather_from_sp, gather_from_tp};
use crate::tensor_parallel::split_dim;
use burn::module::{Module, ModuleVisitor, Param, ParamId, Reparameterization, Reparameterizer};
use burn::tensor::Tensor;
use flashover_comm::Group;
use flashover_runtime::{Axis, CommStream};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

/// The reparameterization of a parameter a plan moved (see the module docs).
#[derive(Module, Debug)]
pub struct Placed {
    /// The parameter's path in the model, for messages.
    #[module(skip)]
    name: String,
    #[module(skip)]
    fsdp: Option<RowShard>,
    #[module(skip)]
    tp: Option<TpSplit>,
    /// A placeholder for a parameter another rank holds (its pipeline stage or its expert).
    #[module(skip)]
    held_elsewhere: Option<Elsewhere>,
    /// Under sequence parallelism, a whole parameter used on this rank's positions only: its
    /// gradient is summed over this `tp` group in backward.
    #[module(skip)]
    sequence_partial: Option<Group>,
    /// An attention core's (or a mixture-of-experts router's) sequence split over `cp`.
    #[module(skip)]
    context: Option<ContextSplit>,
    /// A mixture-of-experts router's: its layer's experts spread over `ep`.
    #[module(skip)]
    experts: Option<ExpertSplit>,
    /// A mixture-of-experts router's under sequence parallelism: the `tp` group over whose
    /// ranks the layer's input sequences are split (the layer routes them whole).
    #[module(skip)]
    sequence_tp: Option<Group>,
    #[module(skip)]
    whole_reads: WholeReads,
    /// Fully sharded parameters gathered ahead of their reads, a layer at a time.
    #[module(skip)]
    units: UnitGathers,
}

/// How a plan splits sequences over the `cp` group, as an attention core
/// ([`crate::nn::CausalAttention`]) reads it.
#[derive(Debug, Clone)]
pub struct ContextSplit {
    /// The `cp` group.
    pub group: Group,
    /// Ring or all-to-all attention.
    pub algorithm: CpAttention,
    /// Two chunks of every sequence per rank (from the start and the end) or one.
    pub load_balance: bool,
    /// The attention of the last sequence length and head count asked for (every core of a
    /// model shares it: building one lays out the sequence, and all-to-all's mask).
    attention: Arc<Mutex<Option<(usize, usize, ContextParallel)>>>,
    /// Attention scores computed by the attentions replaced in `attention` since.
    retired: Arc<std::sync::atomic::AtomicU64>,
}

/// Why a rank keeps a placeholder for a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Elsewhere {
    /// It belongs to another rank's pipeline stage.
    Stage,
    /// It is a routed expert another `ep` rank holds.
    Expert,
}

/// Rows of dimension 0 split over `group`; `rows` of them are real, the rest padding.
#[derive(Debug, Clone)]
struct RowShard {
    group: Group,
    rows: usize,
}

/// A linear layer's parameter split `style`-wise over the `tp` group, along `dim`.
#[derive(Debug, Clone)]
pub struct TpSplit {
    /// Column- or row-wise.
    pub style: TpStyle,
    /// The dimension of this parameter the split cuts.
    pub dim: usize,
    /// Whether activations outside the tensor-parallel regions are split by sequence.
    pub sequence_parallel: bool,
    /// Under sequence parallelism, whether the layer is inside a `sequence_split_stacks`
    /// stack, which splits its whole input by sequence (the layer runs only inside the
    /// stack's forward).
    pub in_splitting_stack: bool,
    /// That dimension's extent in the whole parameter (the vocabulary, for `vocab`).
    pub rows: usize,
    /// The `tp` group.
    pub group: Group,
    /// The group's communication stream, on which a column-wise layer's backward all-reduces
    /// its input's gradient while it computes its weight's (none for a group of one).
    pub stream: Option<Arc<CommStream>>,
}

/// What `Param::val` answers besides the value a layer computes with (one mode per rank,
/// shared by its parameters): while [`super::Parallelized::whole`] runs, tensor-parallel
/// parameters gathered whole; while [`super::Parallelized::with_stored_reads`] runs, every
/// parameter's stored part, untouched.
#[derive(Debug, Clone, Default)]
pub(crate) struct WholeReads(Arc<AtomicU8>);

/// [`WholeReads`] modes (the default, 0, computes: a split parameter's whole read refuses).
const WHOLE: u8 = 1;
const STORED: u8 = 2;

impl WholeReads {
    /// Allows whole reads until the returned guard drops.
    pub(crate) fn allow(&self) -> impl Drop + '_ {
        self.set(WHOLE)
    }

    /// Makes reads answer the stored parts until the returned guard drops.
    pub(crate) fn stored_parts(&self) -> impl Drop + '_ {
        self.set(STORED)
    }

    /// `mode` until the returned guard drops, then the mode before it.
    fn set(&self, mode: u8) -> impl Drop + '_ {
        struct Reset<'a>(&'a AtomicU8, u8);
        impl Drop for Reset<'_> {
            fn drop(&mut self) {
                self.0.store(self.1, Ordering::SeqCst);
            }
        }
        let before = self.0.swap(mode, Ordering::SeqCst);
        Reset(&self.0, before)
    }

    fn allowed(&self) -> bool {
        self.0.load(Ordering::SeqCst) == WHOLE
    }

    fn stored(&self) -> bool {
        self.0.load(Ordering::SeqCst) == STORED
    }
}

/// How a plan spreads a mixture-of-experts layer's routed experts over the `ep` group, as the
/// layer's forward ([`crate::nn::MoeForward`]) reads it from its router.
#[derive(Debug, Clone)]
pub struct ExpertSplit {
    /// The `ep` group.
    pub group: Group,
    /// The layer's routed experts.
    pub n_experts: usize,
    /// Token rows every layer's dispatch sent to other ranks ([`super::Parallelized::expert_rows_sent`]).
    pub(crate) traffic: Arc<crate::expert_parallel::ExpertTraffic>,
    /// The step's hot-expert copies, shared by every layer (none without
    /// `replicate_hot_experts`).
    pub(crate) replicas: crate::expert_parallel::Replicas,
}

impl ContextSplit {
    /// Sequences split over `group` as `rule` says.
    pub(super) fn new(group: &Group, rule: &ContextParallelRule) -> Self {
        ContextSplit {
            group: group.clone(),
            algorithm: rule.algorithm,
            load_balance: rule.load_balance,
            attention: Default::default(),
            retired: Default::default(),
        }
    }

    /// Attention scores this rank has computed across the `cp` ranks so far (every attention
    /// of this split, ring or all-to-all): what shows that the model's attention did reach
    /// the other ranks' positions.
    pub(super) fn attended(&self) -> u64 {
        self.work().score_elements
    }

    /// The attention this rank has computed across the `cp` ranks so far: its scores (every
    /// attention of this split) and the time in the current one's blocks.
    pub(super) fn work(&self) -> AttentionWork {
        let known = self.attention.lock().unwrap_or_else(|p| p.into_inner());
        let current = known
            .as_ref()
            .map(|(_, _, cp)| cp.work())
            .unwrap_or_default();
        AttentionWork {
            score_elements: self.retired.load(Ordering::Relaxed) + current.score_elements,
            compute: current.compute,
        }
    }

    /// The attention over sequences of `seq` positions (`seq / cp` on this rank) with `heads`
    /// heads per rank. Fails naming the sizes when the sequence does not cut evenly or
    /// all-to-all's heads do not divide by `cp`.
    pub fn attention(&self, seq: usize, heads: usize) -> Result<ContextParallel, ParallelError> {
        let mut known = self.attention.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((s, h, cp)) = known.as_ref()
            && (*s, *h) == (seq, heads)
        {
            return Ok(cp.clone());
        }
        let cp = ContextParallel::new(&self.group, seq, self.algorithm, self.load_balance, heads)?;
        if let Some((_, _, replaced)) = known.replace((seq, heads, cp.clone())) {
            let work = replaced.work().score_elements;
            self.retired.fetch_add(work, Ordering::Relaxed);
        }
        Ok(cp)
    }

    /// Counts `scores` attention scores computed across the `cp` ranks outside this split's
    /// own attentions (a sequence-splitting stack's all-to-all attention).
    pub(crate) fn count_scores(&self, scores: u64) {
        self.retired.fetch_add(scores, Ordering::Relaxed);
    }

    /// Which positions of a `seq`-long sequence each rank holds (fails naming the sizes when
    /// it does not cut evenly).
    pub fn layout(&self, seq: usize) -> Result<SequenceLayout, ParallelError> {
        SequenceLayout::new(seq, self.group.size(), self.load_balance)
    }
}

impl Placed {
    /// The parameter's path in the model.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The `fsdp` group the parameter's rows are sharded over, when it is fully sharded.
    pub(crate) fn fsdp_group(&self) -> Option<&Group> {
        self.fsdp.as_ref().map(|shard| &shard.group)
    }

    /// Where this rank's fully sharded parameters gathered ahead of their reads are kept.
    pub(crate) fn unit_gathers(&self) -> &UnitGathers {
        &self.units
    }

    /// How the parameter is split over `tp`, if it is.
    pub fn tp(&self) -> Option<&TpSplit> {
        self.tp.as_ref()
    }

    /// How sequences are split over `cp`, when this is an attention core's parameter (or a
    /// mixture-of-experts router's).
    pub fn context(&self) -> Option<&ContextSplit> {
        self.context.as_ref()
    }

    /// How a mixture-of-experts layer's experts are spread over `ep`, when this is its
    /// router's parameter.
    pub fn experts(&self) -> Option<&ExpertSplit> {
        self.experts.as_ref()
    }

    /// The `tp` group whose ranks hold parts of a mixture-of-experts layer's input sequences
    /// under sequence parallelism, when this is the layer's router's parameter.
    pub fn sequence_tp(&self) -> Option<&Group> {
        self.sequence_tp.as_ref()
    }

    /// The shape of this rank's `tp` part ([`Self::local`]) of a parameter stored as `stored`.
    pub fn local_dims<const D: usize>(&self, stored: [usize; D]) -> [usize; D] {
        let mut dims = stored;
        if let Some(shard) = &self.fsdp {
            dims[0] = shard.rows;
        }
        dims
    }

    /// This rank's `tp` part of the parameter from its stored `base`: gathered over `fsdp`
    /// (differentiably) when it is fully sharded.
    pub fn local<const D: usize>(&self, base: Tensor<D>) -> Tensor<D> {
        let value = match &self.fsdp {
            None => base,
            Some(shard) => {
                let whole = match self.units.get(&self.name) {
                    // Gathered with the rest of its layer (rows of every rank, in rank order),
                    // from the stored rows: in a cast view of the model (a compute dtype),
                    // read as the view's dtype, the gradient going back through the cast.
                    Some(flat) => {
                        let mut dims = base.dims();
                        dims[0] *= shard.group.size();
                        let dtype = base.dtype();
                        let whole = flat.reshape(dims);
                        match whole.dtype() == dtype {
                            true => whole,
                            false => whole.cast(dtype),
                        }
                    }
                    None => {
                        // No unit prefetch may be in flight over the group meanwhile.
                        self.units.settle();
                        gather_from_sp(base, 0, &shard.group)
                    }
                };
                if whole.dims()[0] == shard.rows {
                    whole
                } else {
                    whole.narrow(0, 0, shard.rows)
                }
            }
        };
        match &self.sequence_partial {
            // Identity forward; backward sums the rank's partial gradient over `tp`.
            Some(tp) => copy_to_tp(value, tp),
            None => value,
        }
    }
}

impl Reparameterization for Placed {
    const NAME: &'static str = "placed";

    fn apply<const D: usize>(&self, base: Tensor<D>) -> Tensor<D> {
        if self.whole_reads.stored() {
            return base;
        }
        match self.held_elsewhere {
            // Gathered by `Parallelized::whole`; read nowhere else.
            _ if self.whole_reads.allowed() && self.held_elsewhere.is_some() => return base,
            Some(Elsewhere::Stage) => panic!(
                "`{}` belongs to a pipeline stage another rank holds (this rank keeps a \
                 placeholder): a model cut into stages trains through \
                 Parallelized::pipeline_step, whose stages read only their own parameters; \
                 if this rank's stage uses it (a head tied to the embedding), name its module \
                 in the pipeline rule's `first` or `last` (both, for a tied one)",
                self.name
            ),
            Some(Elsewhere::Expert) => panic!(
                "`{}` is a routed expert another ep rank holds (this rank keeps a \
                 placeholder): run its layer with flashover::nn::MoeForward::forward, which \
                 sends each token to the rank holding its expert",
                self.name
            ),
            None => {}
        }
        if self.whole_reads.allowed() {
            return self.whole(base);
        }
        let local = self.local(base);
        match &self.tp {
            None => local,
            Some(split) => panic!(
                "`{}` is split {:?} over tp by the parallelize plan, but a layer read it \
                 whole (Param::val): the layers a plan splits must be flashover::nn::Linear \
                 or flashover::nn::Embedding, whose forward computes with this rank's part \
                 (Burn's would run the unsplit layer on every tp rank; a tied head reads the \
                 table through Embedding::logits)",
                self.name, split.style
            ),
        }
    }
}

impl Placed {
    /// The whole parameter from its stored `base`, gathered over `fsdp` and `tp` as values: a
    /// leaf with `base`'s gradient requirement and no autodiff nodes (the gathers' backward
    /// steps hold their groups for as long as the graph keeps them, which, never
    /// backpropagated, is the process's life: under MPI, past the end of the run).
    fn whole<const D: usize>(&self, base: Tensor<D>) -> Tensor<D> {
        let require_grad = base.is_require_grad();
        let strategy = base.gradient_checkpointing_strategy();
        // On the inner backend: a detached autodiff tensor's gathers would still record nodes.
        let local = self.local(base.without_autodiff());
        let whole = match &self.tp {
            None => local,
            // Without the padding a vocabulary split adds.
            Some(split) => {
                gather_from_tp(local, split.dim, &split.group).narrow(split.dim, 0, split.rows)
            }
        };
        match strategy {
            Some(strategy) => whole
                .autodiff()
                .with_gradient_checkpointing_strategy(strategy)
                .set_require_grad(require_grad),
            None => whole,
        }
    }
}

/// How the plan split `param` over `tp`, if it did, without reading its value (which under
/// `fsdp` is a collective).
pub fn tp_split<const D: usize>(param: &Param<Tensor<D>>) -> Option<&TpSplit> {
    param.reparameterization::<Placed>()?.tp()
}

/// The sequence split over `cp` the plan attached to `param`, if it did (an attention core's,
/// or a layer's in a stack that splits sequences over `cp`).
pub(crate) fn context_split<const D: usize>(param: &Param<Tensor<D>>) -> Option<&ContextSplit> {
    param.reparameterization::<Placed>()?.context()
}

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

/// The path the plan placed `param` at, for messages (none for a parameter no plan placed).
pub(crate) fn placed_name<const D: usize>(param: &Param<Tensor<D>>) -> Option<&str> {
    Some(param.reparameterization::<Placed>()?.name.as_str())
}

/// The value a layer computes with: this rank's `tp` part of `param` when the plan split it
/// over `tp` (with the split), otherwise the whole value.
pub fn local_value<const D: usize>(param: &Param<Tensor<D>>) -> (Tensor<D>, Option<&TpSplit>) {
    match param.reparameterization::<Placed>() {
        Some(placed) if placed.tp.is_some() => (placed.local(param.base()), placed.tp()),
        _ => (param.val(), None),
    }
}

/// The shape of the value a layer computes with from `param` (its `tp` part when the plan
/// split it over `tp`, whole otherwise), read from the stored shape and the plan's record,
/// never from the value (which under `fsdp` is a collective). A layer checks its input against
/// this, not against `Param::shape()`: a fully sharded parameter stores only its rows.
pub fn value_dims<const D: usize>(param: &Param<Tensor<D>>) -> [usize; D] {
    let stored = param.base().dims();
    match param.reparameterization::<Placed>() {
        Some(placed) => placed.local_dims(stored),
        None => stored,
    }
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
