//! # flashover-checkpoint: sharded training checkpoints
//!
//! Every rank writes only what it owns (parameters, optimizer state) as *pieces* of global
//! tensors into its own safetensors file; a JSON index records each tensor's global shape and
//! which byte range of which file holds which [`Region`] of it, with checksums, plus the run
//! state. Because regions are described in global coordinates, any rank of any layout can
//! read exactly the elements it needs ([`Checkpoint::read`]): that is resharding.
//!
//! - [`write`](mod@write): the save protocol ([`begin`], [`write_shard`] per rank, [`commit`] once, then
//!   [`prune`]); atomic: nothing is visible until the index is in place and the directory
//!   renamed.
//! - [`ModelFile`]: a consolidated safetensors file of whole tensors (`ckpt export`, or
//!   ordinary Burn code), to start a sharded run from.
//! - [`Checkpoint`]: open (untrusted input: every size, offset and shape checked, the
//!   safetensors headers cross-checked), read regions, verify checksums.
//!
//! ```
//! use flashover_checkpoint::{Checkpoint, PieceData, Region, begin, commit, write_shard};
//! let root = std::env::temp_dir().join(format!("ckpt-doc-{}", std::process::id()));
//! // Two "ranks" each save half of a 2 x 3 tensor, by rows.
//! let dir = begin(&root, 10).unwrap();
//! let manifests = (0..2)
//!     .map(|r| {
//!         let piece = PieceData {
//!             tensor: "w".into(),
//!             shape: vec![2, 3],
//!             region: Region::slice(&[2, 3], 0, r, 1),
//!             values: vec![r as f32; 3],
//!         };
//!         write_shard(&dir, r, &[piece]).unwrap()
//!     })
//!     .collect();
//! commit(&root, 10, serde_json::json!({}), manifests).unwrap();
//! // Read it back by columns instead.
//! let ckpt = Checkpoint::open(&root).unwrap();
//! assert_eq!(ckpt.read("w", &Region::slice(&[2, 3], 1, 1, 2)).unwrap(), vec![0., 0., 1., 1.]);
//! std::fs::remove_dir_all(&root).unwrap();
//! ```
#![warn(missing_docs)]

mod error;
pub mod index;
mod model_file;
mod read;
pub mod region;
pub mod write;

pub use error::CheckpointError;
pub use index::{FileEntry, Index, PieceEntry, TensorEntry};
pub use model_file::ModelFile;
pub use read::{Checkpoint, TensorSource, resolve};
pub use region::Region;
pub use write::{
    PieceData, ShardManifest, begin, commit, committed, partial, prune, step_dir_name, write_shard,
};
