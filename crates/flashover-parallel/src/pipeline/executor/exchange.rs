//! The transfers between stages: each run of consecutive sends and receives of a rank's
//! schedule goes as one batch ([`flashover_runtime::TensorCollectives::exchange_flat`]), its
//! sends taken out of the step's in-flight state and its receives put back in.

use super::{InFlight, PipelineExecutor, PipelineStepReport, Sends, StageOutput};
use crate::error::ParallelError;
use crate::params::with_autodiff;
use crate::pipeline::boundary::{BoundaryTensor, PartSpec, specs_of};
use crate::pipeline::schedule::{Action, ActionKind};
use burn::tensor::{Device, GradientCheckpointingStrategy, Tensor};
use flashover_runtime::{Incoming, TensorCollectives};
use std::time::Instant;

impl PipelineExecutor<'_> {
    /// The transfers of `run` (consecutive sends and receives of this rank's schedule) as one
    /// batch: what the sends carry comes out of `held`, what arrives goes into it.
    pub(super) fn exchange(
        &self,
        run: &[Action],
        boundary: &[PartSpec],
        device: &Device,
        held: &mut InFlight,
        report: &mut PipelineStepReport,
    ) -> Result<(), ParallelError> {
        let inner = device.clone().inner();
        let (sends, incoming) = self.transfers(run, boundary, held)?;
        let t0 = Instant::now();
        // Received outside autodiff (so a CUDA tensor's buffer can go to the engine); an input
        // joins the graph below, as a leaf on `device` would.
        let received = self.group.exchange_flat(&sends, &incoming, &inner)?;
        drop(sends);
        let done = Instant::now();
        let strategy = device.gradient_checkpointing_strategy();
        let receives = store_received(run, boundary, received, held, strategy);
        for a in &receives {
            report.events.push((**a, t0, done));
        }
        if !receives.is_empty() {
            report.recv_wait += done - t0;
        }
        Ok(())
    }

    /// What the transfers of `run` send (taken out of `held`: each tensor with its
    /// destination rank) and expect to receive.
    fn transfers(
        &self,
        run: &[Action],
        boundary: &[PartSpec],
        held: &mut InFlight,
    ) -> Result<(Sends, Vec<Incoming>), ParallelError> {
        let s = &*self.schedule;
        let rank = self.group.rank();
        let differentiable = || boundary.iter().filter(|p| p.grad);
        let mut sends: Sends = vec![];
        let mut incoming: Vec<Incoming> = vec![];
        for a in run {
            let key = (a.micro, a.chunk);
            let stage = s.stage_of(rank, a.chunk);
            let from = |src: usize, spec: &PartSpec| Incoming {
                numel: spec.numel(),
                dtype: spec.dtype,
                src,
            };
            match a.kind {
                ActionKind::SendActivation => {
                    let dst = s.place(stage + 1).0;
                    let parts = activation_to_send(held, a, rank)?;
                    check_boundary(rank, stage, parts, boundary)?;
                    // Outside autodiff, as values: so a CUDA tensor's buffer, or a Flex
                    // tensor's, goes to the engine where it lies.
                    let values = |p: &BoundaryTensor| p.flat.clone().without_autodiff();
                    sends.extend(parts.iter().map(|p| (values(p), dst)));
                }
                ActionKind::SendGrad => {
                    let dst = s.place(stage - 1).0;
                    let grads = held.grads_in.remove(&key).ok_or_else(|| {
                        ParallelError::Invalid(format!(
                            "rank {rank}: chunk {}'s input got no gradient for micro-batch {}",
                            a.chunk, a.micro
                        ))
                    })?;
                    sends.extend(grads.into_iter().map(|g| (g, dst)));
                }
                ActionKind::RecvActivation => {
                    let src = s.place(stage - 1).0;
                    incoming.extend(boundary.iter().map(|spec| from(src, spec)));
                }
                ActionKind::RecvGrad => {
                    let src = s.place(stage + 1).0;
                    incoming.extend(differentiable().map(|spec| from(src, spec)));
                }
                _ => unreachable!("a run of transfers"),
            }
        }
        Ok((sends, incoming))
    }
}

/// The activation forward action `a` produced, which its send carries.
fn activation_to_send<'h>(
    held: &'h InFlight,
    a: &Action,
    rank: usize,
) -> Result<&'h [BoundaryTensor], ParallelError> {
    match held
        .outputs
        .get(&(a.micro, a.chunk))
        .map(|(_, out)| out.main())
    {
        Some(StageOutput::Activation(parts)) => Ok(parts),
        _ => Err(ParallelError::Invalid(format!(
            "rank {rank}: chunk {} returned a loss where an activation was due",
            a.chunk
        ))),
    }
}

/// The tensors `received` for the receives of `run`, stored in `held`: an activation as new
/// leaves on the step's device (requiring gradients where the boundary says), a gradient as
/// it came. Returns the receive actions.
fn store_received<'r>(
    run: &'r [Action],
    boundary: &[PartSpec],
    received: Vec<Tensor<1>>,
    held: &mut InFlight,
    strategy: Option<GradientCheckpointingStrategy>,
) -> Vec<&'r Action> {
    let differentiable = boundary.iter().filter(|p| p.grad).count();
    let mut received = received.into_iter();
    let mut receives = vec![];
    for a in run {
        let key = (a.micro, a.chunk);
        match a.kind {
            ActionKind::RecvActivation => {
                let parts = (boundary.iter().zip(received.by_ref()))
                    .map(|(spec, x)| {
                        let x = with_autodiff(x, strategy);
                        let x = if spec.grad { x.require_grad() } else { x };
                        BoundaryTensor::new(x, spec.clone())
                    })
                    .collect();
                held.inputs.insert(key, parts);
            }
            ActionKind::RecvGrad => {
                let grads = received.by_ref().take(differentiable).collect();
                held.grads_out.insert(key, grads);
            }
            _ => continue,
        }
        receives.push(a);
    }
    receives
}

/// Checks that the tensors stage `stage` produced are those every boundary carries (`boundary`,
/// learned from the first stage's `embed`).
fn check_boundary(
    rank: usize,
    stage: usize,
    parts: &[BoundaryTensor],
    boundary: &[PartSpec],
) -> Result<(), ParallelError> {
    let produced = specs_of(parts);
    if produced == boundary {
        return Ok(());
    }
    let show = |specs: &[PartSpec]| {
        let each: Vec<String> = (specs.iter())
            .map(|p| {
                format!(
                    "{:?} {:?}{}",
                    p.shape,
                    p.dtype,
                    ["", " (no grad)"][usize::from(!p.grad)]
                )
            })
            .collect();
        each.join(", ")
    };
    Err(ParallelError::Invalid(format!(
        "rank {rank}: stage {stage} produced [{}], but every stage boundary carries [{}] (under \
         a plan: what the first stage's `embed` returns; every stage must return the shapes and \
         dtypes it is given, so a tensor-parallel pair cannot be split between `embed` and a \
         layer, or between stages)",
        show(&produced),
        show(boundary)
    )))
}
