//! `flashover bench ckpt`: checkpoint save and load throughput next to the raw speed of the
//! disk, measured in the same run on the same bytes.
//!
//! `ranks` threads each own `1/ranks` of every tensor of a synthetic model (parameters and two
//! AdamW moments, fp32) as flat pieces, as ZeRO ranks do. One repeat:
//! - *raw write*: each thread writes its bytes (serialized beforehand) to one file with
//!   `std::fs` and `fsync`s it;
//! - *save*: each thread writes its shard through the checkpoint layer (safetensors,
//!   checksums, temporary name, `fsync`, rename), then the index is committed;
//! - *raw read* and *load*: each thread reads its file back (`std::fs::read`) / its regions
//!   from the checkpoint (memory-mapped, checksums verified, converted to f32). Reads come from the page cache after the writes: they measure the
//!   software path, not the device.

use flashover_checkpoint::{Checkpoint, PieceData, Region, begin, commit, write_shard};
use serde::Serialize;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// One measured repeat.
#[derive(Debug, Clone, Serialize)]
pub struct CheckpointBenchRecord {
    /// Bytes written per save (all ranks, parameters and moments).
    pub bytes: u64,
    /// Writer threads.
    pub ranks: usize,
    /// GB/s writing the same bytes with `std::fs` + `fsync`.
    pub raw_write_gbs: f64,
    /// GB/s of a checkpoint save, commit included.
    pub save_gbs: f64,
    /// GB/s reading the raw files back.
    pub raw_read_gbs: f64,
    /// GB/s of a checkpoint load (open, validate, read every rank's regions, verify checksums).
    pub load_gbs: f64,
}

/// This rank's pieces: for each of `tensors` tensors of `[rows, 1024]` and each of the three
/// states, rank `r`'s flat range.
fn pieces(r: usize, ranks: usize, tensors: usize, rows: usize) -> Vec<PieceData> {
    let shape = vec![rows, 1024];
    let numel = rows * 1024;
    let (lo, hi) = (numel * r / ranks, numel * (r + 1) / ranks);
    let mut out = vec![];
    for state in ["", "optim.exp_avg.", "optim.exp_avg_sq."] {
        for t in 0..tensors {
            out.push(PieceData {
                tensor: format!("{state}layer{t}.weight"),
                shape: shape.clone(),
                region: Region::Flat {
                    start: lo as u64,
                    len: (hi - lo) as u64,
                },
                values: (lo..hi)
                    .map(|i| (i % 251) as f32 * 0.01 + t as f32)
                    .collect(),
            });
        }
    }
    out
}

fn gbs(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

/// Measures `repeats` save/load rounds of a model of `params` parameters (rounded to whole
/// `[rows, 1024]` tensors) over `ranks` threads, in `dir` (created and emptied).
pub fn run(
    dir: &Path,
    params: usize,
    ranks: usize,
    repeats: usize,
) -> Result<Vec<CheckpointBenchRecord>, String> {
    let rows = 256;
    let tensors = params.div_ceil(rows * 1024).max(1);
    let all: Vec<Vec<PieceData>> = (0..ranks)
        .map(|r| pieces(r, ranks, tensors, rows))
        .collect();
    let bytes: u64 = all
        .iter()
        .flatten()
        .map(|p| p.values.len() as u64 * 4)
        .sum();
    let io = |e: std::io::Error| e.to_string();
    let raw: Vec<Vec<u8>> = all
        .iter()
        .map(|mine| {
            mine.iter()
                .flat_map(|p| p.values.iter().flat_map(|v| v.to_le_bytes()))
                .collect()
        })
        .collect();
    let mut out = vec![];
    for _ in 0..repeats {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).map_err(io)?;
        // Raw: the same bytes, already serialized (the checkpoint's own conversion is part of
        // its time), one file per thread.
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for (r, raw) in raw.iter().enumerate() {
                s.spawn(move || -> std::io::Result<()> {
                    let mut f = std::fs::File::create(dir.join(format!("raw-{r}")))?;
                    f.write_all(raw)?;
                    f.sync_all()
                });
            }
        });
        let raw_write = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let raw_bytes: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = (0..ranks)
                .map(|r| s.spawn(move || std::fs::read(dir.join(format!("raw-{r}")))))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("reader thread").map(|b| b.len() as u64))
                .sum::<std::io::Result<u64>>()
        })
        .map_err(io)?;
        let raw_read = t0.elapsed().as_secs_f64();
        if raw_bytes != bytes {
            return Err(format!(
                "raw files hold {raw_bytes} bytes, expected {bytes}"
            ));
        }
        // Checkpoint save: every rank's shard in parallel, then the commit.
        let root = dir.join("ckpt");
        let t0 = Instant::now();
        let partial = begin(&root, 1).map_err(|e| e.to_string())?;
        let manifests = std::thread::scope(|s| {
            let handles: Vec<_> = all
                .iter()
                .enumerate()
                .map(|(r, mine)| {
                    let partial = &partial;
                    s.spawn(move || write_shard(partial, r, mine))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("writer thread"))
                .collect::<Result<Vec<_>, _>>()
        })
        .map_err(|e| e.to_string())?;
        commit(&root, 1, serde_json::json!({}), manifests).map_err(|e| e.to_string())?;
        let save = t0.elapsed().as_secs_f64();
        // Load: open once per rank (as every rank does), read this rank's regions.
        let t0 = Instant::now();
        let loaded: usize = std::thread::scope(|s| {
            let handles: Vec<_> = all
                .iter()
                .map(|mine| {
                    let root = &root;
                    s.spawn(move || -> Result<usize, String> {
                        let ckpt = Checkpoint::open(root).map_err(|e| e.to_string())?;
                        let mut n = 0;
                        for p in mine {
                            n += ckpt
                                .read(&p.tensor, &p.region)
                                .map_err(|e| e.to_string())?
                                .len();
                        }
                        Ok(n)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("reader thread"))
                .sum::<Result<usize, String>>()
        })?;
        let load = t0.elapsed().as_secs_f64();
        if loaded as u64 * 4 != bytes {
            return Err(format!("loaded {} bytes, expected {bytes}", loaded * 4));
        }
        out.push(CheckpointBenchRecord {
            bytes,
            ranks,
            raw_write_gbs: gbs(bytes, raw_write),
            save_gbs: gbs(bytes, save),
            raw_read_gbs: gbs(bytes, raw_read),
            load_gbs: gbs(bytes, load),
        });
    }
    let _ = std::fs::remove_dir_all(dir);
    Ok(out)
}
