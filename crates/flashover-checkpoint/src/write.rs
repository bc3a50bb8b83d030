//! Saving: each rank writes its pieces to one safetensors file inside a hidden partial
//! directory; when every rank is done, one rank writes the index and renames the directory
//! into place. A checkpoint is therefore visible only when complete, and a crash at any point
//! leaves the previous one intact.
//!
//! ```text
//! root/step-00000200/            committed: rank-00000.safetensors ... index.json
//! root/.step-00000300.partial/   being written (ignored by readers, removed by the next save)
//! ```
//! Every file is written under a temporary name, flushed to disk (`fsync`) and renamed; the
//! directories are synced after renames so the renames themselves survive a power loss.

use crate::error::CheckpointError;
use crate::index::{DTYPE_F32, FORMAT, FileEntry, INDEX_FILE, Index, PieceEntry, TensorEntry};
use crate::region::Region;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

/// One piece a rank saves: which elements of which global tensor, and their values.
#[derive(Debug, Clone, PartialEq)]
pub struct PieceData {
    /// Global tensor name.
    pub tensor: String,
    /// Global shape.
    pub shape: Vec<usize>,
    /// The elements held (see [`Region`]).
    pub region: Region,
    /// Their values, in the region's order.
    pub values: Vec<f32>,
}

/// What one rank wrote, for the index: its file and where each piece sits in it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardManifest {
    /// The file.
    pub file: FileEntry,
    /// Per piece: tensor name, global shape, and the piece (its `file` is set at commit).
    pub pieces: Vec<(String, Vec<u64>, PieceEntry)>,
}

/// Name of a committed checkpoint directory.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

fn partial_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!(".{}.partial", step_dir_name(step)))
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    // Directory fsync makes renames durable; not every platform allows opening a directory.
    match File::open(dir) {
        Ok(d) => d.sync_all().or(Ok(())),
        Err(_) => Ok(()),
    }
}

/// Writes `bytes` to `dir/name` durably: temporary name, fsync, rename.
pub(crate) fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), CheckpointError> {
    let tmp = dir.join(format!("{name}.tmp"));
    let path = dir.join(name);
    let mut f = File::create(&tmp).map_err(|e| CheckpointError::io(&tmp, e))?;
    f.write_all(bytes)
        .map_err(|e| CheckpointError::io(&tmp, e))?;
    f.sync_all().map_err(|e| CheckpointError::io(&tmp, e))?;
    fs::rename(&tmp, &path).map_err(|e| CheckpointError::io(&path, e))
}

/// Starts the checkpoint of `step` under `root` (one rank, before any writes): creates the
/// partial directory, removing a stale one left by a crashed save. Returns its path.
pub fn begin(root: &Path, step: u64) -> Result<PathBuf, CheckpointError> {
    fs::create_dir_all(root).map_err(|e| CheckpointError::io(root, e))?;
    let dir = partial_dir(root, step);
    if dir.exists() {
        fs::remove_dir_all(&dir).map_err(|e| CheckpointError::io(&dir, e))?;
    }
    fs::create_dir(&dir).map_err(|e| CheckpointError::io(&dir, e))?;
    Ok(dir)
}

/// The partial directory [`begin`] created for `step` (for the other ranks).
pub fn partial(root: &Path, step: u64) -> PathBuf {
    partial_dir(root, step)
}

/// A safetensors file's bytes holding `tensors` (name, shape, little-endian f32 bytes).
pub(crate) fn serialize_f32(
    tensors: &[(String, Vec<usize>, Vec<u8>)],
    metadata: Option<std::collections::HashMap<String, String>>,
) -> Result<Vec<u8>, String> {
    let views = tensors
        .iter()
        .map(|(name, shape, bytes)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    safetensors::tensor::serialize(views, metadata).map_err(|e| e.to_string())
}

/// Writes rank `rank`'s pieces into `dir` (from [`begin`]) as one safetensors file
/// (`rank-00003.safetensors`, tensors keyed `name@k`) and returns its manifest.
pub fn write_shard(
    dir: &Path,
    rank: usize,
    pieces: &[PieceData],
) -> Result<ShardManifest, CheckpointError> {
    let name = format!("rank-{rank:05}.safetensors");
    let path = dir.join(&name);
    let mut raw: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(pieces.len());
    for (k, p) in pieces.iter().enumerate() {
        let n = p
            .region
            .check(&p.shape)
            .map_err(|e| CheckpointError::Invalid(format!("saving `{}`: {e}", p.tensor)))?;
        if n != p.values.len() {
            return Err(CheckpointError::Invalid(format!(
                "saving `{}`: {} values for a region of {n} elements",
                p.tensor,
                p.values.len()
            )));
        }
        let bytes: Vec<u8> = p.values.iter().flat_map(|v| v.to_le_bytes()).collect();
        raw.push((format!("{}@{k}", p.tensor), vec![n], bytes));
    }
    let bytes = serialize_f32(&raw, None).map_err(|e| CheckpointError::corrupt(&path, e))?;
    // Where each piece landed: the header gives data offsets after its own length.
    let (header, meta) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| CheckpointError::corrupt(&path, e.to_string()))?;
    let data_start = 8 + header as u64;
    let mut manifest = ShardManifest {
        file: FileEntry {
            name: name.clone(),
            bytes: bytes.len() as u64,
            crc32: crc32fast::hash(&bytes),
        },
        pieces: vec![],
    };
    for ((key, _, _), p) in raw.iter().zip(pieces) {
        let info = meta.info(key).expect("just serialized");
        let (start, end) = info.data_offsets;
        let range = data_start as usize + start..data_start as usize + end;
        manifest.pieces.push((
            p.tensor.clone(),
            p.shape.iter().map(|&d| d as u64).collect(),
            PieceEntry {
                file: 0,
                key: key.clone(),
                region: p.region.clone(),
                byte_offset: range.start as u64,
                byte_len: (end - start) as u64,
                crc32: crc32fast::hash(&bytes[range]),
            },
        ));
    }
    write_file(dir, &name, &bytes)?;
    Ok(manifest)
}

/// Completes the checkpoint of `step` (one rank, after every rank's [`write_shard`]): writes
/// the index built from `manifests` (in rank order) and `run`, then renames the partial
/// directory to `step-NNNNNNNN`. Fails, leaving nothing visible, if the pieces do not cover
/// every tensor exactly once or disagree on a tensor's shape.
pub fn commit(
    root: &Path,
    step: u64,
    run: serde_json::Value,
    manifests: Vec<ShardManifest>,
) -> Result<PathBuf, CheckpointError> {
    let dir = partial_dir(root, step);
    let mut files = vec![];
    let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
    for manifest in manifests {
        let file = files.len();
        files.push(manifest.file);
        for (name, shape, mut piece) in manifest.pieces {
            piece.file = file;
            let entry = tensors.entry(name.clone()).or_insert_with(|| TensorEntry {
                shape: shape.clone(),
                dtype: DTYPE_F32.into(),
                pieces: vec![],
            });
            if entry.shape != shape {
                return Err(CheckpointError::Invalid(format!(
                    "tensor `{name}` saved with shapes {:?} and {shape:?}",
                    entry.shape
                )));
            }
            entry.pieces.push(piece);
        }
    }
    let index = Index {
        format: FORMAT.into(),
        step,
        run,
        files,
        tensors,
    };
    index
        .validate(None)
        .map_err(|e| CheckpointError::Invalid(format!("refusing to commit step {step}: {e}")))?;
    let json = serde_json::to_vec_pretty(&index)
        .map_err(|e| CheckpointError::Invalid(format!("serializing the index: {e}")))?;
    write_file(&dir, INDEX_FILE, &json)?;
    sync_dir(&dir)?;
    let done = root.join(step_dir_name(step));
    if done.exists() {
        // Saving a step again (a resumed run reaching it): the new one replaces it.
        fs::remove_dir_all(&done).map_err(|e| CheckpointError::io(&done, e))?;
    }
    fs::rename(&dir, &done).map_err(|e| CheckpointError::io(&done, e))?;
    sync_dir(root)?;
    Ok(done)
}

/// Committed checkpoints under `root`, oldest first, as `(step, path)`.
pub fn committed(root: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let mut out = vec![];
    let entries = match fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(CheckpointError::io(root, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| CheckpointError::io(root, e))?;
        let name = entry.file_name();
        let Some(step) = name
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        if entry.path().join(INDEX_FILE).is_file() {
            out.push((step, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// Keeps the newest `keep` committed checkpoints under `root` (at least one) and removes
/// older ones and partial directories of steps before the newest.
pub fn prune(root: &Path, keep: usize) -> Result<(), CheckpointError> {
    let all = committed(root)?;
    let newest = all.last().map(|(s, _)| *s);
    for (_, path) in all.iter().take(all.len().saturating_sub(keep.max(1))) {
        fs::remove_dir_all(path).map_err(|e| CheckpointError::io(path, e))?;
    }
    if let (Some(newest), Ok(entries)) = (newest, fs::read_dir(root)) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let stale = name
                .to_str()
                .and_then(|n| n.strip_prefix(".step-"))
                .and_then(|n| n.strip_suffix(".partial"))
                .and_then(|s| s.parse::<u64>().ok())
                .is_some_and(|s| s < newest);
            if stale {
                fs::remove_dir_all(entry.path())
                    .map_err(|e| CheckpointError::io(entry.path(), e))?;
            }
        }
    }
    Ok(())
}
