//! How a plan moves parameters without changing the model: Burn's parameter
//! reparameterization. The stored parameter (its *base*) is this rank's part of the whole
//! tensor, and a [`Placed`] reparameterization attached to it says how to get the value a layer
//! computes with:
//! - **fully sharded** (`fsdp`): the base is this rank's rows of dimension 0, and
//!   [`Param::val`], which every Burn layer calls in its forward, all-gathers them. The gather
//!   is differentiable: its backward reduce-scatters (sums) the gradient over `fsdp`, so each
//!   rank's base receives the gradient of its own rows and any optimizer steps the shard.
//!   Inside [`crate::parallelize::Parallelized::forward`] (and a pipeline's layers) the first read of a
//!   unit's parameter gathers the whole unit in one collective, and the unit's reads take
//!   their part of it (`crate::zero::units`).
//! - **tensor parallel** (`tp`): the base is this rank's columns or rows of a linear layer,
//!   and [`crate::nn::Linear`] computes with that part (gathered over `fsdp` first when both
//!   apply), putting the collectives of Megatron's column- and row-parallel layers around it.
//!   `Param::val` would gather it whole, which only [`crate::parallelize::ShardedModel::whole`] may do: a
//!   layer that read the whole weight in its forward would silently run unsplit, so
//!   `Param::val` of a tensor-parallel weight panics elsewhere, naming the parameter.
//!
//! Burn's autodiff keeps a gathered weight until its backward has used it (as FSDP's
//! `reshard_after_forward = false`): between steps a rank holds `1/fsdp` of the parameters,
//! gradients and optimizer state, during forward and backward also the gathered parameters.

use crate::context_parallel::{AttentionWork, ContextParallel, CpAttention, SequenceLayout};
use crate::error::ParallelError;
use crate::plan::{ContextParallelRule, TpStyle};
use crate::tensor_parallel::comm::{copy_to_tp, gather_from_sp, gather_from_tp};
pub(crate) use crate::zero::units::UnitGathers;
use burn::module::{Module, Param, Reparameterization};
use burn::tensor::Tensor;
use flashover_comm::Group;
use flashover_runtime::CommStream;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

/// The reparameterization of a parameter a plan moved (see the module docs).
#[derive(Module, Debug)]
pub struct Placed {
    /// The parameter's path in the model, for messages.
    #[module(skip)]
    pub(crate) name: String,
    #[module(skip)]
    pub(crate) fsdp: Option<RowShard>,
    #[module(skip)]
    pub(crate) tp: Option<TpSplit>,
    /// A placeholder for a parameter another rank holds (its pipeline stage or its expert).
    #[module(skip)]
    pub(crate) held_elsewhere: Option<Elsewhere>,
    /// Under sequence parallelism, a whole parameter used on this rank's positions only: its
    /// gradient is summed over this `tp` group in backward.
    #[module(skip)]
    pub(crate) sequence_partial: Option<Group>,
    /// An attention core's (or a mixture-of-experts router's) sequence split over `cp`.
    #[module(skip)]
    pub(crate) context: Option<ContextSplit>,
    /// A mixture-of-experts router's: its layer's experts spread over `ep`.
    #[module(skip)]
    pub(crate) experts: Option<ExpertSplit>,
    /// A mixture-of-experts router's under sequence parallelism: the `tp` group over whose
    /// ranks the layer's input sequences are split (the layer routes them whole).
    #[module(skip)]
    pub(crate) sequence_tp: Option<Group>,
    #[module(skip)]
    pub(crate) whole_reads: WholeReads,
    /// Fully sharded parameters gathered ahead of their reads, a layer at a time.
    #[module(skip)]
    pub(crate) units: UnitGathers,
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
pub(crate) enum Elsewhere {
    /// It belongs to another rank's pipeline stage.
    Stage,
    /// It is a routed expert another `ep` rank holds.
    Expert,
}

/// Rows of dimension 0 split over `group`; `rows` of them are real, the rest padding.
#[derive(Debug, Clone)]
pub(crate) struct RowShard {
    pub(crate) group: Group,
    pub(crate) rows: usize,
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
/// shared by its parameters): while [`crate::parallelize::ShardedModel::whole`] runs, tensor-parallel
/// parameters gathered whole; while [`crate::parallelize::Parallelized::with_stored_reads`] runs, every
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
/// layer's forward ([`crate::expert_parallel::MoeForward`]) reads it from its router.
#[derive(Debug, Clone)]
pub struct ExpertSplit {
    /// The `ep` group.
    pub group: Group,
    /// The layer's routed experts.
    pub n_experts: usize,
    /// What the layer's dispatch shares with the plan's other layers.
    pub(crate) shared: SharedExpertState,
}

/// The state an expert-parallel layer's dispatch shares with the plan (its token traffic and
/// hot-expert copies), owned by `crate::expert_parallel` and opaque here. Opaque because that
/// state holds copies of expert layers, whose linear layers read these records: naming its
/// type would put the records above the layers that read them.
#[derive(Clone)]
pub(crate) struct SharedExpertState(pub(crate) Arc<dyn std::any::Any + Send + Sync>);

impl std::fmt::Debug for SharedExpertState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedExpertState")
    }
}

impl ContextSplit {
    /// Sequences split over `group` as `rule` says.
    pub(crate) fn new(group: &Group, rule: &ContextParallelRule) -> Self {
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
    pub(crate) fn attended(&self) -> u64 {
        self.work().score_elements
    }

    /// The attention this rank has computed across the `cp` ranks so far: its scores (every
    /// attention of this split) and the time in the current one's blocks.
    pub(crate) fn work(&self) -> AttentionWork {
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
            // Gathered by `ShardedModel::whole`; read nowhere else.
            _ if self.whole_reads.allowed() && self.held_elsewhere.is_some() => return base,
            Some(Elsewhere::Stage) => panic!(
                "`{}` belongs to a pipeline stage another rank holds (this rank keeps a \
                 placeholder): a model cut into stages trains through \
                 Parallelized::pipeline()?.step, whose stages read only their own parameters; \
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
