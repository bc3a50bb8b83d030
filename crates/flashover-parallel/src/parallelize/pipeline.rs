//! A user's model cut into pipeline stages by a plan's [`PipelineRule`], and one training
//! step of it through the pipeline executor.
//!
//! Every rank keeps the model's whole structure, but holds only the parameters of its stages:
//! the others become one-element placeholders (so a stage's memory is its share). The model
//! runs a stage through [`PipelineModel`]: the first stage embeds the micro-batch, each stage
//! runs its layers, the last computes the loss. A module the first and the last stage both
//! run (an embedding tied to the head) is held by both; their gradients are summed so the
//! copies stay equal, and the first stage's copy is the one counted and gathered.

use crate::data_parallel::BucketedReduction;
use crate::dropout::draws::{self, Draws, Scope};
use crate::error::ParallelError;
use crate::expert_parallel::Replicas;
use crate::params::{ParamLayout, ParamSlot};
use crate::pipeline::{
    ActionKind, BoundaryTensor, PartSpec, PipelineExecutor, PipelineStepReport, Schedule,
    ScheduleKind, StageBoundary, StageOutput, WeightGradStore, boundary_tensors,
    deferral_supported, from_boundary_tensors, specs_of,
};
use crate::placement::{PlacementTable, Tie};
use crate::plan::CheckpointPolicy;
use crate::plan::{ModulePath, PipelineRule};
use crate::precision::{MixedPrecision, Precision};
use crate::recompute::replaying;
use crate::recompute::{Replays, checkpoint_part};
use crate::zero::units::UnitGathers;
use crate::zero::units::{Unit, after_input, unit_shards};
use burn::module::Module;
use burn::tensor::{DType, Device, Gradients, Tensor};
use flashover_comm::{CommunicatorExt, Group, ReduceOp, control};
use flashover_runtime::{Axis, TensorCollectives};
use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A model a pipeline plan can cut into stages: its forward in three parts, each a few lines
/// of what the model's own forward does (and the single-device loss is
/// `head_loss(layers(embed(batch)), batch)`, so there is one forward).
///
/// What runs between the parts is [`Self::Activation`]: one tensor (`Tensor<3>` for
/// `[batch, seq, width]`), or several for a model of more than one stream, such as an
/// encoder-decoder's `(memory, target)`: the encoder's layers change the first, the decoder's
/// read it and change the second. Every one of them crosses each stage boundary with its own
/// gradient, so a tensor read by several later stages gets the sum of their gradients back
/// at the stage that made it.
pub trait PipelineModel: Module {
    /// One micro-batch: the inputs the first stage reads, the targets the last one does, and
    /// whatever its layers read besides their activation ([`Self::layer_for`]). Every stage
    /// builds its micro-batches; a recomputed layer keeps its micro-batch until backward.
    type Batch: Send + Sync + 'static;

    /// What every layer takes and returns, and what crosses stage boundaries: a tensor, a
    /// tuple of them, or a struct of the model's own ([`StageBoundary`]). Every layer returns
    /// the shapes and dtypes it is given.
    type Activation: StageBoundary;

    /// The first stage's part before the layers: the micro-batch's input activation.
    fn embed(&self, batch: &Self::Batch) -> Self::Activation;

    /// Layer `index` of the plan's `layers` (`self.blocks[index].forward(x)`), numbered on
    /// through its lists when it names several (`encoder.blocks` then `decoder.blocks`).
    ///
    /// Implement this, or [`Self::layer_with_aux`], or [`Self::layer_for`] (the one the
    /// pipeline calls; a model whose layers read their micro-batch, such as a padding mask,
    /// implements only that one). The default panics at the first step, saying so.
    fn layer(&self, index: usize, x: Self::Activation) -> Self::Activation {
        let _ = x;
        panic!(
            "PipelineModel: implement `layer` (or `layer_with_aux`, or `layer_for` when the \
             layers read their micro-batch): the pipeline runs layer {index} through them"
        )
    }

    /// Layer `index` and the auxiliary loss it adds to the micro-batch's (a mixture-of-experts
    /// layer's, from `flashover::nn::MoeForward`): the pipeline adds it to the loss that the
    /// layer's stage backpropagates, so its gradient stays on that stage, and leaves it out of
    /// the reported loss. By default [`Self::layer`] with none.
    ///
    /// **A model whose layers have auxiliary losses must implement this**, and write `layer`
    /// as `self.layer_with_aux(index, x).0`: the pipeline calls only this one (through
    /// [`Self::layer_for`]), and nothing can tell a default that drops a loss from a layer
    /// without one, so a `layer` that drops it trains without its gradient, silently.
    fn layer_with_aux(
        &self,
        index: usize,
        x: Self::Activation,
    ) -> (Self::Activation, Option<Tensor<1>>) {
        (self.layer(index, x), None)
    }

    /// [`Self::layer_with_aux`] of micro-batch `batch`, for layers that read more of their
    /// micro-batch than the activation: an attention mask, position ids, or the forward
    /// context its samples run in (dropout masks drawn by sample index, as on one device).
    /// What the pipeline calls; by default `layer_with_aux`, which reads nothing more.
    fn layer_for(
        &self,
        index: usize,
        x: Self::Activation,
        batch: &Self::Batch,
    ) -> (Self::Activation, Option<Tensor<1>>) {
        let _ = batch;
        self.layer_with_aux(index, x)
    }

    /// The last stage's part after the layers: the micro-batch's mean loss.
    fn head_loss(&self, x: Self::Activation, batch: &Self::Batch) -> Tensor<1>;
}

/// Where a plan's pipeline puts each layer and parameter, seen from one rank.
pub(super) struct Stages {
    pub(super) schedule: Schedule,
    /// Layers of each stage, in order.
    layers: Vec<Range<usize>>,
    /// Per parameter (layout order): whether this rank holds it.
    pub(super) held: Vec<bool>,
    /// The parameters held by two pipeline ranks, and whether this rank's copy is the first
    /// stage's.
    tied: Vec<(usize, Tie)>,
    /// The whole model's parameters (global shapes).
    pub(super) whole: ParamLayout,
    pp: Group,
    /// The ranks of the first and last stage, which sum tied copies (on both of them).
    tie: Option<Group>,
    /// What crosses stage boundaries for a micro-batch of so many samples, once known
    /// ([`Stages::boundary`]).
    boundary: std::sync::Mutex<Option<(usize, Vec<PartSpec>)>>,
    /// Which layers are recomputed in backward.
    recompute: CheckpointPolicy,
    /// Per layer, which parameters (layout order) are its own: what its recomputation carries,
    /// what it casts to the compute dtype, and whose gradient hooks follow its backward.
    parts: Vec<Arc<[bool]>>,
    /// Which parameters (layout order) are in no layer (the embedding, the final norm, the
    /// head): cast and hooked once per micro-batch.
    outside: Arc<[bool]>,
    /// Layer forwards run again in backward so far.
    recomputed: Arc<AtomicUsize>,
    /// With fully sharded layers: how each layer gathers its sharded parameters at once.
    units: Option<Arc<LayerUnits>>,
    /// The precision a step's forwards and backwards compute in (f32 without one).
    precision: Option<MixedPrecision>,
    /// The hot-expert copies every backward hands its gradients to (none without
    /// `replicate_hot_experts`).
    copies: Replicas,
}

/// A pipeline's layers as fully sharded units.
struct LayerUnits {
    /// Where a layer's gathered parameters go for their reads.
    gathers: UnitGathers,
    /// Per layer, for each parameter (layout order), its path when it is one of the layer's
    /// fully sharded ones (the layer is unit 0 of [`unit_shards`]).
    slots: Vec<Vec<Option<(String, usize)>>>,
    /// For each parameter (layout order), its path when it is a fully sharded one this rank
    /// holds outside the layers (the embedding, the final norm, the head): one unit gathered at
    /// a micro-batch's start and kept to its end, as FSDP's root unit.
    root: Vec<Option<(String, usize)>>,
}

impl Stages {
    /// `rule` applied to a model of parameters `whole`, for pipeline rank `pp.rank()`
    /// (collective over `pp`: the tie group is made here). Fails naming what does not fit.
    pub(super) fn new(
        rule: &PipelineRule,
        recompute: &CheckpointPolicy,
        whole: ParamLayout,
        pp: &Group,
    ) -> Result<Self, ParallelError> {
        let schedule = schedule(rule, pp.size())?;
        let stages = schedule.stages();
        let layer_of = layer_indices(rule, &whole.slots)?;
        let count = layer_of.iter().flatten().max().map_or(0, |i| i + 1);
        if count < stages {
            return Err(ParallelError::Invalid(format!(
                "pipeline layers `{}`: {count} layers cannot fill {stages} stages (pp = {} x \
                 chunks = {}); every stage runs at least one layer",
                rule.layers_named(),
                pp.size(),
                schedule.chunks
            )));
        }
        if let CheckpointPolicy::Blocks(list) = recompute
            && let Some(beyond) = list.iter().find(|&&i| i >= count)
        {
            return Err(ParallelError::Invalid(format!(
                "activation_checkpointing `{recompute}` names layer {beyond}, but `{}` has \
                 {count} layers (0..{count})",
                rule.layers_named()
            )));
        }
        let parts = (0..count)
            .map(|i| layer_of.iter().map(|l| *l == Some(i)).collect())
            .collect();
        let outside = layer_of.iter().map(Option::is_none).collect();
        let counts = layer_counts(rule, count, &schedule)?;
        let mut layers = vec![];
        let mut start = 0;
        for n in counts {
            layers.push(start..start + n);
            start += n;
        }
        let last = stages - 1;
        let mine: Vec<usize> = (0..schedule.chunks)
            .map(|c| schedule.stage_of(pp.rank(), c))
            .collect();
        let (mut held, mut tied) = (vec![], vec![]);
        for (index, (slot, layer)) in whole.slots.iter().zip(&layer_of).enumerate() {
            let in_first = rule.first.iter().any(|p| p.contains(&slot.name));
            let in_last = rule.last.iter().any(|p| p.contains(&slot.name));
            let stages_of: Vec<usize> = match layer {
                Some(i) => vec![layers.iter().position(|r| r.contains(i)).expect("covered")],
                None => [(in_first, 0), (in_last, last)]
                    .into_iter()
                    .filter_map(|(is, stage)| is.then_some(stage))
                    .collect(),
            };
            if stages_of.is_empty() {
                return Err(ParallelError::Invalid(format!(
                    "parameter `{}` is in no pipeline stage: it is not under `{}` (the \
                     layers); name its module in the pipeline's `first` (run before the \
                     layers), `last` (after them) or `attach` (with one layer)",
                    slot.name,
                    rule.layers_named()
                )));
            }
            let holds = stages_of.iter().any(|s| mine.contains(s));
            held.push(holds);
            let ranks: HashSet<usize> = stages_of.iter().map(|&s| schedule.place(s).0).collect();
            if holds && ranks.len() > 1 {
                let original = schedule.place(0).0 == pp.rank();
                tied.push((index, if original { Tie::Original } else { Tie::Copy }));
            }
        }
        let (first_rank, last_rank) = (schedule.place(0).0, schedule.place(last).0);
        let ends = pp.rank() == first_rank || pp.rank() == last_rank;
        let tie = if pp.size() > 1 {
            let group = pp.split(usize::from(!ends), pp.rank(), "pipeline-tie")?;
            (ends && !tied.is_empty()).then_some(group)
        } else {
            None
        };
        Ok(Stages {
            schedule,
            layers,
            held,
            tied,
            whole,
            pp: pp.clone(),
            tie,
            boundary: Default::default(),
            recompute: recompute.clone(),
            parts,
            outside,
            recomputed: Default::default(),
            units: None,
            precision: None,
            copies: Replicas::default(),
        })
    }

    /// Steps compute in `policy`'s dtype (checked by the caller): every micro-batch on a
    /// fresh compute view, activations crossing stages in that dtype.
    pub(super) fn compute_in(&mut self, policy: MixedPrecision) {
        self.precision = (policy.param_dtype != Precision::F32).then_some(policy);
    }

    /// Every backward hands the gradients of `copies` (hot experts' copies, not parameters of
    /// the model) over to them.
    pub(super) fn hand_gradients_to(&mut self, copies: Replicas) {
        self.copies = copies;
    }

    /// Records that this rank's parameters are its own over `pp` and which are tied copies.
    pub(super) fn place(&self, placements: &mut PlacementTable) -> Result<(), ParallelError> {
        if self.pp.size() == 1 {
            return Ok(());
        }
        for slot in &self.whole.slots {
            placements.own(slot.id, Axis::Pp)?;
        }
        for (index, tie) in &self.tied {
            placements.tie(self.whole.slots[*index].id, *tie)?;
        }
        Ok(())
    }

    /// The pipeline's ranks.
    pub(super) fn pipeline_group(&self) -> &Group {
        &self.pp
    }

    /// The group tied copies are summed over, on the ranks that hold one.
    pub(super) fn tie_group(&self) -> Option<&Group> {
        self.tie.as_ref()
    }

    /// Whether this rank's value of parameter `index` (layout order) is the one counted when
    /// the whole model is gathered: it holds the parameter, and not as a tied copy.
    pub(super) fn counts(&self, index: usize) -> bool {
        let copy = self
            .tied
            .iter()
            .any(|(t, tie)| *t == index && *tie == Tie::Copy);
        self.held[index] && !copy
    }

    /// One step's forwards and backwards of this rank's stages over `share` (this rank's
    /// samples, cut into the rule's micro-batches, micro-batch `k`'s loss `head(model, x,
    /// batch, k)` on the last stage): the gradients summed over its chunks and its
    /// micro-batches, of the losses as scaled by `loss_scale` (the caller divides by the
    /// micro-batches and the scale), in `model`'s layout, and the mean loss and auxiliary loss
    /// of the share (the same on every rank of `pp`). With `hooks`, every forward runs on
    /// hooked parameters that hand their gradients to the reduction's buckets during
    /// backward (those are then zero in the returned sums): see [`Self::hooks_allowed`].
    /// With `draws` (the share's), each micro-batch's dropout draws its samples' one-device
    /// masks, its embedding, each layer and its head in their own scopes (whichever rank runs
    /// them); without, the device's generator draws them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn step<M>(
        &self,
        model: &M,
        share: Range<usize>,
        draws: Option<&Draws>,
        device: &Device,
        micro_batch: &(dyn Fn(Range<usize>) -> M::Batch + Sync),
        head: &HeadLoss<'_, M>,
        loss_scale: Option<f32>,
        hooks: Option<&BucketedReduction>,
    ) -> Result<(Tensor<1>, [f32; 2], PipelineStepReport), ParallelError>
    where
        M: PipelineModel + Sync + 'static,
    {
        let m = self.schedule.micro_batches;
        if !share.len().is_multiple_of(m) {
            return Err(ParallelError::Invalid(format!(
                "this rank's {} samples do not split into {m} micro-batches: use a global \
                 batch that is a multiple of {m} x the data-parallel ranks",
                share.len()
            )));
        }
        if let Some(units) = &self.units {
            // A step that failed half-way may have left a layer's all-gather of old values.
            units.gathers.discard_prefetches()?;
        }
        // The units' reduce-scatters run while backward goes on and join the gradients after
        // the last backward; where a bucket reduces a unit's gradient over the other data
        // axes (HSDP), the bucket takes the reduce-scatter unwaited and waits for it on its
        // own thread.
        let handing = (self.units.as_deref())
            .zip(hooks)
            .filter(|(u, h)| u.sharded().any(|i| h.reduces_param(i)));
        let deferring = (self.units.as_deref()).filter(|_| handing.is_none());
        if let Some(units) = deferring {
            units.gathers.defer_scatters()?;
        }
        if let Some((units, hooks)) = handing {
            let handles = (self.whole.slots.iter().zip(hooks.later_handles()))
                .filter_map(|(slot, handle)| Some((slot.name.clone(), handle?)))
                .collect();
            units.gathers.hand_scatters_to(handles);
        }
        let _stop = self.units.as_deref().map(|u| StopDeferring(&u.gathers));
        let per = share.len() / m;
        let micro = |k: usize| share.start + k * per..share.start + (k + 1) * per;
        let boundary = self.boundary(model, micro(0), micro_batch)?;
        let last = self.schedule.stages() - 1;
        let rank = self.pp.rank();
        let forward = |chunk: usize, master: &M, input: Option<Vec<BoundaryTensor>>, k: usize| {
            if let Some(units) = &self.units {
                units.gathers.new_forward();
            }
            // Hooks on the f32 parameters, under the casts: the buckets receive f32. Those
            // outside the layers run at the end of backward; each layer hooks its own (`layer`).
            let hooked = hooks.map(|h| h.hooked_where(master, &|i| self.outside[i], None));
            let master = hooked.as_ref().unwrap_or(master);
            // Each micro-batch's graph casts the parameters anew (the view's casts are nodes
            // of that graph): their gradients reach the f32 parameters in f32. The layers'
            // are left in f32 here: each layer casts its own.
            let view = self.compute_view_of(master, &self.outside);
            let m = view.as_ref().unwrap_or(master);
            let stage = self.schedule.stage_of(rank, chunk);
            let batch = Arc::new(micro_batch(micro(k)));
            let draws = draws.map(|d| d.for_samples(micro(k)));
            let draws = draws.as_ref();
            // The stage's parameters outside the layers, gathered in one collective for the
            // whole micro-batch (from the f32 rows, read in the view's dtype).
            let root = self.units.as_deref().map(|u| u.gather_root(master));
            let mut x = match input {
                Some(parts) => from_boundary_tensors(parts),
                None => draws::in_scope(draws, Scope::Before, || m.embed(&batch)),
            };
            let mut aux: Option<Tensor<1>> = None;
            for i in self.layers[stage].clone() {
                let (y, layer_aux) = self.layer(m, i, x, &batch, draws, hooks);
                x = y;
                aux = match (aux, layer_aux) {
                    (Some(sum), Some(more)) => Some(sum + more),
                    (sum, more) => sum.or(more),
                };
            }
            let output = match stage == last {
                true => StageOutput::Loss(draws::in_scope(draws, Scope::After, || {
                    head(m, x, &batch, k)
                })),
                false => StageOutput::Activation(boundary_tensors(x)),
            };
            if let (Some(units), Some(names)) = (self.units.as_deref(), root) {
                units.gathers.release(names.iter().map(String::as_str));
            }
            StageOutput::with_aux_loss(output, aux)
        };
        let chunks = vec![model.clone(); self.schedule.chunks];
        // Gradients of parameters outside the model (hot-expert copies) go to them.
        let take = |grads: &mut Gradients| self.copies.take_grads(grads);
        let mut executor = PipelineExecutor::new(&self.schedule, &self.pp)?
            .taking_gradients(&take)
            .summing();
        if let Some(hooks) = hooks {
            executor = executor.with_backward_sink(hooks);
        }
        if let Some(scale) = loss_scale {
            // Losses scaled before backward, the gradients returned unscaled.
            executor = executor.with_loss_scale(scale);
        }
        let zero_bubble = self.splits_backward();
        if zero_bubble {
            if !deferral_supported(device) {
                return Err(ParallelError::Invalid(format!(
                    "pipeline schedule: zb-h1 defers the layers' weight gradients through an op \
                     built for Flex and the CubeCL backend (wgpu, CUDA), not for {device:?}; \
                     use 1f1b there"
                )));
            }
            executor = executor.deferring_weight_grads(WeightGradStore::default());
        }
        // Every chunk is the same model (its own stages' parameters): sum them in place.
        let (flats, report) = executor.step_flat(&chunks, &boundary, device, forward)?;
        // A zero-bubble step whose weight gradients were not deferred would silently be 1F1B.
        if zero_bubble && report.deferred_weight_grads == 0 {
            return Err(ParallelError::Invalid(
                "pipeline schedule: zb-h1 deferred no weight gradient: it defers those of \
                 flashover::nn::Linear layers (Burn's Linear computes its weight gradient with \
                 the input gradient), so this model's layers would run as 1f1b; declare them \
                 as flashover::nn::Linear or use 1f1b"
                    .into(),
            ));
        }
        let flat = (flats.into_iter())
            .reduce(|sum, chunk| sum + chunk)
            .expect("a schedule has a chunk per rank");
        let flat = match deferring {
            Some(units) => units.gathers.add_deferred(&ParamLayout::of(model), flat)?,
            None => flat,
        };
        // The mean loss (the last stage's) and the mean of every stage's auxiliary losses.
        let mut losses = [report.loss_sum, report.aux_loss_sum].map(|l| l as f32 / m as f32);
        if self.pp.size() > 1 {
            control(|| self.pp.all_reduce(&mut losses, ReduceOp::Sum))?;
        }
        Ok((flat, losses, report))
    }
}

impl Stages {
    /// Whether a step's gradients may reach a reduction through hooks during backward: one
    /// chunk per rank (its backwards cover every parameter it holds, the last of them last),
    /// no deferred weight gradients (zero-bubble adds them after their backward), no
    /// hot-expert copies (their gradients are folded into the owners' before the reduction).
    pub(super) fn hooks_allowed(&self) -> bool {
        self.hooks_ruled_out().is_none()
    }

    /// Why a step's gradients cannot reach a reduction through hooks during backward, if
    /// they cannot (see [`Self::hooks_allowed`]).
    pub(super) fn hooks_ruled_out(&self) -> Option<&'static str> {
        if self.schedule.chunks > 1 {
            Some("an interleaved schedule runs several chunks per rank")
        } else if self.splits_backward() {
            Some("zero-bubble schedules compute weight gradients after their backward")
        } else if self.copies.is_active() {
            Some("hot-expert copies' gradients join their owners' before the reduction")
        } else {
            None
        }
    }

    /// `model` with the parameters `part` marks (layout order) cast to the step's compute
    /// dtype, when it is not f32.
    fn compute_view_of<M: Module>(&self, model: &M, part: &[bool]) -> Option<M> {
        let policy = self.precision.as_ref()?;
        Some(policy.compute_view_of(model.clone(), part))
    }

    /// Whether the schedule splits backward into input- and weight-gradient actions
    /// (zero-bubble).
    pub(super) fn splits_backward(&self) -> bool {
        self.schedule
            .ranks
            .iter()
            .flatten()
            .any(|a| a.kind == ActionKind::BackwardWeight)
    }

    /// Gathers each layer's fully sharded parameters (`sharded`, layout order) in one
    /// collective over `group` before the layer runs, instead of one per parameter as it reads
    /// them.
    pub(super) fn gather_layers(&mut self, units: UnitGathers, group: &Group, sharded: &[bool]) {
        if group.size() > 1 && sharded.iter().any(|s| *s) {
            let in_layer = |i: usize| self.parts.iter().any(|part| part[i]);
            let root = (self.whole.slots.iter().enumerate())
                .map(|(i, s)| {
                    (sharded[i] && self.held[i] && !in_layer(i)).then(|| (s.name.clone(), 0))
                })
                .collect();
            self.units = Some(Arc::new(LayerUnits {
                gathers: units,
                root,
                slots: self
                    .parts
                    .iter()
                    .map(|part| {
                        let mine = part.iter().zip(sharded).map(|(p, s)| *p && *s);
                        let slots = self.whole.slots.iter().zip(mine);
                        slots
                            .map(|(s, mine)| mine.then(|| (s.name.clone(), 0)))
                            .collect()
                    })
                    .collect(),
            }));
        }
    }

    /// Layer `index` on `x` of micro-batch `batch` and its auxiliary loss, computed on
    /// `model` (whose layers' parameters are f32) with the layer's own parameters cast to the
    /// compute dtype: recomputed in backward when the plan's policy names it (carrying only
    /// the layer's own parameters, cast inside the recomputation, and the micro-batch),
    /// plainly otherwise. Fully sharded parameters are gathered from the f32 rows, read in
    /// the compute dtype: their reduce-scattered gradient reaches the f32 rows in f32 whether
    /// or not the layer is recomputed. With `hooks`, the layer's parameters hand their
    /// gradients to their buckets right after the layer's backward.
    fn layer<M>(
        &self,
        model: &M,
        index: usize,
        x: M::Activation,
        batch: &Arc<M::Batch>,
        draws: Option<&Draws>,
        hooks: Option<&BucketedReduction>,
    ) -> (M::Activation, Option<Tensor<1>>)
    where
        M: PipelineModel + Sync + 'static,
    {
        let units = self.units.clone();
        let stage = self.layers.iter().find(|l| l.contains(&index)).cloned();
        let stage = stage.unwrap_or(index..index + 1);
        // The layers whose all-gathers this one's prefetches: in forward the stage's next; in
        // a rerun in backward the stage's closest recomputed layer before it, which reruns
        // next (FSDP's backward prefetch).
        let ahead = Ahead {
            next: (index + 1 < stage.end).then_some(index + 1),
            rerun_next: (stage.start..index)
                .rev()
                .find(|&i| self.recompute.recomputes_block(i)),
        };
        let batch = batch.clone();
        let part = self.parts[index].clone();
        // The layer's input, when something goes right after the layer's backward (Burn runs
        // the tape by depth: placed as deep as the input, not as shallow as the parameters):
        // its parameters' gradient hooks and its unit's reduce-scatter.
        let placing = hooks.is_some() || units.is_some();
        let (x, input) = match placing {
            true => with_input(x),
            false => (x, None),
        };
        let hooked = hooks.map(|h| h.hooked_where(model, &|i| part[i], input.as_ref()));
        let model = hooked.as_ref().unwrap_or(model);
        if !self.recompute.recomputes_block(index) {
            let view = self.compute_view_of(model, &part);
            let view = view.as_ref().unwrap_or(model);
            let units = units.as_deref().map(|units| UnitRun {
                units,
                ahead,
                input,
            });
            return run_layer(units, model, view, index, x, &batch, draws);
        }
        // A recomputation in backward draws the masks the forward drew.
        let draws = draws.cloned();
        let (precision, cast_part) = (self.precision, part.clone());
        let run = move |m: &M, x: M::Activation| {
            let view = precision.map(|p| p.compute_view_of(m.clone(), &cast_part));
            let view = view.as_ref().unwrap_or(m);
            // Inside the recomputation the unit's reduce-scatter is the recomputation's.
            let units = units.as_deref().map(|units| UnitRun {
                units,
                ahead,
                input: None,
            });
            run_layer(units, m, view, index, x, &batch, draws.as_ref())
        };
        // The recomputed function takes the activation's tensors as one and returns the
        // output's and then the auxiliary loss as one, so their gradients reach the layer
        // through the recomputation (a layer keeps its activation's shapes and dtypes, as
        // every stage's input and output have them).
        let (packing, input) = Packing::of(boundary_tensors(x));
        let replays = Replays::new(self.recomputed.clone());
        let unpack = packing.clone();
        let forward = move |m: &M, x: Tensor<1>| {
            replays.next_is_replay();
            let (y, aux) = run(m, from_boundary_tensors(unpack.unpack(x)));
            let y = unpack.pack(boundary_tensors(y));
            let aux = aux.unwrap_or_else(|| Tensor::zeros([1], &y.device()));
            let dtype = y.dtype();
            Tensor::cat(vec![y, aux.cast(dtype).reshape([1])], 0)
        };
        let output = checkpoint_part(model, input, forward, Some(part));
        let numel = packing.numel();
        let aux = output.clone().narrow(0, numel, 1);
        let y = packing.unpack(output.narrow(0, 0, numel));
        (from_boundary_tensors(y), Some(aux))
    }

    /// `batch` forward through every stage, without gradients (validation, inference): the
    /// layers' output on the rank that runs the last stage, `None` on the others. Each stage's
    /// output travels to the next stage's rank in f32, its tensors' shapes first. Collective
    /// over `pp`.
    pub(super) fn forward<M>(
        &self,
        model: &M,
        batch: &M::Batch,
    ) -> Result<Option<M::Activation>, ParallelError>
    where
        M: PipelineModel,
    {
        let (rank, last) = (self.pp.rank(), self.schedule.stages() - 1);
        let mut carried: Option<M::Activation> = None;
        for stage in 0..=last {
            if self.schedule.place(stage).0 != rank {
                continue;
            }
            let mut x = match (stage, carried.take()) {
                (0, _) => model.embed(batch),
                (_, Some(x)) => x, // the previous stage ran here too
                (_, None) => {
                    let src = self.schedule.place(stage - 1).0;
                    let mut len = [0u64];
                    control(|| self.pp.recv(&mut len, src))?;
                    let mut code = vec![0u64; len[0] as usize];
                    control(|| self.pp.recv(&mut code, src))?;
                    let device = model.devices().into_iter().next().ok_or_else(|| {
                        ParallelError::Invalid("a pipeline stage with no parameters".into())
                    })?;
                    let mut parts = vec![];
                    for spec in decode_specs(&code)? {
                        let flat = self
                            .pp
                            .recv_tensor([spec.numel()], DType::F32, src, &device)?;
                        parts.push(BoundaryTensor::new(flat.cast(spec.dtype), spec));
                    }
                    from_boundary_tensors(parts)
                }
            };
            for i in self.layers[stage].clone() {
                let units = self.units.as_deref().map(|units| UnitRun {
                    units,
                    ahead: Ahead::default(),
                    input: None,
                });
                x = run_layer(units, model, model, i, x, batch, None).0;
            }
            if stage == last {
                return Ok(Some(x));
            }
            let dst = self.schedule.place(stage + 1).0;
            if dst == rank {
                carried = Some(x);
            } else {
                let parts = boundary_tensors(x);
                let code = encode_specs(&specs_of(&parts))?;
                control(|| self.pp.send(&[code.len() as u64], dst))?;
                control(|| self.pp.send(&code, dst))?;
                for part in parts {
                    self.pp.send_tensor(&part.flat.cast(DType::F32), dst)?;
                }
            }
        }
        Ok(None)
    }

    /// Whether this rank runs the pipeline's last stage (where the loss is computed).
    pub(super) fn runs_last_stage(&self) -> bool {
        self.schedule.place(self.schedule.stages() - 1).0 == self.pp.rank()
    }

    /// Layer forwards run again in backward so far.
    pub(super) fn recomputed(&self) -> usize {
        self.recomputed.load(Ordering::Relaxed)
    }

    /// What crosses every stage boundary for one micro-batch: the tensors of the first
    /// stage's `embed` of `first`'s samples (their shapes, dtypes and which carry gradients),
    /// broadcast over `pp` on the first step and kept while micro-batches keep that many
    /// samples (the micro-batches of a run have one shape). Collective over `pp`.
    fn boundary<M>(
        &self,
        model: &M,
        first: Range<usize>,
        micro_batch: &(dyn Fn(Range<usize>) -> M::Batch + Sync),
    ) -> Result<Vec<PartSpec>, ParallelError>
    where
        M: PipelineModel,
    {
        let mut known = self.boundary.lock().unwrap_or_else(|p| p.into_inner());
        let samples = first.len();
        if let Some((_, specs)) = known.as_ref().filter(|(n, _)| *n == samples) {
            return Ok(specs.clone());
        }
        let root = self.schedule.place(0).0;
        let mut code = vec![];
        if self.pp.rank() == root {
            let view = self.compute_view_of(model, &self.outside);
            let model = view.as_ref().unwrap_or(model);
            // Only its shapes are kept: no draws (they are the first micro-batch's forward's).
            let x = draws::in_scope(None, Scope::Before, || model.embed(&micro_batch(first)));
            code = encode_specs(&specs_of(&boundary_tensors(x)))?;
        }
        if self.pp.size() > 1 {
            let mut len = [code.len() as u64];
            control(|| self.pp.broadcast(&mut len, root))?;
            code.resize(len[0] as usize, 0);
            control(|| self.pp.broadcast(&mut code, root))?;
        }
        let specs = decode_specs(&code)?;
        *known = Some((samples, specs.clone()));
        Ok(specs)
    }
}

/// The dtypes a stage boundary's tensors may have, by their code in [`encode_specs`].
const BOUNDARY_DTYPES: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::F64];

/// `specs` as numbers, for a broadcast or a send: their count, then per tensor its dtype's
/// code, whether it carries a gradient, its rank and its dimensions.
fn encode_specs(specs: &[PartSpec]) -> Result<Vec<u64>, ParallelError> {
    let mut code = vec![specs.len() as u64];
    for spec in specs {
        let dtype = BOUNDARY_DTYPES.iter().position(|d| *d == spec.dtype);
        let dtype = dtype.ok_or_else(|| {
            ParallelError::Invalid(format!(
                "a stage boundary's tensor of dtype {:?}: stages pass float tensors (f32, bf16, \
                 f16, f64); build integer inputs from the micro-batch on every stage \
                 (PipelineModel::layer_for)",
                spec.dtype
            ))
        })?;
        code.extend([dtype as u64, u64::from(spec.grad), spec.shape.len() as u64]);
        code.extend(spec.shape.iter().map(|&d| d as u64));
    }
    Ok(code)
}

/// The specs [`encode_specs`] wrote.
fn decode_specs(code: &[u64]) -> Result<Vec<PartSpec>, ParallelError> {
    let malformed = || ParallelError::Invalid("a malformed stage boundary description".into());
    let mut numbers = code.iter().map(|&n| n as usize);
    let mut next = || numbers.next().ok_or_else(malformed);
    let count = next()?;
    let mut specs = Vec::with_capacity(count);
    for _ in 0..count {
        let dtype = *BOUNDARY_DTYPES.get(next()?).ok_or_else(malformed)?;
        let grad = next()? == 1;
        let rank = next()?;
        let shape = (0..rank).map(|_| next()).collect::<Result<_, _>>()?;
        specs.push(PartSpec { shape, dtype, grad });
    }
    Ok(specs)
}

/// A boundary's tensors as one flat tensor, for a recomputed layer (whose function takes and
/// returns one tensor): concatenated in order, in their common dtype (f32 when they differ,
/// which every float dtype converts to and back exactly).
#[derive(Clone)]
struct Packing {
    specs: Vec<PartSpec>,
    dtype: DType,
}

impl Packing {
    /// How `parts` pack, and them packed.
    fn of(parts: Vec<BoundaryTensor>) -> (Self, Tensor<1>) {
        let specs = specs_of(&parts);
        let dtype = match specs.iter().all(|s| s.dtype == specs[0].dtype) {
            true => specs[0].dtype,
            false => DType::F32,
        };
        let packing = Packing { specs, dtype };
        let packed = packing.pack(parts);
        (packing, packed)
    }

    /// Elements of the packed tensor.
    fn numel(&self) -> usize {
        self.specs.iter().map(PartSpec::numel).sum()
    }

    /// `parts` (shaped as this packing's) as one tensor.
    fn pack(&self, parts: Vec<BoundaryTensor>) -> Tensor<1> {
        let shapes: Vec<&[usize]> = parts.iter().map(|p| &p.shape[..]).collect();
        let expected: Vec<&[usize]> = self.specs.iter().map(|s| &s.shape[..]).collect();
        assert_eq!(
            shapes, expected,
            "a recomputed pipeline layer returned other shapes than it was given"
        );
        let mut flats: Vec<Tensor<1>> = parts
            .into_iter()
            .map(|p| match p.flat.dtype() == self.dtype {
                true => p.flat,
                false => p.flat.cast(self.dtype),
            })
            .collect();
        match flats.len() {
            1 => flats.pop().expect("one"),
            _ => Tensor::cat(flats, 0),
        }
    }

    /// The tensors `packed` holds, in their dtypes (those without a gradient detached).
    fn unpack(&self, packed: Tensor<1>) -> Vec<BoundaryTensor> {
        let mut start = 0;
        let mut parts = vec![];
        for spec in &self.specs {
            let mut flat = packed.clone().narrow(0, start, spec.numel());
            start += spec.numel();
            if flat.dtype() != spec.dtype {
                flat = flat.cast(spec.dtype);
            }
            if !spec.grad {
                flat = flat.detach();
            }
            parts.push(BoundaryTensor::new(flat, spec.clone()));
        }
        parts
    }
}

/// The last stage's loss of a micro-batch: `head(model, x, batch, k)` of micro-batch `k`'s
/// layers' output `x` (`PipelineModel::head_loss`, or a head that also keeps the micro-batch's
/// outputs).
pub type HeadLoss<'a, M> = dyn Fn(&M, <M as PipelineModel>::Activation, &<M as PipelineModel>::Batch, usize) -> Tensor<1>
    + Sync
    + 'a;

/// `x`, and one of its tensors that carries a gradient (flattened): what an op is placed after
/// to run in backward right after the backward of the layer `x` goes into.
fn with_input<A: StageBoundary>(x: A) -> (A, Option<Tensor<1>>) {
    let parts = boundary_tensors(x);
    let input = parts.iter().find(|p| p.grad).map(|p| p.flat.clone());
    (from_boundary_tensors(parts), input)
}

/// How a layer whose parameters are fully sharded units runs ([`run_layer`]).
struct UnitRun<'a> {
    units: &'a LayerUnits,
    /// The layers whose all-gathers the run submits.
    ahead: Ahead,
    /// One of the layer's input tensors ([`with_input`]): the unit reduce-scatters right
    /// after the layer's backward; without it, at the end of backward.
    input: Option<Tensor<1>>,
}

/// Layer `index` of `view` on `x` of micro-batch `batch` and its auxiliary loss, its dropout
/// drawn from `draws` as layer `index`. When the layers are `units`, its fully sharded
/// parameters are gathered at once first from `stored`'s rows (the f32 parameters `view` may
/// be a cast view of), and then the all-gathers of the layers ahead submitted.
fn run_layer<M>(
    units: Option<UnitRun<'_>>,
    stored: &M,
    view: &M,
    index: usize,
    x: M::Activation,
    batch: &M::Batch,
    draws: Option<&Draws>,
) -> (M::Activation, Option<Tensor<1>>)
where
    M: PipelineModel,
{
    let layer_for = |x| {
        draws::in_scope(draws, Scope::Layer(index), || {
            view.layer_for(index, x, batch)
        })
    };
    match units {
        None => layer_for(x),
        Some(UnitRun {
            units: u,
            ahead,
            input,
        }) => {
            let shards = u.shards(stored, index);
            let names: Vec<String> = shards.iter().map(|(n, _)| n.clone()).collect();
            let _gathered = after_input(input, || {
                u.gathers.gather_prefetched(Unit::Layer(index), shards)
            });
            let prefetch = match replaying() {
                false => ahead.next,
                true => ahead.rerun_next,
            };
            if let Some(next) = prefetch {
                let shards = u.shards(stored, next);
                u.gathers.prefetch(Unit::Layer(next), &shards);
            }
            let out = layer_for(x);
            u.gathers.release(names.iter().map(String::as_str));
            out
        }
    }
}

/// The layers whose all-gathers a layer's run submits ahead (none by default).
#[derive(Debug, Clone, Copy, Default)]
struct Ahead {
    /// In forward: the stage's next layer.
    next: Option<usize>,
    /// In a rerun in backward: the stage's recomputed layer that reruns next.
    rerun_next: Option<usize>,
}

/// The rule's schedule for `pp` ranks; refuses what a plan cannot run as asked.
fn schedule(rule: &PipelineRule, pp: usize) -> Result<Schedule, ParallelError> {
    let refuse = |why: String| ParallelError::Invalid(format!("pipeline schedule: {why}"));
    match rule.schedule {
        ScheduleKind::Interleaved1F1B => {}
        _ if rule.chunks != 1 => {
            return Err(refuse(format!(
                "chunks = {} puts several stages on each rank, which only the interleaved \
                 schedule runs; use schedule = \"interleaved\" or chunks = 1",
                rule.chunks
            )));
        }
        _ => {}
    }
    Schedule::build(rule.schedule, pp, rule.micro_batches, rule.chunks).map_err(refuse)
}

/// How many of the `count` layers each of the schedule's stages runs: the rule's
/// `layers_per_stage`, checked, or as even as can be, the first stages taking the remainder.
fn layer_counts(
    rule: &PipelineRule,
    count: usize,
    schedule: &Schedule,
) -> Result<Vec<usize>, ParallelError> {
    let stages = schedule.stages();
    let Some(counts) = &rule.layers_per_stage else {
        return Ok((0..stages)
            .map(|s| count / stages + usize::from(s < count % stages))
            .collect());
    };
    let fits = counts.len() == stages && counts.iter().sum::<usize>() == count;
    if !fits || counts.contains(&0) {
        return Err(ParallelError::Invalid(format!(
            "pipeline layers_per_stage = {counts:?}: `{}` has {count} layers for {stages} \
             stages (pp = {} x chunks = {}); give {stages} counts of at least 1 summing to \
             {count}",
            rule.layers_named(),
            schedule.pp,
            schedule.chunks
        )));
    }
    Ok(counts.clone())
}

/// For each parameter, the index of the layer it belongs to (numbered on through the rule's
/// lists), if it is under one of them or under a module attached to one.
fn layer_indices(
    rule: &PipelineRule,
    slots: &[ParamSlot],
) -> Result<Vec<Option<usize>>, ParallelError> {
    let invalid = |why: String| Err(ParallelError::Invalid(format!("pipeline layers: {why}")));
    // Per parameter, its list and its index in that list.
    let mut in_list = vec![];
    for slot in slots {
        let lists: Vec<usize> = (0..rule.layers.len())
            .filter(|&l| rule.layers[l].contains(&slot.name))
            .collect();
        in_list.push(match lists[..] {
            [] => None,
            [l] => Some((l, list_position(&rule.layers[l], &slot.name)?)),
            _ => {
                return invalid(format!(
                    "parameter `{}` is under two of the lists `{}`; name lists that do not \
                     contain each other",
                    slot.name,
                    rule.layers_named()
                ));
            }
        });
    }
    let mut counts = vec![0; rule.layers.len()];
    for &(l, i) in in_list.iter().flatten() {
        counts[l] = counts[l].max(i + 1);
    }
    let offsets: Vec<usize> = (counts.iter())
        .scan(0, |sum, n| Some(std::mem::replace(sum, *sum + n)))
        .collect();
    let mut layer_of: Vec<Option<usize>> = in_list
        .iter()
        .map(|at| at.map(|(l, i)| offsets[l] + i))
        .collect();
    for attached in &rule.attach {
        let layer = attached.layer.as_str();
        let index = (0..rule.layers.len()).find_map(|l| {
            let list = rule.layers[l].as_str();
            let i = layer
                .strip_prefix(list)?
                .strip_prefix('.')?
                .parse::<usize>()
                .ok()?;
            (i < counts[l]).then_some(offsets[l] + i)
        });
        let Some(index) = index else {
            return invalid(format!(
                "`{}` is attached to `{layer}`, which is not a layer of `{}` (a list's path and \
                 a layer's index in it, such as `{}.0`)",
                attached.module.as_str(),
                rule.layers_named(),
                rule.layers[0].as_str()
            ));
        };
        for (slot, at) in slots.iter().zip(&mut layer_of) {
            if !attached.module.contains(&slot.name) {
                continue;
            }
            if at.is_some() || (rule.first.iter().chain(&rule.last)).any(|p| p.contains(&slot.name))
            {
                return invalid(format!(
                    "parameter `{}` of the attached module `{}` is also under the layers, \
                     `first`, `last` or another attached module: name each module once",
                    slot.name,
                    attached.module.as_str()
                ));
            }
            *at = Some(index);
        }
    }
    Ok(layer_of)
}

/// The index in `list` (a `Vec` of layers) of the layer holding the parameter at `name`.
fn list_position(list: &ModulePath, name: &str) -> Result<usize, ParallelError> {
    let depth = list.depth();
    match name.split('.').nth(depth).map(str::parse::<usize>) {
        Some(Ok(i)) if name.split('.').count() > depth + 1 => Ok(i),
        _ => Err(ParallelError::Invalid(format!(
            "pipeline layers `{}` must name a Vec of layers (`{0}.0`, `{0}.1`, ...), but it \
             holds `{name}`",
            list.as_str(),
        ))),
    }
}

/// Ends a step's deferral (or handing on) of the units' reduce-scatters however the step ends.
struct StopDeferring<'a>(&'a UnitGathers);

impl Drop for StopDeferring<'_> {
    fn drop(&mut self) {
        self.0.stop_deferring();
        self.0.stop_handing();
    }
}

impl LayerUnits {
    /// The fully sharded parameters (layout order) the units gather.
    fn sharded(&self) -> impl Iterator<Item = usize> + '_ {
        let in_layer = |i: usize| self.slots.iter().any(|slots| slots[i].is_some());
        (0..self.root.len()).filter(move |&i| self.root[i].is_some() || in_layer(i))
    }

    /// Gathers the root unit's shards of `model` (the parameters outside the layers) in one
    /// collective, for their reads until released; returns their paths.
    fn gather_root<M: Module>(&self, model: &M) -> Vec<String> {
        let shards = unit_shards(model, &self.root, 1).pop().unwrap_or_default();
        let names = shards.iter().map(|(n, _)| n.clone()).collect();
        let _linked = self.gathers.gather(shards);
        names
    }

    /// The stored rows of layer `index`'s fully sharded parameters in `model`, by path.
    fn shards<M: Module>(&self, model: &M, index: usize) -> Vec<(String, Tensor<1>)> {
        let mut units = unit_shards(model, &self.slots[index], 1);
        units.pop().unwrap_or_default()
    }
}
