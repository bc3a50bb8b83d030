//! A user's model cut into pipeline stages by a plan's [`PipelineRule`], and one training
//! step of it through the pipeline executor.
//!
//! Every rank keeps the model's whole structure, but holds only the parameters of its stages:
//! the others become one-element placeholders (so a stage's memory is its share). The model
//! runs a stage through [`PipelineModel`]: the first stage embeds the micro-batch, each stage
//! runs its layers, the last computes the loss. A module the first and the last stage both
//! run (an embedding tied to the head) is held by both; their gradients are summed so the
//! copies stay equal, and the first stage's copy is the one counted and gathered.

use crate::error::ParallelError;
use crate::expert_parallel::Replicas;
use crate::params::{ParamLayout, ParamSlot};
use crate::pipeline::{PartSpec, Schedule, ScheduleKind, StageBoundary};
use crate::placement::{PlacementTable, Tie};
use crate::plan::CheckpointPolicy;
use crate::plan::{ModulePath, PipelineRule};
use crate::precision::{MixedPrecision, Precision};
use crate::zero::units::{UnitGathers, unit_shards};
use burn::module::Module;
use burn::tensor::Tensor;
use flashover_comm::Group;
use flashover_runtime::Axis;
use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

mod boundary;
mod step;

pub use step::HeadLoss;

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

    /// The pipeline's ranks when the stages span more than one (a rank's forward is then a
    /// stage's); `None` for a pipeline rule of one stage.
    pub(super) fn split_ranks(&self) -> Option<&Group> {
        (self.schedule.pp > 1).then_some(&self.pp)
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
