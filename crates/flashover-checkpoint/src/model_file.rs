//! A consolidated model file: one safetensors file of whole tensors (what `ckpt export` writes
//! and ordinary Burn code saves with burn-store), read as untrusted input.

use crate::error::CheckpointError;
use crate::read::TensorSource;
use crate::region::{Region, checked_numel};
use crate::write::{serialize_f32, write_file};
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// An opened safetensors file of whole f32 tensors.
pub struct ModelFile {
    path: PathBuf,
    map: Mmap,
    tensors: HashMap<String, (Vec<usize>, Range<usize>)>,
}

impl ModelFile {
    /// Opens and validates `path`: the header must parse, every tensor be F32 with its data
    /// inside the file. Errors name the file.
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        let file = File::open(path).map_err(|e| CheckpointError::io(path, e))?;
        // SAFETY: read-only mapping of a file we do not modify; see `Checkpoint::open`.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| CheckpointError::io(path, e))?;
        let (n, meta) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| CheckpointError::corrupt(path, format!("safetensors header: {e}")))?;
        let start = 8 + n;
        let mut tensors = HashMap::new();
        for (name, info) in meta.tensors() {
            if info.dtype != safetensors::Dtype::F32 {
                return Err(CheckpointError::corrupt(
                    path,
                    format!("tensor `{name}` is {:?}; only F32 is supported", info.dtype),
                ));
            }
            let (a, b) = info.data_offsets;
            let range = start.checked_add(a).zip(start.checked_add(b));
            let numel = checked_numel(&info.shape);
            match (range, numel) {
                (Some((a, b)), Some(numel)) if a <= b && b <= map.len() && b - a == numel * 4 => {
                    tensors.insert(name, (info.shape.clone(), a..b));
                }
                _ => {
                    return Err(CheckpointError::corrupt(
                        path,
                        format!("tensor `{name}`: its data does not fit the file"),
                    ));
                }
            }
        }
        Ok(ModelFile {
            path: path.to_path_buf(),
            map,
            tensors,
        })
    }

    /// Writes `tensors` (name, shape, values) as one safetensors file at `path`, durably
    /// (temporary name, fsync, rename), with `metadata` in its header.
    pub fn write(
        path: &Path,
        tensors: &[(String, Vec<usize>, Vec<f32>)],
        metadata: HashMap<String, String>,
    ) -> Result<(), CheckpointError> {
        let raw: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .map(|(name, shape, values)| {
                let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                (name.clone(), shape.clone(), bytes)
            })
            .collect();
        let bytes =
            serialize_f32(&raw, Some(metadata)).map_err(|e| CheckpointError::corrupt(path, e))?;
        let (dir, name) = match (path.parent(), path.file_name().and_then(|n| n.to_str())) {
            (Some(dir), Some(name)) => (
                if dir.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    dir
                },
                name,
            ),
            _ => {
                return Err(CheckpointError::Invalid(format!(
                    "{}: not a file path",
                    path.display()
                )));
            }
        };
        write_file(dir, name, &bytes)
    }

    fn entry(&self, name: &str) -> Result<&(Vec<usize>, Range<usize>), CheckpointError> {
        self.tensors.get(name).ok_or_else(|| {
            CheckpointError::Mismatch(format!(
                "{}: no tensor `{name}` (a file of another model?)",
                self.path.display()
            ))
        })
    }
}

impl TensorSource for ModelFile {
    fn expect_shape(&self, name: &str, shape: &[usize]) -> Result<(), CheckpointError> {
        let (have, _) = self.entry(name)?;
        if have != shape {
            return Err(CheckpointError::Mismatch(format!(
                "{}: tensor `{name}` has shape {have:?}, the model has {shape:?}",
                self.path.display()
            )));
        }
        Ok(())
    }

    fn read(&self, name: &str, region: &Region) -> Result<Vec<f32>, CheckpointError> {
        let (shape, range) = self.entry(name)?;
        let n = region
            .check(shape)
            .map_err(|e| CheckpointError::Invalid(format!("reading `{name}`: {e}")))?;
        let bytes = &self.map[range.clone()];
        let mut out = Vec::with_capacity(n);
        for run in region.runs(shape) {
            out.extend(
                bytes[run.global * 4..(run.global + run.len) * 4]
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))),
            );
        }
        Ok(out)
    }
}
