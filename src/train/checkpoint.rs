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

use flashover_checkpoint::{
    Checkpoint, CheckpointError, PieceData, Region, ShardManifest, TensorSource,
};
use flashover_comm::{CommunicatorExt, Group};
use flashover_parallel::params::ParamLayout;
use flashover_parallel::tensor_parallel::VocabShard;
use std::ops::Range;
use std::path::Path;

/// Part of a local flat vector holding a region of a whole-model tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    /// Whole-model tensor name.
    pub tensor: String,
    /// Its whole shape.
    pub shape: Vec<usize>,
    /// The elements held.
    pub region: Region,
    /// Offset of the local tensor in the flat vector.
    pub local: usize,
    /// Shape of the local tensor (padding included).
    pub local_shape: Vec<usize>,
    /// Where the region's elements sit in the local tensor (the rest is padding).
    pub local_region: Region,
    /// Whether this rank writes it (one replica of each element does).
    pub write: bool,
}

impl Segment {
    /// A whole tensor held whole at `local`.
    pub fn whole(tensor: &str, shape: &[usize], local: usize) -> Self {
        Segment {
            tensor: tensor.into(),
            shape: shape.to_vec(),
            region: Region::whole(shape),
            local,
            local_shape: shape.to_vec(),
            local_region: Region::whole(shape),
            write: true,
        }
    }

    /// Elements `start..start + len` of the tensor's flattening, held contiguously at `local`.
    pub fn flat(tensor: &str, shape: &[usize], start: usize, len: usize, local: usize) -> Self {
        let flat = |start: usize| Region::Flat {
            start: start as u64,
            len: len as u64,
        };
        Segment {
            tensor: tensor.into(),
            shape: shape.to_vec(),
            region: flat(start),
            local,
            local_shape: vec![len],
            local_region: flat(0),
            write: true,
        }
    }

    /// The same placement for another tensor of the same shape (an optimizer moment).
    fn renamed(&self, tensor: String) -> Self {
        Segment {
            tensor,
            ..self.clone()
        }
    }

    /// The region's values out of `flat`, in region order.
    fn gather(&self, flat: &[f32]) -> Vec<f32> {
        let mut out = vec![];
        for run in self.local_region.runs(&self.local_shape) {
            let at = self.local + run.global;
            out.extend_from_slice(&flat[at..at + run.len]);
        }
        out
    }

    /// Puts the region's `values` (region order) into `flat`.
    fn scatter(&self, values: &[f32], flat: &mut [f32]) {
        for run in self.local_region.runs(&self.local_shape) {
            let at = self.local + run.global;
            flat[at..at + run.len].copy_from_slice(&values[run.local..run.local + run.len]);
        }
    }

    /// `(first global element, first local element, len)` when the region and its local
    /// placement are both one contiguous stretch (so replicas can split its writing).
    fn contiguous(&self) -> Option<(usize, usize, usize)> {
        match (&self.region, &self.local_region) {
            (Region::Flat { start, len }, Region::Flat { start: local, .. }) => {
                Some((*start as usize, self.local + *local as usize, *len as usize))
            }
            _ => None,
        }
    }
}

/// One rank's training state for a checkpoint: flat vectors and where their parts belong.
#[derive(Debug, Clone, Default)]
pub struct LocalState {
    /// Parameters, flat.
    pub params: Vec<f32>,
    /// Where each part of `params` belongs.
    pub param_segments: Vec<Segment>,
    /// AdamW first and second moments, flat (their own order: ZeRO keeps shard order).
    pub moments: [Vec<f32>; 2],
    /// Where each part of the moments belongs (the same tensors' regions).
    pub moment_segments: Vec<Segment>,
    /// AdamW steps taken.
    pub steps_taken: i32,
}

/// Segments for a module's whole parameters laid out by `layout`, named by `name(slot name)`.
pub fn whole_segments(layout: &ParamLayout, name: impl Fn(&str) -> String) -> Vec<Segment> {
    layout
        .slots
        .iter()
        .map(|s| Segment::whole(&name(&s.name), &s.shape, s.offset))
        .collect()
}

/// Segments for `runs` of a module's flat parameter vector (`(Some(flat start) | None for
/// padding, len)`, laid end to end locally from `local`), cut at parameter boundaries.
pub fn run_segments(
    layout: &ParamLayout,
    runs: impl IntoIterator<Item = (Option<usize>, usize)>,
    mut local: usize,
    name: impl Fn(&str) -> String,
) -> Vec<Segment> {
    let mut out = vec![];
    for (flat, len) in runs {
        if let Some(mut at) = flat {
            let end = at + len;
            let mut here = local;
            for slot in &layout.slots {
                let slot_end = slot.offset + slot.numel;
                if slot_end <= at || slot.offset >= end {
                    continue;
                }
                let from = at.max(slot.offset);
                let to = end.min(slot_end);
                out.push(Segment::flat(
                    &name(&slot.name),
                    &slot.shape,
                    from - slot.offset,
                    to - from,
                    here,
                ));
                here += to - from;
                at = to;
            }
        }
        local += len;
    }
    out
}

/// The placement of a tensor-parallel share: `name` is the whole-model name, `local_shape` the
/// share's shape (vocabulary-split tensors padded), `tp = (rank, size)`. Norms are replicated
/// and written by tp rank 0.
pub fn tp_segment(
    name: &str,
    local_shape: &[usize],
    local: usize,
    tp: (usize, usize),
    vocab: &VocabShard,
) -> Segment {
    let (rank, size) = tp;
    let leaf = |suffix: &[&str]| suffix.iter().any(|s| name.ends_with(s));
    let split = |dim: usize| {
        let mut shape = local_shape.to_vec();
        shape[dim] *= size;
        let region = Region::slice(&shape, dim, rank * local_shape[dim], local_shape[dim]);
        Segment {
            tensor: name.into(),
            shape,
            region,
            local,
            local_shape: local_shape.to_vec(),
            local_region: Region::whole(local_shape),
            write: true,
        }
    };
    let vocab_split = |dim: usize| {
        let mut shape = local_shape.to_vec();
        shape[dim] = vocab.vocab;
        let real = vocab.vocab.saturating_sub(vocab.start).min(vocab.rows);
        Segment {
            tensor: name.into(),
            region: Region::slice(&shape, dim, vocab.start.min(vocab.vocab), real),
            shape,
            local,
            local_shape: local_shape.to_vec(),
            local_region: Region::slice(local_shape, dim, 0, real),
            write: true,
        }
    };
    if leaf(&[
        "wq.weight",
        "wk.weight",
        "wv.weight",
        "w_gate.weight",
        "w_up.weight",
    ]) {
        split(1)
    } else if leaf(&["wo.weight", "w_down.weight"]) {
        split(0)
    } else if name == "embed.weight" {
        vocab_split(0)
    } else if name == "head.weight" {
        vocab_split(1)
    } else {
        let mut s = Segment::whole(name, local_shape, local);
        s.write = rank == 0;
        s
    }
}

/// The pieces this rank writes of `segments` over `flat`: the segments it is responsible for,
/// contiguous ones split evenly between `replicas = (index, count)` ranks holding the same data,
/// others written whole by replica 0.
pub fn pieces_to_write(
    segments: &[Segment],
    flat: &[f32],
    replicas: (usize, usize),
) -> Vec<PieceData> {
    let (index, count) = replicas;
    let splittable: usize = segments
        .iter()
        .filter(|s| s.write)
        .filter_map(|s| s.contiguous().map(|(_, _, len)| len))
        .sum();
    let part = splittable.div_ceil(count.max(1));
    let mine: Range<usize> = (index * part).min(splittable)..((index + 1) * part).min(splittable);
    let mut seen = 0;
    let mut out = vec![];
    for s in segments.iter().filter(|s| s.write) {
        match s.contiguous() {
            Some((start, local, len)) => {
                // This segment is positions seen..seen + len of the splittable data.
                let from = mine.start.max(seen);
                let to = mine.end.min(seen + len);
                if from < to {
                    let (skip, n) = (from - seen, to - from);
                    out.push(PieceData {
                        tensor: s.tensor.clone(),
                        shape: s.shape.clone(),
                        region: Region::Flat {
                            start: (start + skip) as u64,
                            len: n as u64,
                        },
                        values: flat[local + skip..local + skip + n].to_vec(),
                    });
                }
                seen += len;
            }
            None if index == 0 => {
                let values = s.gather(flat);
                if !values.is_empty() {
                    out.push(PieceData {
                        tensor: s.tensor.clone(),
                        shape: s.shape.clone(),
                        region: s.region.clone(),
                        values,
                    });
                }
            }
            None => {}
        }
    }
    out
}

/// Moment tensor names.
fn moment_name(which: usize, tensor: &str) -> String {
    format!(
        "optim.{}.{tensor}",
        if which == 0 { "exp_avg" } else { "exp_avg_sq" }
    )
}

impl LocalState {
    /// Reads every parameter segment's region from `source` (a checkpoint or a consolidated
    /// model file), leaving the optimizer state as it is.
    pub fn load_params(&mut self, source: &dyn TensorSource) -> Result<(), CheckpointError> {
        for s in &self.param_segments {
            source.expect_shape(&s.tensor, &s.shape)?;
            let values = source.read(&s.tensor, &s.region)?;
            s.scatter(&values, &mut self.params);
        }
        Ok(())
    }

    /// Every piece this rank writes: parameters and both moments, each shared with the ranks
    /// holding the same data (`(index, count)`).
    pub fn pieces_for(
        &self,
        param_replicas: (usize, usize),
        moment_replicas: (usize, usize),
    ) -> Vec<PieceData> {
        let replicas = moment_replicas;
        let mut out = pieces_to_write(&self.param_segments, &self.params, param_replicas);
        for (which, moment) in self.moments.iter().enumerate() {
            let named: Vec<Segment> = self
                .moment_segments
                .iter()
                .map(|s| s.renamed(moment_name(which, &s.tensor)))
                .collect();
            out.extend(pieces_to_write(&named, moment, replicas));
        }
        out
    }

    /// Reads every segment's region from `ckpt` into the flat vectors (which keep their
    /// lengths: padding stays as it is). Fails naming the tensor when the checkpoint lacks it
    /// or has another shape (a checkpoint of another model).
    pub fn load(&mut self, ckpt: &Checkpoint) -> Result<(), CheckpointError> {
        self.load_params(ckpt)?;
        for (which, moment) in self.moments.iter_mut().enumerate() {
            for s in &self.moment_segments {
                let name = moment_name(which, &s.tensor);
                ckpt.expect_shape(&name, &s.shape)?;
                let values = ckpt.read(&name, &s.region)?;
                s.scatter(&values, moment);
            }
        }
        let steps = ckpt
            .index()
            .run
            .get("adamw_steps")
            .and_then(|v| v.as_i64())
            .ok_or_else(|| {
                CheckpointError::Mismatch(format!(
                    "{}: the run state has no `adamw_steps`",
                    ckpt.dir().display()
                ))
            })?;
        self.steps_taken = i32::try_from(steps).map_err(|_| {
            CheckpointError::Mismatch(format!("adamw_steps = {steps} is out of range"))
        })?;
        Ok(())
    }
}

/// Gathers every rank's manifest at rank 0 of `world` (collective; JSON bytes padded to the
/// longest).
pub fn gather_manifests(
    world: &Group,
    manifest: &ShardManifest,
) -> Result<Vec<ShardManifest>, String> {
    let bytes = serde_json::to_vec(manifest).map_err(|e| e.to_string())?;
    let mut longest = [bytes.len() as u64];
    world
        .all_reduce(&mut longest, flashover_comm::ReduceOp::Max)
        .map_err(|e| e.to_string())?;
    let mut padded = bytes;
    padded.resize(longest[0] as usize, b' ');
    let all = world.all_gather_vec(&padded).map_err(|e| e.to_string())?;
    all.chunks(longest[0].max(1) as usize)
        .map(|chunk| serde_json::from_slice(chunk).map_err(|e| e.to_string()))
        .collect()
}

/// Opens the checkpoint to resume from, with the error naming the directory.
pub fn open(path: &Path) -> Result<Checkpoint, String> {
    Checkpoint::open(path).map_err(|e| format!("resuming: {e}"))
}

/// A save whose shard is being written in the background.
struct Pending {
    step: u64,
    run: serde_json::Value,
    writer: std::thread::JoinHandle<Result<ShardManifest, CheckpointError>>,
}

/// One rank's side of saving: write its shard (now or in the background), then, with every
/// other rank, commit (rank 0 writes the index) and prune. A save waits for the previous one.
pub struct Saver {
    root: std::path::PathBuf,
    keep: usize,
    background: bool,
    pending: Option<Pending>,
    /// Fault injection: fail after writing the shard of this step.
    fail_after_write: Option<u64>,
}

impl Saver {
    /// Saves under `root`, keeping `keep` checkpoints; `background` writes asynchronously.
    /// `fail_after_write` (tests) makes this rank fail after writing that step's shard.
    pub fn new(root: &Path, keep: usize, background: bool, fail_after_write: Option<u64>) -> Self {
        Saver {
            root: root.to_path_buf(),
            keep,
            background,
            pending: None,
            fail_after_write,
        }
    }

    /// Saves this rank's `pieces` as part of the checkpoint of `step` (collective over
    /// `world`). With background writing, returns once the shard's writer has started; the
    /// checkpoint is committed by the next `save` or [`Saver::finish`].
    pub fn save(
        &mut self,
        world: &Group,
        step: u64,
        run: serde_json::Value,
        pieces: Vec<PieceData>,
    ) -> Result<(), String> {
        self.finish(world)?;
        // Rank 0 prepares the directory; everyone learns whether that worked.
        let prepared = if world.rank() == 0 {
            flashover_checkpoint::begin(&self.root, step).map(|_| ())
        } else {
            Ok(())
        };
        agree(world, "prepare", step, prepared.map_err(|e| e.to_string()))?;
        let dir = flashover_checkpoint::partial(&self.root, step);
        let rank = world.rank();
        let writer = std::thread::Builder::new()
            .name(format!("ckpt-writer-{rank}"))
            .spawn(move || flashover_checkpoint::write_shard(&dir, rank, &pieces))
            .map_err(|e| format!("starting the checkpoint writer: {e}"))?;
        self.pending = Some(Pending { step, run, writer });
        if !self.background {
            self.finish(world)?;
        }
        Ok(())
    }

    /// Waits for the pending save (if any) and commits it (collective over `world`).
    pub fn finish(&mut self, world: &Group) -> Result<(), String> {
        let Some(p) = self.pending.take() else {
            return Ok(());
        };
        let mine = p
            .writer
            .join()
            .map_err(|_| "the checkpoint writer panicked".to_string())
            .and_then(|r| r.map_err(|e| e.to_string()))
            .and_then(|m| {
                if self.fail_after_write == Some(p.step) {
                    Err("injected failure after writing the shard".into())
                } else {
                    Ok(m)
                }
            });
        let written = agree(
            world,
            "write",
            p.step,
            mine.as_ref().map(|_| ()).map_err(Clone::clone),
        );
        let manifest = match (written, mine) {
            (Ok(()), Ok(m)) => m,
            (Err(e), _) | (_, Err(e)) => return Err(e),
        };
        let manifests = gather_manifests(world, &manifest)?;
        let committed = if world.rank() == 0 {
            flashover_checkpoint::commit(&self.root, p.step, p.run, manifests)
                .and_then(|_| flashover_checkpoint::prune(&self.root, self.keep))
                .map_err(|e| e.to_string())
        } else {
            Ok(())
        };
        agree(world, "commit", p.step, committed)
    }
}

/// Every rank's outcome of one phase of a save: all succeed, or all fail with a message naming
/// the ranks that failed (and this rank's own error).
fn agree(world: &Group, phase: &str, step: u64, mine: Result<(), String>) -> Result<(), String> {
    let failed = world
        .all_gather_vec(&[mine.is_err() as u8])
        .map_err(|e| format!("checkpoint of step {step} ({phase}): {e}"))?;
    let ranks: Vec<usize> = (0..failed.len()).filter(|&r| failed[r] != 0).collect();
    if ranks.is_empty() {
        return Ok(());
    }
    Err(format!(
        "checkpoint of step {step} not committed: {phase} failed on rank(s) {ranks:?}{}; the previous checkpoint is intact",
        mine.err()
            .map_or(String::new(), |e| format!(" (here: {e})"))
    ))
}

/// Writes the model's parameters from `ckpt` as one safetensors file at `out`, named as the
/// model's parameters (`blocks.0.attn.wq.weight`, ...), whole: what ordinary Burn code loads
/// (burn-store) or starts a new run from. Returns the number of tensors written.
pub fn export(ckpt: &Checkpoint, out: &Path) -> Result<usize, String> {
    let mut tensors = vec![];
    for (name, entry) in &ckpt.index().tensors {
        if !name.starts_with("optim.") {
            let values = ckpt.read_whole(name).map_err(|e| e.to_string())?;
            tensors.push((name.clone(), entry.dims(), values));
        }
    }
    let metadata =
        std::collections::HashMap::from([("flashover_step".to_string(), ckpt.step().to_string())]);
    flashover_checkpoint::ModelFile::write(out, &tensors, metadata).map_err(|e| e.to_string())?;
    Ok(tensors.len())
}

/// Rewrites the checkpoint at `src` as the job saved in it would save it on `mesh` (and ZeRO
/// stage `zero`, default the saved one) into the checkpoint root `out`: the ranks of the new
/// mesh load it (each reading its regions) and save at once, training nothing. Returns the
/// new checkpoint's directory.
pub fn reshard(
    src: &Path,
    mesh: &str,
    zero: Option<u8>,
    out: &Path,
) -> Result<std::path::PathBuf, String> {
    let ckpt = open(src)?;
    let saved = ckpt.index().run.get("config").cloned().ok_or_else(|| {
        format!(
            "{}: the run state has no job configuration",
            ckpt.dir().display()
        )
    })?;
    let mut config: super::TrainConfig = serde_json::from_value(saved)
        .map_err(|e| format!("{}: the saved configuration: {e}", ckpt.dir().display()))?;
    config.parallel.mesh = mesh.to_string();
    if let Some(stage) = zero {
        config.parallel.zero = stage;
    }
    config.run.steps = ckpt.step() as usize;
    config.run.log_jsonl = None;
    config.run.trace = None;
    config.checkpoint = super::CheckpointSection {
        dir: Some(out.to_path_buf()),
        save_every: 1,
        resume: Some(ckpt.dir().to_path_buf()),
        ..super::CheckpointSection::default()
    };
    let errors = config.validate();
    if !errors.is_empty() {
        return Err(format!(
            "resharding onto `{mesh}`:\n  {}",
            errors.join("\n  ")
        ));
    }
    super::train(&config, &|_| {})?;
    Ok(out.join(flashover_checkpoint::step_dir_name(ckpt.step())))
}
