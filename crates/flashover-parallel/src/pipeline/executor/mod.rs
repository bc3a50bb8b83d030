//! Runs a [`Schedule`] on this rank's model chunks: forwards and backwards in the schedule's
//! order, activations and their gradients sent to the neighbouring stages through the
//! collective layer, each run of consecutive sends and receives as one batch
//! ([`flashover_runtime::TensorCollectives::exchange_flat`]; NCCL runs it as one group).
//!
//! A stage's input arrives as a new autodiff leaf; its backward is `(output * grad).sum()`
//! backpropagated, after which the input's gradient goes back upstream (the recipe the
//! project notes verified: parameter gradients equal the unsplit model's). Losses are
//! per-micro-batch means, so gradients are averaged over micro-batches, as one rank computing
//! the whole batch would. Zero-bubble's input/weight split is real for linear layers that run
//! through [`super::deferred_linear`] with the store given to
//! [`PipelineExecutor::deferring_weight_grads`]: the input-gradient action computes everything
//! but their weight gradients, which the weight-gradient action computes. Without a store the
//! input-gradient action runs the whole backward and the weight-gradient action has nothing to
//! do (exact, but the bubble is 1F1B's). Each forward runs inside the store's scope, so
//! plan-aware linear layers (`crate::nn::Linear`, the reference transformer's layer hooks)
//! defer without being handed the store.

mod exchange;

use super::boundary::{BoundaryTensor, PartSpec};
use super::schedule::{Action, ActionKind, Schedule, steps_of};
use super::simulate::{unbuffered_deadlock, validate};
use super::weight_grad::{DeferredWeightGrad, WeightGradStore, deferring_in};
use crate::error::ParallelError;
use crate::params::{ParamLayout, accumulate_grads};
use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Gradients, Tensor};
use flashover_comm::Group;
use std::borrow::Cow;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What a chunk's forward returns: the activation for the next stage (the tensors of its
/// [`super::StageBoundary`]), or on the last virtual stage the micro-batch's loss.
pub enum StageOutput {
    /// Output activation, as its boundary's tensors.
    Activation(Vec<BoundaryTensor>),
    /// Mean loss of the micro-batch.
    Loss(Tensor<1>),
    /// Either of the above and a loss of the chunk's own (a mixture-of-experts router's
    /// auxiliary losses): its backward adds it to what it backpropagates, scaled as the
    /// losses are, so its gradient stays on this stage (Megatron's auxiliary-loss scaler);
    /// it is not part of the reported loss.
    WithAuxLoss(Box<StageOutput>, Tensor<1>),
}

impl StageOutput {
    /// `output` with the auxiliary loss `aux`, if there is one.
    pub fn with_aux_loss(output: StageOutput, aux: Option<Tensor<1>>) -> Self {
        match aux {
            Some(aux) => StageOutput::WithAuxLoss(Box::new(output), aux),
            None => output,
        }
    }

    /// The activation or loss itself.
    fn main(&self) -> &StageOutput {
        match self {
            StageOutput::WithAuxLoss(main, _) => main.main(),
            main => main,
        }
    }

    /// The sum of its auxiliary losses, in f32 outside the graph (`None` without any): kept
    /// on the device with the step's losses.
    fn aux_total(&self) -> Option<Tensor<1>> {
        match self {
            StageOutput::WithAuxLoss(main, aux) => {
                let aux = aux.clone().detach().cast(DType::F32);
                Some(match main.aux_total() {
                    Some(more) => aux + more,
                    None => aux,
                })
            }
            _ => None,
        }
    }

    /// The activation or loss, and the auxiliary losses (summed).
    fn split(self) -> (StageOutput, Option<Tensor<1>>) {
        match self {
            StageOutput::WithAuxLoss(main, aux) => match main.split() {
                (main, Some(more)) => (main, Some(aux + more)),
                (main, None) => (main, Some(aux)),
            },
            main => (main, None),
        }
    }
}

/// What one step measured on this rank.
#[derive(Debug, Clone, Default)]
pub struct PipelineStepReport {
    /// Time in forwards.
    pub forward: Duration,
    /// Time in backwards (input- and weight-gradient actions included).
    pub backward: Duration,
    /// Of `backward`, the time in weight-gradient actions.
    pub weight_grad: Duration,
    /// How many weight gradients the weight-gradient actions computed (deferred ones).
    pub deferred_weight_grads: usize,
    /// Time in the batches of transfers that receive something (their sends included).
    pub recv_wait: Duration,
    /// Wall time of the whole schedule on this rank (first action to last).
    pub wall: Duration,
    /// The most micro-batches whose activations (forward graphs) this rank held at once.
    pub peak_in_flight: usize,
    /// Every compute action and receive wait, in order, with its start and end.
    pub events: Vec<(Action, Instant, Instant)>,
}

/// Runs `schedule` for pipeline rank `group.rank()`; see the module docs.
pub struct PipelineExecutor<'a> {
    /// The schedule run: as given, or with its transfers placed for an unbuffered engine.
    schedule: Cow<'a, Schedule>,
    group: &'a Group,
    weight_grads: Option<WeightGradStore>,
    /// Called with each backward's gradients before the chunk's are read.
    take_gradients: Option<&'a (dyn Fn(&mut Gradients) + Sync)>,
    /// The factor the last stage's losses are multiplied by before backward.
    loss_scale: f32,
    /// Told before each backward whether it is the step's last (a gradient reduction whose
    /// hooks the forwards carry).
    backward_sink: Option<&'a dyn BackwardSink>,
    /// Return the gradients as sums over micro-batches of the scaled losses' (the caller
    /// divides), not as means.
    sums: bool,
}

/// What a gradient reduction fed by hooks during backward needs from the executor: before each
/// backward, whether it is this rank's last of the step (whose complete buckets are then
/// reduced while it runs).
pub(crate) trait BackwardSink: Sync {
    /// Called before each backward action.
    fn begin_backward(&self, last: bool);
    /// Called after each backward action, once its gradients were read: what the hooks did
    /// not report got no gradient from it.
    fn end_backward(&self) -> Result<(), ParallelError>;
}

impl<'a> PipelineExecutor<'a> {
    /// Validates `schedule` (before anything runs) for a pipeline group of matching size.
    pub fn new(schedule: &'a Schedule, group: &'a Group) -> Result<Self, ParallelError> {
        if group.size() != schedule.pp {
            return Err(ParallelError::Invalid(format!(
                "schedule for pp = {} on a pipeline group of {} ranks",
                schedule.pp,
                group.size()
            )));
        }
        validate(schedule).map_err(|e| ParallelError::Invalid(e.to_string()))?;
        let mut schedule = Cow::Borrowed(schedule);
        if group.size() > 1
            && !group.sends_are_buffered()
            && let Some(stuck) = unbuffered_deadlock(&schedule)
        {
            // The same computations with Megatron's steady-state placement of the transfers.
            let paired = schedule.as_ref().clone().with_steady_pairs();
            if validate(&paired).is_err() || unbuffered_deadlock(&paired).is_some() {
                return Err(ParallelError::Invalid(format!(
                    "a pipeline over `{}`: its engine's sends wait for their receives (NCCL), \
                     and this schedule would deadlock there even with each rank's consecutive \
                     transfers in one batch ({stuck}), with its transfers placed as built or \
                     as Megatron places them; use another schedule, or the thread or MPI engine",
                    group.name()
                )));
            }
            schedule = Cow::Owned(paired);
        }
        Ok(PipelineExecutor {
            schedule,
            group,
            weight_grads: None,
            take_gradients: None,
            loss_scale: 1.0,
            backward_sink: None,
            sums: false,
        })
    }

    /// Tells `sink` before each backward whether it is this rank's last of the step.
    pub(crate) fn with_backward_sink(mut self, sink: &'a dyn BackwardSink) -> Self {
        self.backward_sink = Some(sink);
        self
    }

    /// Returns each chunk's gradients summed over micro-batches, of the losses as scaled
    /// (not averaged nor unscaled): for a caller that reduces the sums and divides after.
    pub(crate) fn summing(mut self) -> Self {
        self.sums = true;
        self
    }

    /// Multiplies the losses by `scale` before backward (loss scaling) and divides the
    /// returned gradients by it.
    pub fn with_loss_scale(mut self, scale: f32) -> Self {
        self.loss_scale = scale;
        self
    }

    /// Hands every backward's gradients to `take` before the chunk's own are read: for
    /// parameters outside the chunks that the forward used (hot experts' copies).
    pub fn taking_gradients(mut self, take: &'a (dyn Fn(&mut Gradients) + Sync)) -> Self {
        self.take_gradients = Some(take);
        self
    }

    /// Weight gradients deferred to `store` by [`super::deferred_linear`] during a backward
    /// are computed at the micro-batch's weight-gradient action (at once after a plain
    /// backward). The forward must use the same store.
    pub fn deferring_weight_grads(mut self, store: WeightGradStore) -> Self {
        self.weight_grads = Some(store);
        self
    }

    /// One step over every micro-batch: `forward(chunk, module, input, micro)` runs chunk
    /// `chunk` (its module is `chunks[chunk]`) on `input` (`None` on the first virtual stage,
    /// which reads micro-batch `micro` itself). Every boundary carries tensors as `boundary`
    /// says (in order: shape, dtype, whether a gradient comes back), on `device` (an autodiff
    /// device). Returns, per chunk, its gradients averaged over micro-batches in its flat
    /// layout ([`ParamLayout`]); the step's sums of the last stage's losses and of this rank's
    /// auxiliary losses, on the device (two f32 elements, 0 where none ran: the caller reads
    /// them when it reports, so the step waits for nothing); and what the step measured.
    pub fn step_flat<M, F>(
        &self,
        chunks: &[M],
        boundary: &[PartSpec],
        device: &Device,
        forward: F,
    ) -> Result<(Vec<Tensor<1>>, Tensor<1>, PipelineStepReport), ParallelError>
    where
        M: Module,
        F: Fn(usize, &M, Option<Vec<BoundaryTensor>>, usize) -> StageOutput,
    {
        let s = &*self.schedule;
        if chunks.len() != s.chunks {
            return Err(ParallelError::Invalid(format!(
                "the schedule has {} chunks per rank; {} were given",
                s.chunks,
                chunks.len()
            )));
        }
        let mut state = StepState::new(chunks, device);
        if let Some(store) = &self.weight_grads {
            store.take(); // Nothing left over from a failed step may leak into this one.
        }
        let is_backward =
            |a: &Action| matches!(a.kind, ActionKind::Backward | ActionKind::BackwardInput);
        // The transfers between two computations go as one batch: where sends wait for their
        // receives (NCCL), two stages sending to each other at once need that.
        let steps: Vec<&[Action]> = steps_of(&s.ranks[self.group.rank()]).collect();
        let last_backward = steps.iter().rposition(|step| is_backward(&step[0]));
        let started = Instant::now();
        for (index, step) in steps.iter().enumerate() {
            let a = &step[0];
            let t0 = Instant::now();
            match a.kind {
                _ if !a.is_compute() => {
                    let (held, report) = (&mut state.held, &mut state.report);
                    self.exchange(step, boundary, device, held, report)?;
                    continue;
                }
                ActionKind::Forward => self.run_forward(a, chunks, &forward, &mut state),
                ActionKind::Backward | ActionKind::BackwardInput => {
                    let last = Some(index) == last_backward;
                    self.run_backward(a, chunks, boundary, last, &mut state)?
                }
                ActionKind::BackwardWeight => state.add_deferred(a)?,
                ActionKind::SendActivation
                | ActionKind::RecvActivation
                | ActionKind::SendGrad
                | ActionKind::RecvGrad => unreachable!("transfers go in batches"),
            }
            state.report.events.push((*a, t0, Instant::now()));
        }
        let losses = state.losses.sums(&state.grad_device);
        state.report.wall = started.elapsed();
        debug_assert!(
            state.deferred.is_empty(),
            "validated: every input gradient has its weight's"
        );
        let mut flats = state.flats;
        if !self.sums {
            let m = s.micro_batches as f32 * self.loss_scale;
            flats = flats.into_iter().map(|flat| flat.div_scalar(m)).collect();
        }
        Ok((flats, losses, state.report))
    }

    /// A forward action: chunk `a.chunk` on micro-batch `a.micro`'s input, its output kept
    /// for the backward (and its loss counted, on the last stage).
    fn run_forward<M, F>(&self, a: &Action, chunks: &[M], forward: &F, state: &mut StepState)
    where
        F: Fn(usize, &M, Option<Vec<BoundaryTensor>>, usize) -> StageOutput,
    {
        let t0 = Instant::now();
        let key = (a.micro, a.chunk);
        let input = state.held.inputs.remove(&key);
        let run = || forward(a.chunk, &chunks[a.chunk], input.clone(), a.micro);
        let out = match &self.weight_grads {
            Some(store) => deferring_in(store, run),
            None => run(),
        };
        if let StageOutput::Loss(loss) = out.main() {
            state.losses.add(0, loss.clone().detach().cast(DType::F32));
        }
        if let Some(aux) = out.aux_total() {
            state.losses.add(1, aux);
        }
        let report = &mut state.report;
        state.held.outputs.insert(key, (input, out));
        report.forward += t0.elapsed();
        report.peak_in_flight = report.peak_in_flight.max(state.held.outputs.len());
    }

    /// A backward action (whole, or the input gradients of zero-bubble's split): the chunk's
    /// backward of micro-batch `a.micro`, its parameters' gradients added to the chunk's sum
    /// and its input's kept to send upstream. `last`: the step's last backward.
    fn run_backward<M: Module>(
        &self,
        a: &Action,
        chunks: &[M],
        boundary: &[PartSpec],
        last: bool,
        state: &mut StepState,
    ) -> Result<(), ParallelError> {
        let t0 = Instant::now();
        let key = (a.micro, a.chunk);
        if let Some(sink) = self.backward_sink {
            sink.begin_backward(last);
        }
        let (input, out) = state
            .held
            .outputs
            .remove(&key)
            .expect("validated: forward first");
        let (out, aux) = out.split();
        // A chunk's own loss, scaled as the losses are, in f32.
        let aux = aux.map(|aux| aux.cast(DType::F32).mul_scalar(self.loss_scale));
        let missing = || {
            ParallelError::Invalid(format!(
                "rank {}: no output gradient for micro-batch {} chunk {}",
                self.group.rank(),
                a.micro,
                a.chunk
            ))
        };
        // A layer recomputed in this backward defers as its first forward did.
        let output_grads = state.held.grads_out.remove(&key);
        let backward = || -> Result<Gradients, ParallelError> {
            let objective = backward_objective(out, aux, output_grads, self.loss_scale);
            Ok(objective.ok_or_else(missing)?.backward())
        };
        let mut grads = match &self.weight_grads {
            Some(store) => deferring_in(store, backward)?,
            None => backward()?,
        };
        if let Some(take) = self.take_gradients {
            take(&mut grads);
        }
        let inner = state.grad_device.clone();
        if let Some(got) = input.and_then(|parts| input_gradients(&parts, &grads, boundary, &inner))
        {
            state.held.grads_in.insert(key, got);
        }
        state.accumulate(&chunks[a.chunk], a.chunk, grads);
        if let Some(sink) = self.backward_sink {
            sink.end_backward()?;
        }
        if let Some(store) = &self.weight_grads {
            let pending = store.take();
            if a.kind == ActionKind::Backward {
                add_weight_grads(pending, &state.offsets[a.chunk], &mut state.flats[a.chunk])?;
            } else {
                state.deferred.insert(key, pending);
            }
        }
        state.report.backward += t0.elapsed();
        Ok(())
    }
}

/// One step's running state on this rank: per chunk its gradients summed over the
/// micro-batches (on the device) and where each parameter sits in them, the weight gradients
/// zero-bubble deferred, what is in flight between actions, and the report.
struct StepState {
    flats: Vec<Tensor<1>>,
    offsets: Vec<HashMap<ParamId, usize>>,
    deferred: HashMap<(usize, usize), Vec<DeferredWeightGrad>>,
    held: InFlight,
    report: PipelineStepReport,
    /// The step's loss and auxiliary-loss sums so far, on the device.
    losses: LossSums,
    /// The gradients' device (the step's, outside autodiff).
    grad_device: Device,
}

/// A step's sums of the last stage's losses (0) and of every stage's auxiliary losses (1), kept
/// on the device as the micro-batches run: nothing is read to the host inside the step.
#[derive(Default)]
struct LossSums([Option<Tensor<1>>; 2]);

impl LossSums {
    /// Adds `value` (a one-element f32 tensor outside the graph) to sum `which`.
    fn add(&mut self, which: usize, value: Tensor<1>) {
        self.0[which] = Some(match self.0[which].take() {
            Some(sum) => sum + value,
            None => value,
        });
    }

    /// Both sums as one two-element tensor on `device` (0 where nothing was added).
    fn sums(&mut self, device: &Device) -> Tensor<1> {
        let sums = self.0.each_mut().map(|sum| {
            sum.take()
                .unwrap_or_else(|| Tensor::zeros([1], device))
                .reshape([1])
        });
        Tensor::cat(sums.to_vec(), 0)
    }
}

impl StepState {
    fn new<M: Module>(chunks: &[M], device: &Device) -> Self {
        let layouts: Vec<ParamLayout> = chunks.iter().map(ParamLayout::of).collect();
        let grad_device = device.clone().inner();
        StepState {
            flats: (layouts.iter())
                .map(|l| Tensor::zeros([l.numel], &grad_device))
                .collect(),
            offsets: (layouts.iter())
                .map(|l| l.slots.iter().map(|s| (s.id, s.offset)).collect())
                .collect(),
            deferred: HashMap::new(),
            held: InFlight::default(),
            report: PipelineStepReport::default(),
            losses: LossSums::default(),
            grad_device,
        }
    }

    /// `grads` of `chunk` (chunk number `index`) added to its sum.
    fn accumulate<M: Module>(&mut self, chunk: &M, index: usize, grads: Gradients) {
        let params = GradientsParams::from_grads(grads, chunk);
        let empty = Tensor::empty([0], &self.grad_device);
        let flat = std::mem::replace(&mut self.flats[index], empty);
        self.flats[index] = accumulate_grads(chunk, &params, flat, &[]).0;
    }

    /// A weight-gradient action (zero-bubble): the weight gradients its input-gradient action
    /// deferred, computed and added to the chunk's sum.
    fn add_deferred(&mut self, a: &Action) -> Result<(), ParallelError> {
        let t0 = Instant::now();
        let pending = self
            .deferred
            .remove(&(a.micro, a.chunk))
            .unwrap_or_default();
        self.report.deferred_weight_grads += pending.len();
        add_weight_grads(pending, &self.offsets[a.chunk], &mut self.flats[a.chunk])?;
        self.report.backward += t0.elapsed();
        self.report.weight_grad += t0.elapsed();
        Ok(())
    }
}

type Parts = Vec<BoundaryTensor>;

/// Tensors to send, each with its destination rank.
type Sends = Vec<(Tensor<1>, usize)>;

/// What a stage's backward differentiates for one micro-batch: its loss scaled by
/// `loss_scale` (the last stage), or the sum of each output tensor times its gradient
/// received from the next stage (`output_grads`, in the order of the outputs that carry one),
/// plus the chunk's own auxiliary loss `aux` (in f32, scaled). `None` when gradients are due
/// but none came.
fn backward_objective(
    out: StageOutput,
    aux: Option<Tensor<1>>,
    output_grads: Option<Vec<Tensor<1>>>,
    loss_scale: f32,
) -> Option<Tensor<1>> {
    Some(match (out, aux) {
        (StageOutput::Loss(loss), None) if loss_scale != 1.0 => loss.mul_scalar(loss_scale),
        (StageOutput::Loss(loss), None) => loss,
        (StageOutput::Loss(loss), Some(aux)) => loss.cast(DType::F32).mul_scalar(loss_scale) + aux,
        (StageOutput::Activation(parts), aux) => {
            let ys = parts.into_iter().filter(|p| p.grad).map(|p| p.flat);
            // Received in the output's dtype; into the graph's autodiff context on the device,
            // as a constant (no host round trip).
            let mut products: Vec<Tensor<1>> = (ys.zip(output_grads?))
                .map(|(y, g)| {
                    let g = crate::params::in_context_of(g, &y);
                    (y * g).sum()
                })
                .collect();
            if products.is_empty() {
                return None;
            }
            // One tensor (and no auxiliary loss) backpropagates in its own dtype, as a
            // single-tensor boundary always did.
            let first = products.remove(0);
            let mut objective = match (products.len(), &aux) {
                (0, None) => first,
                _ => first.cast(DType::F32),
            };
            for more in products {
                objective = objective + more.cast(DType::F32);
            }
            match aux {
                Some(aux) => objective + aux,
                None => objective,
            }
        }
        (StageOutput::WithAuxLoss(..), _) => unreachable!("split"),
    })
}

/// The gradients a stage's backward (`grads`) gave its input `parts` that carry one, to send
/// to the stage before; `None` when none got one. A tensor the stage did not read (an
/// encoder's output past the last layer that reads it) has a zero gradient; one that none got
/// means a stage cut off from its input, reported when its gradient is due.
fn input_gradients(
    parts: &[BoundaryTensor],
    grads: &Gradients,
    boundary: &[PartSpec],
    device: &Device,
) -> Option<Vec<Tensor<1>>> {
    let got: Vec<Option<Tensor<1>>> = (parts.iter().filter(|p| p.grad))
        .map(|p| p.flat.grad(grads))
        .collect();
    if !got.iter().any(Option::is_some) {
        return None;
    }
    let zeros = |spec: &PartSpec| Tensor::<1>::zeros([spec.numel()], device).cast(spec.dtype);
    let differentiable = boundary.iter().filter(|p| p.grad);
    Some(
        (got.into_iter().zip(differentiable))
            .map(|(g, spec)| g.unwrap_or_else(|| zeros(spec)))
            .collect(),
    )
}

/// What a step holds between its actions, by (micro-batch, chunk).
#[derive(Default)]
struct InFlight {
    /// Received inputs not yet run forward.
    inputs: HashMap<(usize, usize), Parts>,
    /// Forwards not yet run backward: their inputs and outputs.
    outputs: HashMap<(usize, usize), (Option<Parts>, StageOutput)>,
    /// Gradients of the inputs (the boundary's differentiable tensors, in its order), to send.
    grads_in: HashMap<(usize, usize), Vec<Tensor<1>>>,
    /// Received gradients of the outputs.
    grads_out: HashMap<(usize, usize), Vec<Tensor<1>>>,
}

/// Computes deferred weight gradients and adds each at its parameter's offset in `flat` (on
/// the device).
fn add_weight_grads(
    pending: Vec<DeferredWeightGrad>,
    offsets: &HashMap<ParamId, usize>,
    flat: &mut Tensor<1>,
) -> Result<(), ParallelError> {
    for grad in pending {
        let offset = *offsets.get(&grad.param).ok_or_else(|| {
            ParallelError::Invalid(format!(
                "a deferred weight gradient for parameter {} that is not in this chunk",
                grad.param
            ))
        })?;
        let g = grad.compute();
        let numel = g.shape().num_elements();
        let range = offset..offset + numel;
        // Computed in the layer's compute dtype; summed in f32 with the rest.
        let g = g
            .reshape([numel])
            .cast(DType::F32)
            .to_device(&flat.device());
        let sum = flat.clone().slice(range.clone()) + g;
        let whole = std::mem::replace(flat, Tensor::empty([0], &sum.device()));
        *flat = whole.slice_assign(range, sum);
    }
    Ok(())
}
