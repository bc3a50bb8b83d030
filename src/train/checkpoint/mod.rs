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
//!
//! Your own model's state, saved by two replicas (each writes half) and read back by one
//! rank (`examples/checkpoint_reshard.rs` trains and resumes on another mesh this way):
//!
//! ```
//! use flashover::train::checkpoint::{LocalState, Saver, Segment, whole_segments};
//! use flashover::{Axis, launch};
//! use flashover_parallel::params::{ParamLayout, flatten_params};
//!
//! let dir = std::env::temp_dir().join(format!("flashover-doc-own-{}", std::process::id()));
//! let layer = |device: &burn::tensor::Device| flashover_models::init::linear(1, "l", 4, 3, 0.5, device);
//! let state = |params: Vec<f32>| {
//!     let layer = layer(&burn::tensor::Device::flex());
//!     // Whole tensors named as the module's parameters; moments in the same layout.
//!     let segments: Vec<Segment> = whole_segments(&ParamLayout::of(&layer), str::to_string);
//!     let n = params.len();
//!     LocalState {
//!         params,
//!         param_segments: segments.clone(),
//!         moments: [vec![0.1; n], vec![0.2; n]],
//!         moment_segments: segments,
//!         steps_taken: 3,
//!     }
//! };
//! let saved = flatten_params(&layer(&burn::tensor::Device::flex()));
//! launch("dp=2", |ctx| {
//!     let dp = ctx.group(Axis::Dp);
//!     let replicas = (dp.rank(), dp.size());
//!     let pieces = state(saved.clone()).pieces_for(replicas, replicas);
//!     let run = serde_json::json!({ "step": 1, "adamw_steps": 3 });
//!     Saver::new(&dir, 1, false, None).save(dp, 1, run, pieces)
//! })
//! .unwrap();
//! let mut loaded = state(vec![0.0; saved.len()]);
//! loaded.load(&flashover_checkpoint::Checkpoint::open(&dir).unwrap()).unwrap();
//! assert_eq!(loaded.params, saved);
//! assert_eq!(loaded.moments[1], vec![0.2; saved.len()]);
//! assert_eq!(loaded.steps_taken, 3);
//! std::fs::remove_dir_all(&dir).unwrap();
//! ```

mod placement;
mod saver;
mod tools;

pub use placement::{LocalState, Segment, whole_segments};
pub(crate) use placement::{pieces_to_write, placed_segment, placed_segments};
pub use saver::Saver;
pub(crate) use saver::all_gather_json;
pub use tools::{export, open, reshard};
