//! # flashover-mesh: the N-D device mesh
//!
//! A [`DeviceMesh`] arranges the world's ranks on named axes ([`Axis`]: `pp`, `dp`, `fsdp`, `ep`,
//! `cp`, `tp`) and answers which ranks form a group along any set of axes. It is pure arithmetic,
//! with no communicator and no device: the launcher turns its groups into communicators.
//!
//! **Rank order** (the one place it is defined: [`Axis::ALL`]): ranks are numbered row-major over
//! the axes in the order `pp, dp, fsdp, ep, cp, tp`, so `tp` varies fastest (its groups are
//! adjacent ranks, which share the fastest links on a node) and `pp` slowest (stages cross the
//! slowest links, which carry only point-to-point activations).
//!
//! ```
//! use flashover_mesh::{Axis, DeviceMesh};
//! let mesh: DeviceMesh = "dp=2,tp=2".parse().unwrap();
//! assert_eq!(mesh.world_size(), 4);
//! assert_eq!(mesh.group_ranks(0, &[Axis::Tp]), vec![0, 1]);
//! assert_eq!(mesh.group_ranks(0, &[Axis::Dp]), vec![0, 2]);
//! ```
#![warn(missing_docs)]

mod axis;
mod display;
mod mesh;

pub use axis::Axis;
pub use mesh::{DeviceMesh, MeshError};
