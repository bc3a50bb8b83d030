//! # flashover-runtime: ranks, their context, and tensors on the wire
//!
//! - [`launch`] / [`Launch`]: run one closure per rank on its own thread, each with a
//!   [`RankContext`] (rank, mesh, device, a process group per mesh axis); join them and return
//!   every rank's result, or the failure that caused the others, never a hang or a silent panic.
//! - [`TensorCollectives`]: the collectives on Burn tensors: CUDA tensors on an engine with
//!   device collectives (NCCL) go to it as their GPU buffers (`cuda_memory`, feature `cuda`);
//!   everything else is staged through host memory (`TensorData`; on Flex without a copy).
//! - [`transfers`]: host transfers counted by cause (collective staging, gradient hooks, flat
//!   vectors).
//! - [`CommStream`]: a group's communication thread; collectives on tensors started now and
//!   waited on later ([`Work`]), in submission order.
//! - [`DeviceChoice`]: `flex | wgpu | cuda`, parsed from flags or `BURN_DEVICE`.
//!
//! ```
//! use flashover_runtime::{launch, Axis, ReduceOp, TensorCollectives};
//! use burn::tensor::Tensor;
//!
//! let sums = launch("dp=2,tp=2", |ctx| {
//!     let x = Tensor::<1>::from_floats([ctx.rank() as f32], ctx.device());
//!     ctx.group(Axis::Tp).all_reduce_tensor(x, ReduceOp::Sum)
//! })
//! .unwrap();
//! let values: Vec<f32> = sums.into_iter().map(|t| t.into_scalar()).collect();
//! assert_eq!(values, vec![1.0, 1.0, 5.0, 5.0]); // tp groups are [0 1] and [2 3]
//! ```
#![warn(missing_docs)]

mod context;
#[cfg(feature = "cuda")]
mod cuda_memory;
mod device;
mod launch;
mod output_pool;
mod panic_report;
mod process_env;
mod stream;
mod tensor;
pub mod transfers;

pub use context::RankContext;
pub use device::{DeviceChoice, DeviceError, F32_MATMUL_ERROR_LIMIT, f32_matmul_error};
pub use flashover_comm::{
    CommError, CommStats, Communicator, CommunicatorExt, FaultPlan, Group, GroupTraffic,
    HostBuffers, OpKind, ReduceOp, control,
};
pub use flashover_mesh::{Axis, DeviceMesh, MeshError};
pub use launch::{IntoMesh, Launch, LaunchError, RankError, RankFailure, launch};
pub use process_env::{Launcher, ProcessEnv};
pub use stream::{CommStream, SharedWork, Work};
pub use tensor::{Incoming, TensorCollectives};
