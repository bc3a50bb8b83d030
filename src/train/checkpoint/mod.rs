//! Training checkpoints for every strategy.
//!
//! Each strategy describes its rank's state as flat local vectors (parameters, the two AdamW
//! moments) and [`Segment`]s saying which region of which whole-model tensor each part of
//! them holds. Saving writes the segments this rank is responsible for (replicas share the
//! work: whole-tensor parts are split between them, split tensors are written by the first);
//! loading reads every segment's region from whatever pieces the checkpoint has, so a
//! checkpoint saved under one layout loads under any other. Tensor names are the whole
//! model's (`blocks.0.attn.wq.weight`), moments are `optim.exp_avg.NAME` and
//! `optim.exp_avg_sq.NAME`.
//!
//! The run state rides in the index: the step, the AdamW step count, the seed and the job's
//! configuration. Batches and dropout masks are pure functions of `(seed, step)`, so the step is
//! the whole data-sampler and RNG state.

mod placement;
mod saver;
mod tools;

pub use placement::{
    LocalState, Segment, pieces_to_write, run_segments, tp_segment, whole_segments,
};
pub use saver::{Saver, gather_manifests};
pub use tools::{export, open, reshard};
