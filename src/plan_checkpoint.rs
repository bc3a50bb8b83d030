//! Training checkpoints of your own model parallelized by a plan: its parameters and its Burn
//! optimizer's state, saved by every rank as regions of the whole model's tensors and read
//! back on any mesh and plan (resuming under another layout is resharding).
//!
//! Each rank writes what its placements say it holds, once per element in the mesh (the first
//! replica along `dp` writes, a tied pipeline copy never does). The optimizer's state is taken
//! from Burn's own optimizer record: every state tensor shaped like its parameter (Adam's and
//! AdamW's moments, SGD's momentum, ...) is placed as the parameter is, named
//! `optim.FIELD.PARAMETER`; its scalars (Adam's step count) ride in the run state by parameter
//! name. Tensors are named as the whole model's parameters (`blocks.0.fc.weight`), so `flashover
//! ckpt export` writes a checkpoint as one safetensors file that ordinary Burn code loads.
//!
//! ```text
//! let mut checkpoints = Checkpoints::new(&dir, 2);                  // keep the newest two
//! let (model, optim, state) = match checkpoints.latest()? {         // resume, on any mesh
//!     Some(saved) => Checkpoints::resume(&par, &ctx, &saved, model, optim)?,
//!     None => (model, optim, RunState::default()),
//! };
//! for step in state.step as usize..steps {
//!     // ... train ...
//!     checkpoints.save(&par, &ctx, step as u64 + 1, &model, &optim)?;   // save_with: + your state
//! }
//! ```

use crate::train::checkpoint::{Saver, Segment, all_gather_json, pieces_to_write, placed_segment};
use burn::module::Module;
use burn::optim::{ModuleOptimizer, OptimizerRecord};
use burn::tensor::{DType, TensorData};
use flashover_checkpoint::{Checkpoint, PieceData, committed};
use flashover_comm::Group;
use flashover_parallel::ParallelError;
use flashover_parallel::parallelize::Parallelized;
use flashover_parallel::params::{ParamSlot, flatten_params, load_flat};
use flashover_parallel::placement::ParamPlacement;
use flashover_runtime::{Axis, RankContext};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What a checkpoint records besides tensors.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// Steps completed when it was saved.
    pub step: u64,
    /// Your own state (data position, schedule, ...), as you saved it.
    #[serde(default)]
    pub user: serde_json::Value,
    /// The optimizer's per-parameter state, by whole-model parameter name.
    #[serde(default)]
    optimizer: BTreeMap<String, ParamState>,
}

impl RunState {
    /// Whether this records no optimizer state (a fresh run, or not a plan checkpoint's).
    pub fn is_empty(&self) -> bool {
        self.optimizer.is_empty()
    }
}

/// One parameter's optimizer state: the fields of its tensors (saved as
/// `optim.FIELD.PARAMETER`) and its scalars.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct ParamState {
    tensors: Vec<String>,
    scalars: BTreeMap<String, Scalar>,
    /// The optimizer's parameter-group path, when it recorded one.
    path: Option<String>,
}

/// A scalar of Burn's optimizer record.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
enum Scalar {
    Int(i64),
    UInt(u64),
    Float(f64),
    Bool(bool),
}

impl From<burn_pack::Scalar> for Scalar {
    fn from(s: burn_pack::Scalar) -> Self {
        match s {
            burn_pack::Scalar::Int(v) => Scalar::Int(v),
            burn_pack::Scalar::UInt(v) => Scalar::UInt(v),
            burn_pack::Scalar::Float(v) => Scalar::Float(v),
            burn_pack::Scalar::Bool(v) => Scalar::Bool(v),
        }
    }
}

impl From<Scalar> for burn_pack::Scalar {
    fn from(s: Scalar) -> Self {
        match s {
            Scalar::Int(v) => burn_pack::Scalar::Int(v),
            Scalar::UInt(v) => burn_pack::Scalar::UInt(v),
            Scalar::Float(v) => burn_pack::Scalar::Float(v),
            Scalar::Bool(v) => burn_pack::Scalar::Bool(v),
        }
    }
}

fn fail(what: impl std::fmt::Display) -> ParallelError {
    ParallelError::Invalid(format!("checkpoint: {what}"))
}

/// Saves and resumes checkpoints of a plan-parallelized model under one directory.
pub struct Checkpoints {
    root: PathBuf,
    saver: Saver,
}

impl Checkpoints {
    /// Checkpoints under `root` (`root/step-00000010`, ...), keeping the newest `keep`.
    pub fn new(root: &Path, keep: usize) -> Self {
        Checkpoints {
            root: root.to_path_buf(),
            saver: Saver::new(root, keep.max(1), false, None),
        }
    }

    /// The newest committed checkpoint's directory, if any (half-written ones are never
    /// listed).
    pub fn latest(&self) -> Result<Option<PathBuf>, ParallelError> {
        let all = committed(&self.root).map_err(fail)?;
        Ok(all
            .into_iter()
            .max_by_key(|(step, _)| *step)
            .map(|(_, dir)| dir))
    }

    /// The committed checkpoint of `step`'s directory, if there is one.
    pub fn of_step(&self, step: u64) -> Result<Option<PathBuf>, ParallelError> {
        let all = committed(&self.root).map_err(fail)?;
        Ok(all
            .into_iter()
            .find(|(s, _)| *s == step)
            .map(|(_, dir)| dir))
    }

    /// The directory the checkpoints live under.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Saves `model` and `optim` as the checkpoint of `step` (collective: every rank calls it;
    /// nothing is visible until every rank has written its part).
    pub fn save<M: Module>(
        &mut self,
        par: &Parallelized,
        ctx: &RankContext,
        step: u64,
        model: &M,
        optim: &ModuleOptimizer,
    ) -> Result<(), ParallelError> {
        self.save_with(par, ctx, step, model, optim, &())
    }

    /// [`Self::save`] with state of your own kept beside it (anything serde serializes: a
    /// data-loader position, a config), read back as [`RunState::user`] on resume.
    pub fn save_with<M: Module, U: Serialize>(
        &mut self,
        par: &Parallelized,
        ctx: &RankContext,
        step: u64,
        model: &M,
        optim: &ModuleOptimizer,
        user: &U,
    ) -> Result<(), ParallelError> {
        let user = serde_json::to_value(user).map_err(fail)?;
        self.save_record(par, ctx, step, model, optim.to_record(), user)
    }

    /// [`Self::save`] of an optimizer's record (what a burn-train `Learner`'s optimizer gives).
    pub fn save_record<M: Module>(
        &mut self,
        par: &Parallelized,
        ctx: &RankContext,
        step: u64,
        model: &M,
        optim: OptimizerRecord,
        user: serde_json::Value,
    ) -> Result<(), ParallelError> {
        let entries = par.sharded().held_entries(model)?;
        let coord = |a: Axis| ctx.coord(a);
        let params = flatten_params(model);
        let segments: Vec<Segment> = entries
            .iter()
            .map(|(slot, entry)| placed_segment(entry, slot.offset, &coord, &[]))
            .collect();
        let mut pieces = pieces_to_write(&segments, &params, (0, 1));
        let (mine, state_pieces) = optimizer_pieces(optim, &entries, &coord)?;
        pieces.extend(state_pieces);
        // Rank 0 writes the run state: every stage's parameters' optimizer state in it.
        let optimizer = union_over(ctx.world(), &mine)?;
        let run = RunState {
            step,
            user,
            optimizer,
        };
        let run = serde_json::to_value(&run).map_err(fail)?;
        self.saver
            .save(ctx.world(), step, run, pieces)
            .map_err(fail)
    }

    /// `model` and `optim` (as `parallelize` and your optimizer's `init` made them, on this
    /// rank's mesh and plan) loaded from the checkpoint at `dir`, whatever layout saved it, and
    /// the run state saved with it. Fails naming the parameter when the checkpoint is of
    /// another model.
    ///
    /// Burn's `ModuleOptimizer::load_record` builds the optimizer state on Burn's default
    /// device, and each parameter's first step moves it to the parameter's device. In a build
    /// with Burn's `cuda` feature that default is GPU 0 for every rank; `BURN_DEVICE=flex`
    /// keeps the loaded state in host memory until those first steps.
    pub fn resume<M: Module>(
        par: &Parallelized,
        ctx: &RankContext,
        dir: &Path,
        model: M,
        optim: ModuleOptimizer,
    ) -> Result<(M, ModuleOptimizer, RunState), ParallelError> {
        let (model, record, run) = Self::resume_record(par, ctx, dir, model)?;
        Ok((model, optim.load_record(record), run))
    }

    /// [`Self::resume`] with the optimizer's state as a record (what a burn-train `Learner`
    /// loads).
    pub fn resume_record<M: Module>(
        par: &Parallelized,
        ctx: &RankContext,
        dir: &Path,
        model: M,
    ) -> Result<(M, OptimizerRecord, RunState), ParallelError> {
        let ckpt = Checkpoint::open(dir).map_err(fail)?;
        let run: RunState = serde_json::from_value(ckpt.index().run.clone()).map_err(|e| {
            fail(format!(
                "{}: the run state is not a plan checkpoint's ({e})",
                dir.display()
            ))
        })?;
        let coord = |a: Axis| ctx.coord(a);
        let entries = par.sharded().held_entries(&model)?;
        let mut params = flatten_params(&model);
        for (slot, entry) in &entries {
            let segment = placed_segment(entry, slot.offset, &coord, &[]);
            read_into(&ckpt, &segment, &mut params)?;
        }
        let optim = optimizer_record(&ckpt, &run, &entries, &coord)?;
        let model = load_flat(model, &params);
        Ok((model, optim, run))
    }
}

/// The union of every rank's `map` (collective over `world`; replicas agree on shared keys).
fn union_over(
    world: &Group,
    map: &BTreeMap<String, ParamState>,
) -> Result<BTreeMap<String, ParamState>, ParallelError> {
    let parts = all_gather_json(world, map).map_err(fail)?;
    Ok(parts.into_iter().flatten().collect())
}

/// Reads `segment`'s region from `ckpt` into `flat` (which keeps its length: padding stays).
fn read_into(ckpt: &Checkpoint, segment: &Segment, flat: &mut [f32]) -> Result<(), ParallelError> {
    ckpt.expect_shape(&segment.tensor, &segment.shape)
        .map_err(fail)?;
    let values = ckpt.read(&segment.tensor, &segment.region).map_err(fail)?;
    segment.scatter(&values, flat);
    Ok(())
}

/// The name a state tensor is saved under.
fn state_name(field: &str, param: &str) -> String {
    format!("optim.{field}.{param}")
}

/// `optim`'s state of the parameters `entries`: each parameter's scalars and tensor fields,
/// and the pieces of its tensors this rank writes (placed as their parameters). Fails naming
/// the field when a state tensor is not shaped like its parameter.
fn optimizer_pieces(
    optim: OptimizerRecord,
    entries: &[(ParamSlot, &ParamPlacement)],
    coord: &dyn Fn(Axis) -> usize,
) -> Result<(BTreeMap<String, ParamState>, Vec<PieceData>), ParallelError> {
    let bytes = optim.into_bytes().map_err(fail)?;
    let reader = burn_pack::Reader::from_bytes(bytes).map_err(|e| fail(format!("{e:?}")))?;
    let by_id: BTreeMap<u64, &(ParamSlot, &ParamPlacement)> =
        entries.iter().map(|e| (e.0.id.val(), e)).collect();
    let mut states: BTreeMap<String, ParamState> = BTreeMap::new();
    // `ID.FIELD` keys: the parameter's entry and the field.
    let split = |key: &str| -> Option<(&(ParamSlot, &ParamPlacement), String)> {
        let (id, field) = key.split_once('.')?;
        Some((by_id.get(&id.parse::<u64>().ok()?)?, field.to_string()))
    };
    for (key, value) in reader.scalars() {
        if let Some(((_, entry), field)) = split(key) {
            let state = states.entry(entry.name.clone()).or_default();
            state.scalars.insert(field, (*value).into());
        }
    }
    for (id, path) in reader.metadata() {
        if let Some((_, entry)) = id.parse::<u64>().ok().and_then(|id| by_id.get(&id)) {
            states.entry(entry.name.clone()).or_default().path = Some(path.clone());
        }
    }
    let mut pieces = vec![];
    for tensor in reader.into_tensors().map_err(|e| fail(format!("{e:?}")))? {
        let (key, dtype, shape, _, bytes) =
            tensor.into_parts().map_err(|e| fail(format!("{e:?}")))?;
        let Some(((slot, entry), field)) = split(&key) else {
            continue; // A parameter this rank does not hold (a pipeline placeholder's state).
        };
        if shape.as_slice() != slot.shape.as_slice() {
            return Err(fail(format!(
                "the optimizer's state `{field}` of `{}` has shape {:?}, not its parameter's \
                 {:?}: only state shaped like its parameter can be placed as it is (Adam, \
                 AdamW, SGD with momentum, ...)",
                entry.name,
                shape.as_slice(),
                slot.shape
            )));
        }
        let values: Vec<f32> = TensorData::from_bytes(bytes, shape, dtype)
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| fail(format!("{e:?}")))?;
        let mut segment = placed_segment(entry, 0, coord, &[]);
        segment.tensor = state_name(&field, &entry.name);
        pieces.extend(pieces_to_write(&[segment], &values, (0, 1)));
        states
            .entry(entry.name.clone())
            .or_default()
            .tensors
            .push(field);
    }
    Ok((states, pieces))
}

/// The optimizer record of the saved state of the parameters `entries` (this rank's parts of
/// it), under this rank's parameter ids.
fn optimizer_record(
    ckpt: &Checkpoint,
    run: &RunState,
    entries: &[(ParamSlot, &ParamPlacement)],
    coord: &dyn Fn(Axis) -> usize,
) -> Result<OptimizerRecord, ParallelError> {
    let mut tensors = vec![];
    let mut scalars = vec![];
    let mut paths = vec![];
    for (slot, entry) in entries {
        let Some(state) = run.optimizer.get(&entry.name) else {
            continue; // No state saved: the parameter had not been stepped.
        };
        let id = slot.id.val();
        for field in &state.tensors {
            let mut segment = placed_segment(entry, 0, coord, &[]);
            segment.tensor = state_name(field, &entry.name);
            let mut values = vec![0.0; slot.numel];
            read_into(ckpt, &segment, &mut values)?;
            let (bytes, shape, dtype) = TensorData::new(values, slot.shape.clone()).into_parts();
            debug_assert_eq!(dtype, DType::F32);
            tensors.push(burn_pack::Tensor::new(
                format!("{id}.{field}"),
                dtype,
                shape,
                Some(id),
                bytes,
            ));
        }
        for (field, value) in &state.scalars {
            scalars.push((format!("{id}.{field}"), *value));
        }
        if let Some(path) = &state.path {
            paths.push((id.to_string(), path.clone()));
        }
    }
    let mut writer = burn_pack::Writer::new(tensors);
    for (key, value) in scalars {
        writer = writer.with_scalar(&key, value.into());
    }
    for (key, path) in paths {
        writer = writer.with_metadata(&key, &path);
    }
    let bytes = writer.into_bytes().map_err(|e| fail(format!("{e:?}")))?;
    OptimizerRecord::from_bytes(bytes).map_err(fail)
}
