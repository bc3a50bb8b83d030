//! # flashover-comm: the collective layer
//!
//! Every parallel strategy in Flashover talks to its peers through one object-safe trait,
//! [`Communicator`], over a process group. Which engine moves the bytes (threads of one process,
//! MPI processes, NCCL on CUDA devices) is decided at launch, never in strategy code.
//!
//! - [`Communicator`]: byte-level collectives (`all_reduce`, `reduce_scatter`, `all_gather`,
//!   `broadcast`, variable `all_to_all`, `send`/`recv`, `barrier`) and `split` into sub-groups.
//! - [`CommunicatorExt`]: the same operations on typed slices (`&mut [f32]`, `&[i64]`, ...).
//! - [`Group`]: a cheap, clonable handle to a communicator; what strategies take as an argument.
//! - [`ThreadWorld`]: the default engine. Ranks are threads; peers read each other's buffers
//!   directly (no copies through a shared queue), reductions run in a fixed rank order so results
//!   are bit-identical on every rank and from run to run, and every rendezvous has a deadline whose
//!   error names the op, the group, the sequence number and the ranks that did not arrive.
//! - [`FaultPlan`]: make a chosen rank stall or die at a chosen collective, for reliability tests.
//!
//! ```
//! use flashover_comm::{Communicator, CommunicatorExt, ReduceOp, ThreadWorld};
//!
//! let comms = ThreadWorld::new(3).build();
//! let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
//!     let handles: Vec<_> = comms
//!         .into_iter()
//!         .map(|comm| {
//!             s.spawn(move || {
//!                 let mut x = vec![comm.rank() as f32 + 1.0; 4];
//!                 comm.all_reduce(&mut x, ReduceOp::Sum).unwrap();
//!                 x
//!             })
//!         })
//!         .collect();
//!     handles.into_iter().map(|h| h.join().unwrap()).collect()
//! });
//! assert!(sums.iter().all(|x| x == &vec![6.0; 4]));
//! ```
#![warn(missing_docs)]

mod args;
mod blob_exchange;
mod communicator;
pub mod conformance;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dtype;
mod error;
mod fault;
mod flight;
pub mod host_buffers;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
mod op;
mod rendezvous;
mod stats;
mod thread;
mod traffic;

pub use blob_exchange::BlobExchange;
pub use communicator::{
    Communicator, CommunicatorExt, DeviceCollectives, DeviceTransfer, Group, Transfer,
};
pub use dtype::{DType, Element};
pub use error::{CommError, CommResult, panic_message};
pub use fault::{FaultAction, FaultPlan, FaultRule};
pub use flight::{FlightDump, FlightEntry, FlightRecorder, FlightState, diagnose, read_dumps};
pub use host_buffers::{HostBuffers, Purpose, control};
#[cfg(feature = "mpi")]
pub use mpi::{MpiComm, MpiWorld};
#[cfg(feature = "nccl")]
pub use nccl::{NcclComm, NcclWorld};
pub use op::{OpKind, ReduceOp};
pub use rendezvous::{MAX_BLOB, MAX_FRAME, Rendezvous, RendezvousError};
pub use stats::{CommStats, OpStats};
pub use thread::{DEFAULT_TIMEOUT, ThreadComm, ThreadWorld};
pub use traffic::{GroupTraffic, mark_background_thread};

/// Bus-bandwidth factor of an operation at world size `n`, as nccl-tests defines it: the ratio
/// between the bandwidth each link must carry and the algorithm bandwidth `bytes / time`.
///
/// all-reduce: `2(n-1)/n`; reduce-scatter, all-gather, all-to-all: `(n-1)/n`; broadcast: `1`.
pub fn bus_bandwidth_factor(op: OpKind, n: usize) -> f64 {
    let n = n.max(1) as f64;
    match op {
        OpKind::AllReduce => 2.0 * (n - 1.0) / n,
        OpKind::ReduceScatter | OpKind::AllGather | OpKind::AllToAll => (n - 1.0) / n,
        _ => 1.0,
    }
}
