//! # Flashover
//!
//! Train one Burn model on many accelerators. Flashover splits a model's parameters, gradients,
//! optimizer state, activations and batch across ranks arranged on an N-D [`DeviceMesh`]
//! (`pp`, `dp`, `fsdp`, `ep`, `cp`, `tp`) and communicates just enough to compute exactly what
//! one device would.
//!
//! This facade re-exports the pieces a model author uses ([`prelude`] holds what a training
//! loop on your own model needs):
//! - [`launch`] / [`Launch`]: run one closure per rank (threads in one process) with its
//!   [`RankContext`]: rank, mesh, device and a process [`Group`] per mesh axis.
//! - [`comm`]: the collective layer ([`comm::Communicator`], the thread engine, fault injection,
//!   the flight recorder).
//! - [`mesh`]: the device mesh and its rank order.
//! - [`parallel`]: the strategies as Burn modules and optimizers (data parallel, ZeRO, tensor,
//!   pipeline, context and expert parallelism, recomputation, placements); [`models`]: the
//!   reference transformer and its forward context; [`checkpoint`]: sharded checkpoints.
//! - [`TensorCollectives`]: collectives on Burn tensors; [`CommStream`]: the same started now
//!   and waited on later; [`transfers`]: host transfers counted by cause.
//! - [`train`]: the training job behind `flashover train` and `flashover verify`.
//! - `learner` (feature `learner`): burn-train's `Learner` training a plan-parallelized model
//!   (a custom training strategy).
//! - [`check`]: comparing a layout's loss curve and weights with one rank's.
//! - [`plan`]: the planner behind `flashover plan` (memory and step-time model, mesh search).
//! - [`heap`]: a counting allocator, to measure memory (the `flashover` binary's benchmarks do).
//!
//! ```
//! use flashover::{launch, Axis, ReduceOp, TensorCollectives};
//! use burn::tensor::Tensor;
//!
//! // Four ranks as a 2 x 2 mesh; average a tensor over each data-parallel group.
//! let out = launch("dp=2,tp=2", |ctx| {
//!     let x = Tensor::<1>::from_floats([ctx.rank() as f32, 1.0], ctx.device());
//!     ctx.group(Axis::Dp).all_reduce_tensor(x, ReduceOp::Avg)
//! })
//! .unwrap();
//! assert_eq!(out[0].to_data().try_to_vec::<f32>().unwrap(), vec![1.0, 1.0]); // (0 + 2) / 2
//! ```
#![warn(missing_docs)]

pub mod check;
pub mod heap;
#[cfg(feature = "learner")]
pub mod learner;
pub mod plan;
pub mod plan_checkpoint;
pub mod train;

/// What a training loop on your own Burn model needs from Flashover, in one import.
///
/// ```
/// use burn::module::Module;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::optim::AdamWConfig;
/// use burn::tensor::{Device, Tensor};
/// use flashover::prelude::*;
///
/// #[derive(Module, Debug)]
/// struct Net {
///     layer: Linear,
/// }
///
/// // Two ranks, each holding half of every parameter (ZeRO-3), the model unchanged.
/// let losses = launch("fsdp=2", |ctx| {
///     let device = ctx.device().clone().autodiff();
///     let net = Net { layer: LinearConfig::new(4, 2).init(&device) };
///     let (mut net, par) = parallelize(net, &ParallelizePlan::new().fully_shard(""), &ctx)?;
///     let mut optim = AdamWConfig::new().init();
///     // Step 0's batch is samples 0..8 of the data set; this rank's share is 4 of them.
///     let samples = par.data().batch_share(8, 0)?;
///     let x = Tensor::<2>::ones([samples.len(), 4], &device);
///     let loss = net.layer.forward(x).square().mean();
///     let (grads, norm) = par.gradients(&net, loss.backward(), Some(1.0), &ctx)?;
///     // The whole batch's mean loss and the norm, on the device until after the optimizer step.
///     let scalars = par.step_scalars(&loss, &norm)?;
///     net = optim.step(1e-3, net, grads);
///     Ok::<_, ParallelError>(scalars.read().loss) // the step's one read of the host
/// })
/// .unwrap();
/// assert_eq!(losses[0], losses[1]);
/// ```
pub mod prelude {
    pub use crate::plan_checkpoint::{Checkpoints, RunState};
    pub use crate::{
        Axis, CommunicatorExt, Launch, RankContext, ReduceOp, TensorCollectives, launch,
    };
    pub use flashover_parallel::activation_checkpointing::CheckpointPolicy;
    pub use flashover_parallel::context_parallel::CpAttention;
    pub use flashover_parallel::data_parallel::{GradientBuckets, GradientRows};
    pub use flashover_parallel::parallelize::{
        ContextParallelRule, ModulePath, ParallelizePlan, Parallelized, PipelineModel,
        PipelineRule, PipelineStep, TensorParallelRule, TpStyle, parallelize,
    };
    pub use flashover_parallel::pipeline::{NoGrad, ScheduleKind, StageBoundary};
    pub use flashover_parallel::precision::{LossScale, MixedPrecision, Precision};
    pub use flashover_parallel::zero::RowAdamW;
    pub use flashover_parallel::{FlatAdamWConfig, ParallelError};
}

pub use flashover_checkpoint as checkpoint;
pub use flashover_comm as comm;
pub use flashover_mesh as mesh;
pub use flashover_models as models;
pub use flashover_parallel as parallel;
/// Burn's layers, splittable by a plan (`flashover_parallel::nn`), and the forward of a
/// mixture-of-experts layer under a plan.
pub mod nn {
    pub use flashover_parallel::expert_parallel::MoeForward;
    pub use flashover_parallel::nn::*;
}
pub use flashover_runtime::{
    Axis, CommError, CommStats, CommStream, Communicator, CommunicatorExt, DeviceChoice,
    DeviceError, DeviceMesh, FaultPlan, Group, IntoMesh, Launch, LaunchError, Launcher, MeshError,
    OpKind, ProcessEnv, RankContext, RankError, RankFailure, ReduceOp, TensorCollectives, Work,
    launch, transfers,
};
