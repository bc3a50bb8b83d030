//! The global index (`index.json`): every tensor's global shape and which byte ranges of which
//! shard files hold which of its regions, each file's size and checksum, and the run state.
//!
//! Loading treats the index as untrusted: [`Index::validate`] checks every size, offset and
//! shape with overflow-checked arithmetic, and that each tensor's pieces cover it exactly once,
//! before anything is allocated from it.

use crate::region::{Region, Run, checked_numel};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Format tag written into every index.
pub const FORMAT: &str = "flashover-checkpoint/1";
/// Name of the index file inside a checkpoint directory.
pub const INDEX_FILE: &str = "index.json";
/// The only element type written so far.
pub const DTYPE_F32: &str = "F32";

/// A shard file: its name inside the checkpoint directory, size and CRC-32 of its bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name (no directories).
    pub name: String,
    /// Size in bytes.
    pub bytes: u64,
    /// CRC-32 (IEEE) of the whole file.
    pub crc32: u32,
}

/// One stored piece of a tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PieceEntry {
    /// Index into [`Index::files`].
    pub file: usize,
    /// The tensor's name inside the safetensors file.
    pub key: String,
    /// Which elements of the global tensor it holds, in the region's row-major order.
    pub region: Region,
    /// First byte of its data in the file.
    pub byte_offset: u64,
    /// Bytes of data (4 per element).
    pub byte_len: u64,
    /// CRC-32 of those bytes.
    pub crc32: u32,
}

/// A global tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Global shape.
    pub shape: Vec<u64>,
    /// Element type (`F32`).
    pub dtype: String,
    /// Where its elements are stored; together they cover it exactly once.
    pub pieces: Vec<PieceEntry>,
}

/// The whole index of one checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Index {
    /// [`FORMAT`].
    pub format: String,
    /// The optimizer step the checkpoint was taken after.
    pub step: u64,
    /// Run state the training job records (configuration, mesh, seed, schedule position).
    pub run: serde_json::Value,
    /// Shard files, in writer-rank order.
    pub files: Vec<FileEntry>,
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorEntry>,
}

impl TensorEntry {
    /// The shape as `usize`s (checked by [`Index::validate`]).
    pub fn dims(&self) -> Vec<usize> {
        self.shape.iter().map(|&d| d as usize).collect()
    }

    /// Elements (checked by [`Index::validate`]).
    pub fn numel(&self) -> usize {
        self.dims().iter().product()
    }
}

/// A file name that stays inside the checkpoint directory.
pub(crate) fn safe_file_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl Index {
    /// The format tag, and that file names are plain names inside the checkpoint directory and
    /// listed once.
    pub fn check_file_names(&self) -> Result<(), String> {
        if self.format != FORMAT {
            return Err(format!(
                "format `{}` is not `{FORMAT}`",
                self.format.chars().take(64).collect::<String>()
            ));
        }
        let mut names = std::collections::HashSet::new();
        for (i, f) in self.files.iter().enumerate() {
            if !safe_file_name(&f.name) {
                return Err(format!("file {i}: `{}` is not a plain file name", f.name));
            }
            if !names.insert(&f.name) {
                return Err(format!("file `{}` is listed twice", f.name));
            }
        }
        Ok(())
    }

    /// Checks everything loading relies on; `actual_sizes[i]` is the size of `files[i]` on disk
    /// (`None` to check against the recorded sizes only). Errors say what is wrong, naming the
    /// tensor or file.
    pub fn validate(&self, actual_sizes: Option<&[u64]>) -> Result<(), String> {
        self.check_file_names()?;
        for (i, f) in self.files.iter().enumerate() {
            if let Some(sizes) = actual_sizes
                && sizes.get(i) != Some(&f.bytes)
            {
                return Err(format!(
                    "file `{}` has {} bytes on disk but the index records {} (truncated or replaced)",
                    f.name,
                    sizes.get(i).map_or("no".into(), |s| s.to_string()),
                    f.bytes
                ));
            }
        }
        for (name, t) in &self.tensors {
            if t.dtype != DTYPE_F32 {
                return Err(format!(
                    "tensor `{name}`: dtype `{}` is not supported (F32)",
                    t.dtype
                ));
            }
            let shape: Vec<usize> = t
                .shape
                .iter()
                .map(|&d| {
                    usize::try_from(d).map_err(|_| format!("tensor `{name}`: shape too large"))
                })
                .collect::<Result<_, _>>()?;
            let numel = checked_numel(&shape)
                .filter(|n| n.checked_mul(4).is_some())
                .ok_or_else(|| format!("tensor `{name}`: shape {:?} overflows", t.shape))?;
            let mut covered = 0usize;
            for (k, p) in t.pieces.iter().enumerate() {
                let what = || format!("tensor `{name}` piece {k}");
                let file = self
                    .files
                    .get(p.file)
                    .ok_or_else(|| format!("{}: file index {} out of range", what(), p.file))?;
                let n = p
                    .region
                    .check(&shape)
                    .map_err(|e| format!("{}: {e}", what()))?;
                if p.byte_len != n as u64 * 4 {
                    return Err(format!(
                        "{}: {} bytes for {n} f32 elements",
                        what(),
                        p.byte_len
                    ));
                }
                let end = p
                    .byte_offset
                    .checked_add(p.byte_len)
                    .ok_or_else(|| format!("{}: byte range overflows", what()))?;
                if end > file.bytes {
                    return Err(format!(
                        "{}: bytes {}..{end} lie beyond the end of `{}` ({} bytes)",
                        what(),
                        p.byte_offset,
                        file.name,
                        file.bytes
                    ));
                }
                covered = covered.saturating_add(n);
            }
            if covered != numel {
                return Err(format!(
                    "tensor `{name}`: its pieces hold {covered} elements, the tensor has {numel}"
                ));
            }
            // Same count and no overlap: every element is stored exactly once.
            let mut runs: Vec<Run> = t
                .pieces
                .iter()
                .flat_map(|p| p.region.runs(&shape))
                .collect();
            runs.sort_by_key(|r| r.global);
            if runs
                .windows(2)
                .any(|w| w[0].global + w[0].len > w[1].global)
            {
                return Err(format!("tensor `{name}`: pieces overlap"));
            }
        }
        Ok(())
    }
}
