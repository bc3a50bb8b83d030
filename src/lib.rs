//! # Flashover
//!
//! Train one Burn model on many accelerators. Flashover splits a model's parameters, gradients,
//! optimizer state, activations and batch across ranks arranged on an N-D [`DeviceMesh`]
//! (`pp`, `dp`, `fsdp`, `ep`, `cp`, `tp`) and communicates just enough to compute exactly what
//! one device would.
//!
//! This facade re-exports the pieces a model author uses:
//! - [`launch`] / [`Launch`]: run one closure per rank (threads in one process) with its
//!   [`RankContext`]: rank, mesh, device and a process [`Group`] per mesh axis.
//! - [`comm`]: the collective layer ([`comm::Communicator`], the thread engine, fault injection,
//!   the flight recorder).
//! - [`mesh`]: the device mesh and its rank order.
//! - [`parallel`]: the strategies as Burn modules and optimizers (data parallel, ZeRO, tensor,
//!   pipeline, context and expert parallelism, recomputation, placements); [`models`]: the
//!   reference transformer and its forward context; [`checkpoint`]: sharded checkpoints.
//! - [`TensorCollectives`]: collectives on Burn tensors.
//! - [`train`]: the training job behind `flashover train` and `flashover verify`.
//! - [`check`]: comparing a layout's loss curve and weights with one rank's.
//! - [`plan`]: the planner behind `flashover plan` (memory and step-time model, mesh search).
//! - [`bench`]: the measurements behind `flashover bench`; [`heap`]: the counting allocator
//!   they measure memory with.
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

pub mod bench;
pub mod check;
pub mod heap;
pub mod plan;
pub mod train;

pub use flashover_checkpoint as checkpoint;
pub use flashover_comm as comm;
pub use flashover_mesh as mesh;
pub use flashover_models as models;
pub use flashover_parallel as parallel;
pub use flashover_runtime::{
    Axis, CommError, CommStats, Communicator, CommunicatorExt, DeviceChoice, DeviceError,
    DeviceMesh, FaultPlan, Group, IntoMesh, Launch, LaunchError, Launcher, MeshError, OpKind,
    ProcessEnv, RankContext, RankError, RankFailure, ReduceOp, TensorCollectives, launch,
};
