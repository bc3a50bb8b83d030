//! Loading: open a committed checkpoint, validate its index against the files on disk and
//! their safetensors headers, and read any region of any tensor from the pieces that overlap
//! it (memory-mapped: only those bytes are touched). Each piece's checksum is verified the
//! first time it is read; [`Checkpoint::verify`] checks every file whole.

use crate::error::CheckpointError;
use crate::index::{INDEX_FILE, Index, TensorEntry};
use crate::region::{Region, overlap};
use crate::write::committed;
use memmap2::Mmap;
use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// An index larger than this is refused before parsing (it would describe millions of pieces).
const MAX_INDEX_BYTES: u64 = 256 << 20;

/// An opened, validated checkpoint.
pub struct Checkpoint {
    dir: PathBuf,
    index: Index,
    maps: Vec<Mmap>,
    /// Pieces whose checksum was verified, as `(tensor, piece)`.
    verified: Mutex<HashSet<(String, usize)>>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("step", &self.index.step)
            .finish()
    }
}

/// Where loading reads whole-model tensors from: a [`Checkpoint`] or a consolidated
/// [`crate::ModelFile`].
pub trait TensorSource {
    /// Checks `name` exists with exactly `shape`; the error names the tensor.
    fn expect_shape(&self, name: &str, shape: &[usize]) -> Result<(), CheckpointError>;
    /// The elements of `region` of tensor `name`, in the region's order.
    fn read(&self, name: &str, region: &Region) -> Result<Vec<f32>, CheckpointError>;
}

impl TensorSource for Checkpoint {
    fn expect_shape(&self, name: &str, shape: &[usize]) -> Result<(), CheckpointError> {
        Checkpoint::expect_shape(self, name, shape)
    }

    fn read(&self, name: &str, region: &Region) -> Result<Vec<f32>, CheckpointError> {
        Checkpoint::read(self, name, region)
    }
}

/// The newest committed checkpoint under `root`, or `root` itself if it is one.
pub fn resolve(root: &Path) -> Result<PathBuf, CheckpointError> {
    if root.join(INDEX_FILE).is_file() {
        return Ok(root.to_path_buf());
    }
    committed(root)?.pop().map(|(_, p)| p).ok_or_else(|| {
        CheckpointError::NotFound(format!(
            "{}: no committed checkpoint (no index.json here or in a step-* directory)",
            root.display()
        ))
    })
}

impl Checkpoint {
    /// Opens the checkpoint at `path` (a checkpoint directory, or a root holding `step-*`
    /// directories, whose newest is taken). Every error names the file at fault.
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        let dir = resolve(path)?;
        let index_path = dir.join(INDEX_FILE);
        let file = File::open(&index_path).map_err(|e| CheckpointError::io(&index_path, e))?;
        let len = file
            .metadata()
            .map_err(|e| CheckpointError::io(&index_path, e))?
            .len();
        if len > MAX_INDEX_BYTES {
            return Err(CheckpointError::corrupt(
                &index_path,
                format!("{len} bytes is too large for an index"),
            ));
        }
        let text = std::fs::read(&index_path).map_err(|e| CheckpointError::io(&index_path, e))?;
        let index: Index = serde_json::from_slice(&text).map_err(|e| {
            CheckpointError::corrupt(&index_path, format!("not a valid index: {e}"))
        })?;
        // Names first (they become paths), then sizes on disk, then everything else, so no
        // size the index claims is trusted before the files confirm it.
        index
            .check_file_names()
            .map_err(|e| CheckpointError::corrupt(&index_path, e))?;
        let mut maps = vec![];
        let mut sizes = vec![];
        for f in &index.files {
            let path = dir.join(&f.name);
            let file = File::open(&path).map_err(|e| CheckpointError::io(&path, e))?;
            // SAFETY: the file is opened read-only; a checkpoint is immutable once committed.
            // Another process truncating it while mapped is outside what we can guard against.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| CheckpointError::io(&path, e))?;
            sizes.push(map.len() as u64);
            maps.push(map);
        }
        index.validate(Some(&sizes)).map_err(|e| {
            let culprit = index
                .files
                .iter()
                .zip(&sizes)
                .find(|(f, s)| f.bytes != **s)
                .map_or(index_path.clone(), |(f, _)| dir.join(&f.name));
            CheckpointError::corrupt(culprit, e)
        })?;
        let ckpt = Checkpoint {
            dir,
            index,
            maps,
            verified: Mutex::new(HashSet::new()),
        };
        ckpt.check_headers()?;
        Ok(ckpt)
    }

    /// Each file's safetensors header must agree with the index about every piece in it.
    fn check_headers(&self) -> Result<(), CheckpointError> {
        let mut headers = vec![];
        for (f, map) in self.index.files.iter().zip(&self.maps) {
            let path = self.dir.join(&f.name);
            let (n, meta) = safetensors::SafeTensors::read_metadata(map)
                .map_err(|e| CheckpointError::corrupt(&path, format!("safetensors header: {e}")))?;
            headers.push((8 + n as u64, meta, path));
        }
        for (name, t) in &self.index.tensors {
            for p in &t.pieces {
                let (start, meta, path) = &headers[p.file];
                let ok = meta.info(&p.key).is_some_and(|info| {
                    info.dtype == safetensors::Dtype::F32
                        && info.shape.iter().product::<usize>() as u64 * 4 == p.byte_len
                        && start + info.data_offsets.0 as u64 == p.byte_offset
                });
                if !ok {
                    return Err(CheckpointError::corrupt(
                        path,
                        format!(
                            "its header does not hold `{}` (tensor `{name}`) where the index says",
                            p.key
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The directory read.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The index.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// The step it was taken after.
    pub fn step(&self) -> u64 {
        self.index.step
    }

    /// A tensor's entry, or an error naming it.
    pub fn tensor(&self, name: &str) -> Result<&TensorEntry, CheckpointError> {
        self.index.tensors.get(name).ok_or_else(|| {
            CheckpointError::Mismatch(format!(
                "{}: no tensor `{name}` in this checkpoint (a checkpoint of another model?)",
                self.dir.display()
            ))
        })
    }

    /// Checks `name` exists with exactly `shape`.
    pub fn expect_shape(&self, name: &str, shape: &[usize]) -> Result<(), CheckpointError> {
        let t = self.tensor(name)?;
        if t.dims() != shape {
            return Err(CheckpointError::Mismatch(format!(
                "{}: tensor `{name}` has shape {:?} in the checkpoint, the model has {shape:?}",
                self.dir.display(),
                t.shape
            )));
        }
        Ok(())
    }

    /// The elements of `region` of tensor `name`, in the region's order, read from every piece
    /// overlapping it (each piece's checksum verified on first use).
    pub fn read(&self, name: &str, region: &Region) -> Result<Vec<f32>, CheckpointError> {
        let t = self.tensor(name)?;
        let shape = t.dims();
        let n = region
            .check(&shape)
            .map_err(|e| CheckpointError::Invalid(format!("reading `{name}`: {e}")))?;
        let mut out = vec![0f32; n];
        let want = region.runs(&shape);
        for (k, p) in t.pieces.iter().enumerate() {
            // The common stretches, found once: none means the piece is not read at all.
            let mut common = vec![];
            overlap(&want, &p.region.runs(&shape), |dst, src, len| {
                common.push((dst, src, len))
            });
            if common.is_empty() {
                continue;
            }
            let bytes =
                &self.maps[p.file][p.byte_offset as usize..(p.byte_offset + p.byte_len) as usize];
            self.verify_piece(name, k, bytes, p.crc32, p.file)?;
            for (dst, src, len) in common {
                for (o, chunk) in out[dst..dst + len]
                    .iter_mut()
                    .zip(bytes[src * 4..(src + len) * 4].chunks_exact(4))
                {
                    *o = f32::from_le_bytes(chunk.try_into().expect("4 bytes"));
                }
            }
        }
        Ok(out)
    }

    /// The whole tensor `name`.
    pub fn read_whole(&self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        let shape = self.tensor(name)?.dims();
        self.read(name, &Region::whole(&shape))
    }

    fn verify_piece(
        &self,
        name: &str,
        k: usize,
        bytes: &[u8],
        crc: u32,
        file: usize,
    ) -> Result<(), CheckpointError> {
        let key = (name.to_string(), k);
        if self.verified.lock().expect("not poisoned").contains(&key) {
            return Ok(());
        }
        if crc32fast::hash(bytes) != crc {
            return Err(CheckpointError::corrupt(
                self.dir.join(&self.index.files[file].name),
                format!(
                    "checksum mismatch in the data of tensor `{name}` (piece {k}): the file is corrupt"
                ),
            ));
        }
        self.verified.lock().expect("not poisoned").insert(key);
        Ok(())
    }

    /// Checks every file's checksum whole; returns per file `(name, bytes, ok)`.
    pub fn verify(&self) -> Vec<(String, u64, bool)> {
        self.index
            .files
            .iter()
            .zip(&self.maps)
            .map(|(f, map)| (f.name.clone(), f.bytes, crc32fast::hash(map) == f.crc32))
            .collect()
    }
}
