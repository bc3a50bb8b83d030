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
//!
//! ```
//! use flashover::train::{TrainConfig, checkpoint, train};
//!
//! let dir = std::env::temp_dir().join(format!("flashover-doc-ckpt-{}", std::process::id()));
//! let mut config = TrainConfig::default();
//! config.parallel.mesh = "dp=2".into();
//! config.run.steps = 2;
//! config.run.global_batch = 4;
//! config.checkpoint.dir = Some(dir.join("run"));
//! config.checkpoint.save_every = 2;
//! train(&config, &|_| {}).unwrap();
//! // The checkpoint of step 2, its parameters as one safetensors file, and a copy resharded
//! // for ZeRO-3 over two ranks.
//! let saved = dir.join("run").join("step-00000002");
//! let ckpt = checkpoint::open(&saved).unwrap();
//! assert_eq!(ckpt.step(), 2);
//! let tensors = checkpoint::export(&ckpt, &dir.join("model.safetensors")).unwrap();
//! assert!(tensors > 0);
//! let resharded = checkpoint::reshard(&saved, "fsdp=2", Some(3), &dir.join("fsdp")).unwrap();
//! assert!(checkpoint::open(&resharded).is_ok());
//! std::fs::remove_dir_all(&dir).unwrap();
//! ```

mod placement;
mod saver;
mod tools;

pub use placement::{
    LocalState, Segment, pieces_to_write, run_segments, tp_segment, whole_segments,
};
pub use saver::{Saver, gather_manifests};
pub use tools::{export, open, reshard};
