//! One training step of a model cut into stages: each micro-batch's forwards and backwards of
//! this rank's stages through the pipeline executor, its layers' units gathered and their
//! gradients handed on.

use super::boundary::Packing;
use super::{LayerUnits, PipelineModel, Stages, StopDeferring};
use crate::data_parallel::BucketedReduction;
use crate::dropout::draws::{self, Draws, Scope};
use crate::error::ParallelError;
use crate::hook::ReadPlacement;
use crate::params::ParamLayout;
use crate::pipeline::{
    ActionKind, BoundaryTensor, PipelineExecutor, PipelineStepReport, StageBoundary, StageOutput,
    WeightGradStore, boundary_tensors, deferral_supported, from_boundary_tensors,
};
use crate::recompute::replaying;
use crate::recompute::{Replays, checkpoint_part};
use crate::zero::units::UnitGathers;
use crate::zero::units::{Unit, after_input};
use burn::module::Module;
use burn::tensor::{Device, Gradients, Tensor};
use flashover_comm::{Group, ReduceOp};
use flashover_runtime::TensorCollectives;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// What every forward of one step reads: micro-batch `k`'s samples (`micro(k)`), how a
/// micro-batch is built from them, the share's dropout draws, the head's loss and the
/// reduction's buckets where forwards run on hooked parameters.
struct StepInputs<'a, M: PipelineModel> {
    micro: &'a (dyn Fn(usize) -> Range<usize> + Sync),
    micro_batch: &'a (dyn Fn(Range<usize>) -> M::Batch + Sync),
    draws: Option<&'a Draws>,
    head: &'a HeadLoss<'a, M>,
    hooks: Option<&'a BucketedReduction>,
}

impl Stages {
    /// One step's forwards and backwards of this rank's stages over `share` (this rank's
    /// samples, cut into the rule's micro-batches, micro-batch `k`'s loss `head(model, x,
    /// batch, k)` on the last stage): the gradients summed over its chunks and its
    /// micro-batches, of the losses as scaled by `loss_scale` (the caller divides by the
    /// micro-batches and the scale), in `model`'s layout, and the mean loss and auxiliary loss
    /// of the share on the device (two f32 elements, the same on every rank of `pp`). With
    /// `hooks`, every forward runs on hooked parameters that hand their gradients to the
    /// reduction's buckets during backward (those are then zero in the returned sums): see [`Self::hooks_allowed`].
    /// With `draws` (the share's), each micro-batch's dropout draws its samples' one-device
    /// masks, its embedding, each layer and its head in their own scopes (whichever rank runs
    /// them); without, the device's generator draws them.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::parallelize) fn step<M>(
        &self,
        model: &M,
        share: Range<usize>,
        draws: Option<&Draws>,
        device: &Device,
        micro_batch: &(dyn Fn(Range<usize>) -> M::Batch + Sync),
        head: &HeadLoss<'_, M>,
        loss_scale: Option<f32>,
        hooks: Option<&BucketedReduction>,
    ) -> Result<(Tensor<1>, Tensor<1>, PipelineStepReport), ParallelError>
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
        let (deferring, _stop) = self.route_unit_scatters(hooks)?;
        let per = share.len() / m;
        let micro = |k: usize| share.start + k * per..share.start + (k + 1) * per;
        let boundary = self.boundary(model, micro(0), micro_batch)?;
        let step = StepInputs {
            micro: &micro,
            micro_batch,
            draws,
            head,
            hooks,
        };
        let forward = |chunk: usize, master: &M, input: Option<Vec<BoundaryTensor>>, k: usize| {
            self.chunk_forward(&step, chunk, master, input, k)
        };
        let chunks = vec![model.clone(); self.schedule.chunks];
        // Gradients of parameters outside the model (hot-expert copies) go to them.
        let take = |grads: &mut Gradients| self.copies.take_grads(grads);
        let executor = self.executor(&take, hooks, loss_scale, device)?;
        // Every chunk is the same model (its own stages' parameters): sum them in place.
        let (flats, sums, report) = executor.step_flat(&chunks, &boundary, device, forward)?;
        // A zero-bubble step whose weight gradients were not deferred would silently be 1F1B.
        if self.splits_backward() && report.deferred_weight_grads == 0 {
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
        let mut losses = sums.div_scalar(m as f32);
        if self.pp.size() > 1 {
            losses = self.pp.all_reduce_tensor(losses, ReduceOp::Sum)?;
        }
        Ok((flat, losses, report))
    }

    /// Micro-batch `k`'s forward of chunk `chunk` of this rank's stages on `master` (the
    /// model's f32 parameters), from the previous stage's `input` (the embedding on the first
    /// stage): the stage's layers, then the head's loss on the last stage or the activation
    /// to send on.
    fn chunk_forward<M>(
        &self,
        step: &StepInputs<'_, M>,
        chunk: usize,
        master: &M,
        input: Option<Vec<BoundaryTensor>>,
        k: usize,
    ) -> StageOutput
    where
        M: PipelineModel + Sync + 'static,
    {
        if let Some(units) = &self.units {
            units.gathers.new_forward();
        }
        // Hooks on the f32 parameters, under the casts: the buckets receive f32. Each layer
        // hooks its own (`layer`); those outside the layers are hooked at their first read,
        // after the activation held then (`latest`): the embedding's at the end of backward,
        // a final norm's and a head's once the head's backward is done, where the layers'
        // output is one tensor ([`sole_input`]). (A compute dtype's view reads them all
        // before the layers.)
        let latest = Arc::new(Mutex::new(None));
        let hooked = (step.hooks).map(|h| {
            let placement = ReadPlacement::Latest(latest.clone());
            h.hooked_at_reads(master, &|i| self.outside[i], placement)
        });
        let master = hooked.as_ref().unwrap_or(master);
        // Each micro-batch's graph casts the parameters anew (the view's casts are nodes
        // of that graph): their gradients reach the f32 parameters in f32. The layers'
        // are left in f32 here: each layer casts its own.
        let view = self.compute_view_of(master, &self.outside);
        let m = view.as_ref().unwrap_or(master);
        let stage = self.schedule.stage_of(self.pp.rank(), chunk);
        let samples = (step.micro)(k);
        let batch = Arc::new((step.micro_batch)(samples.clone()));
        let draws = step.draws.map(|d| d.for_samples(samples));
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
            let (y, layer_aux) = self.layer(m, i, x, &batch, draws, step.hooks);
            x = y;
            aux = match (aux, layer_aux) {
                (Some(sum), Some(more)) => Some(sum + more),
                (sum, more) => sum.or(more),
            };
        }
        if step.hooks.is_some() {
            let (held, input) = sole_input(x);
            x = held;
            *latest.lock().unwrap_or_else(|p| p.into_inner()) = input;
        }
        let output = match stage == self.schedule.stages() - 1 {
            true => StageOutput::Loss(draws::in_scope(draws, Scope::After, || {
                (step.head)(m, x, &batch, k)
            })),
            false => StageOutput::Activation(boundary_tensors(x)),
        };
        if let (Some(units), Some(names)) = (self.units.as_deref(), root) {
            units.gathers.release(names.iter().map(String::as_str));
        }
        StageOutput::with_aux_loss(output, aux)
    }

    /// Where this step's unit reduce-scatters go: they run while backward goes on and join the
    /// gradients after the last backward (the units returned, deferring); where a bucket
    /// reduces a unit's gradient over the other data axes (HSDP), the bucket takes the
    /// reduce-scatter unwaited and waits for it on its own thread. With the guard that ends
    /// either however the step ends.
    fn route_unit_scatters(
        &self,
        hooks: Option<&BucketedReduction>,
    ) -> Result<(Option<&LayerUnits>, Option<StopDeferring<'_>>), ParallelError> {
        if let Some(units) = &self.units {
            // A step that failed half-way may have left a layer's all-gather of old values.
            units.gathers.discard_prefetches()?;
        }
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
        let stop = self.units.as_deref().map(|u| StopDeferring(&u.gathers));
        Ok((deferring, stop))
    }

    /// The executor of this rank's schedule for one step: gradients of parameters outside the
    /// model taken by `take`, summed over micro-batches, handed to `hooks` during backward,
    /// losses scaled by `loss_scale` before backward (gradients returned unscaled), weight
    /// gradients deferred under zero-bubble (refused on a device without the deferral op).
    fn executor<'a>(
        &'a self,
        take: &'a (dyn Fn(&mut Gradients) + Sync),
        hooks: Option<&'a BucketedReduction>,
        loss_scale: Option<f32>,
        device: &Device,
    ) -> Result<PipelineExecutor<'a>, ParallelError> {
        let mut executor = PipelineExecutor::new(&self.schedule, &self.pp)?
            .taking_gradients(take)
            .summing();
        if let Some(hooks) = hooks {
            executor = executor.with_backward_sink(hooks);
        }
        if let Some(scale) = loss_scale {
            executor = executor.with_loss_scale(scale);
        }
        if self.splits_backward() {
            if !deferral_supported(device) {
                return Err(ParallelError::Invalid(format!(
                    "pipeline schedule: zb-h1 defers the layers' weight gradients through an op \
                     built for Flex and the CubeCL backend (wgpu, CUDA), not for {device:?}; \
                     use 1f1b there"
                )));
            }
            executor = executor.deferring_weight_grads(WeightGradStore::default());
        }
        Ok(executor)
    }
}

impl Stages {
    /// Whether a step's gradients may reach a reduction through hooks during backward: one
    /// chunk per rank (its backwards cover every parameter it holds, the last of them last),
    /// no deferred weight gradients (zero-bubble adds them after their backward), no
    /// hot-expert copies (their gradients are folded into the owners' before the reduction).
    pub(in crate::parallelize) fn hooks_allowed(&self) -> bool {
        self.hooks_ruled_out().is_none()
    }

    /// Why a step's gradients cannot reach a reduction through hooks during backward, if
    /// they cannot (see [`Self::hooks_allowed`]).
    pub(in crate::parallelize) fn hooks_ruled_out(&self) -> Option<&'static str> {
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
    pub(super) fn compute_view_of<M: Module>(&self, model: &M, part: &[bool]) -> Option<M> {
        let policy = self.precision.as_ref()?;
        Some(policy.compute_view_of(model.clone(), part))
    }

    /// Whether the schedule splits backward into input- and weight-gradient actions
    /// (zero-bubble).
    pub(in crate::parallelize) fn splits_backward(&self) -> bool {
        self.schedule
            .ranks
            .iter()
            .flatten()
            .any(|a| a.kind == ActionKind::BackwardWeight)
    }

    /// Gathers each layer's fully sharded parameters (`sharded`, layout order) in one
    /// collective over `group` before the layer runs, instead of one per parameter as it reads
    /// them.
    pub(in crate::parallelize) fn gather_layers(
        &mut self,
        units: UnitGathers,
        group: &Group,
        sharded: &[bool],
    ) {
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

    /// The layers whose all-gathers layer `index` prefetches: in forward the stage's next; in
    /// a rerun in backward the stage's closest recomputed layer before it, which reruns next
    /// (FSDP's backward prefetch).
    fn ahead_of(&self, index: usize) -> Ahead {
        let stage = self.layers.iter().find(|l| l.contains(&index)).cloned();
        let stage = stage.unwrap_or(index..index + 1);
        Ahead {
            next: (index + 1 < stage.end).then_some(index + 1),
            rerun_next: (stage.start..index)
                .rev()
                .find(|&i| self.recompute.recomputes_block(i)),
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
        let ahead = self.ahead_of(index);
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

    /// Whether this rank runs the pipeline's last stage (where the loss is computed).
    pub(in crate::parallelize) fn runs_last_stage(&self) -> bool {
        self.schedule.place(self.schedule.stages() - 1).0 == self.pp.rank()
    }

    /// Layer forwards run again in backward so far.
    pub(in crate::parallelize) fn recomputed(&self) -> usize {
        self.recomputed.load(Ordering::Relaxed)
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
    input_picked(x, |needing| needing.into_iter().next())
}

/// [`with_input`] where `x` has one tensor that needs a gradient, `None` where it has several:
/// a hook placed after a tensor hands it no gradient, so the tensor must get one from what
/// reads it, and of several only one may be read (a head reading one of two streams).
fn sole_input<A: StageBoundary>(x: A) -> (A, Option<Tensor<1>>) {
    input_picked(x, |needing| {
        <[_; 1]>::try_from(needing).ok().map(|[only]| only)
    })
}

/// `x` as it was, and the tensor `pick` takes of those of `x` that need a gradient (flat, in
/// order).
fn input_picked<A: StageBoundary>(
    x: A,
    pick: impl FnOnce(Vec<Tensor<1>>) -> Option<Tensor<1>>,
) -> (A, Option<Tensor<1>>) {
    let parts = boundary_tensors(x);
    let needing = parts.iter().filter(|p| p.grad).map(|p| p.flat.clone());
    let input = pick(needing.collect());
    (from_boundary_tensors(parts), input)
}

/// How a layer whose parameters are fully sharded units runs ([`run_layer`]).
pub(super) struct UnitRun<'a> {
    pub(super) units: &'a LayerUnits,
    /// The layers whose all-gathers the run submits.
    pub(super) ahead: Ahead,
    /// One of the layer's input tensors ([`with_input`]): the unit reduce-scatters right
    /// after the layer's backward; without it, at the end of backward.
    pub(super) input: Option<Tensor<1>>,
}

/// Layer `index` of `view` on `x` of micro-batch `batch` and its auxiliary loss, its dropout
/// drawn from `draws` as layer `index`. When the layers are `units`, its fully sharded
/// parameters are gathered at once first from `stored`'s rows (the f32 parameters `view` may
/// be a cast view of), and then the all-gathers of the layers ahead submitted.
pub(super) fn run_layer<M>(
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
pub(super) struct Ahead {
    /// In forward: the stage's next layer.
    next: Option<usize>,
    /// In a rerun in backward: the stage's recomputed layer that reruns next.
    rerun_next: Option<usize>,
}
