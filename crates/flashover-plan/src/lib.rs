//! # flashover-plan: proposing a mesh
//!
//! Given the devices ([`Hardware`]), the model ([`ModelSpec`]) and the batch ([`Workload`]),
//! [`plan`] enumerates every layout of the world (tp within a node, pp, cp, ep, dp, ZeRO
//! stage and fsdp, pipeline schedule, recomputation, micro-batch size), discards those that are
//! invalid or do not fit in memory, and ranks the rest by the step time the cost model
//! ([`cost`]) estimates: compute at the hardware's efficiency, plus exposed communication per
//! collective and link, plus the pipeline bubble. Every assumption is listed in [`cost::ASSUMPTIONS`].
//! [`PlanResult::choices`] sets each choice of the best plan against the other values the
//! search met; [`explain`] draws where a layout's ranks and state live.
//!
//! ```
//! use flashover_plan::{Fixed, Hardware, ModelSpec, PlanRequest, Precision, Workload, plan};
//!
//! // 64 H100s, Llama-3 8B, tp = 8 and pp = 2 fixed: the rest is data parallel.
//! let request = PlanRequest {
//!     world: 64,
//!     hardware: Hardware::preset("h100").unwrap(),
//!     model: ModelSpec::preset("llama-8b").unwrap(),
//!     workload: Workload { seq_len: 8192, global_batch: 512 },
//!     precision: Precision::Mixed,
//!     fixed: Fixed { tp: Some(8), pp: Some(2), ..Fixed::default() },
//!     include_unsupported: false,
//! };
//! let best = &plan(&request).unwrap().plans[0];
//! assert_eq!(best.layout.dp * best.layout.fsdp * best.layout.cp, 4);
//! ```
#![warn(missing_docs)]

pub mod cost;
pub mod explain;
mod hardware;
mod layout;
mod model;
pub mod rules;
mod search;
pub mod stages;

pub use hardware::Hardware;
pub use layout::{Layout, PipelineSchedule, Precision, Recompute};
pub use model::{ModelSpec, Workload};
pub use search::{Alternative, Choice, Fixed, Plan, PlanRequest, PlanResult, enumerate, plan};
