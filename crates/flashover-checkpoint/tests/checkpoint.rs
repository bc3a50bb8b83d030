//! Save/load round trips across layouts, atomicity, corruption reports, and a seeded fuzzer
//! over the index and shard files (errors, never panics).

use flashover_checkpoint::{
    Checkpoint, CheckpointError, PieceData, Region, begin, commit, committed, prune, write_shard,
};
use std::path::{Path, PathBuf};

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "flashover-ckpt-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn values(tensor: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (tensor * 1000 + i) as f32 * 0.5).collect()
}

const SHAPES: [(&str, [usize; 2]); 3] = [("a", [4, 6]), ("b", [3, 5]), ("c", [1, 7])];

/// Saves the three tensors at `step`: "a" split by columns over 3 ranks, "b" as flat ranges
/// over 2 ranks, "c" whole on the last rank. `ranks` limits which ranks write (to simulate a
/// crash); commits only if all three wrote.
fn save(root: &Path, step: u64, ranks: &[usize]) -> Result<(), CheckpointError> {
    let dir = begin(root, step)?;
    let mut manifests = vec![];
    for &r in ranks {
        let mut pieces = vec![];
        let (name, shape) = SHAPES[0];
        let all = values(0, 24);
        let cols = 2;
        let mut v = vec![];
        for row in 0..4 {
            v.extend_from_slice(&all[row * 6 + r * cols..row * 6 + r * cols + cols]);
        }
        pieces.push(PieceData {
            tensor: name.into(),
            shape: shape.to_vec(),
            region: Region::slice(&shape, 1, r * cols, cols),
            values: v,
        });
        if r < 2 {
            let (name, shape) = SHAPES[1];
            let (start, len) = if r == 0 { (0, 8) } else { (8, 7) };
            pieces.push(PieceData {
                tensor: name.into(),
                shape: shape.to_vec(),
                region: Region::Flat {
                    start: start as u64,
                    len: len as u64,
                },
                values: values(1, 15)[start..start + len].to_vec(),
            });
        } else {
            let (name, shape) = SHAPES[2];
            pieces.push(PieceData {
                tensor: name.into(),
                shape: shape.to_vec(),
                region: Region::whole(&shape),
                values: values(2, 7),
            });
        }
        manifests.push(write_shard(&dir, r, &pieces)?);
    }
    if ranks.len() == 3 {
        commit(root, step, serde_json::json!({ "note": "test" }), manifests)?;
    }
    Ok(())
}

fn read_all(root: &Path) -> Result<Vec<Vec<f32>>, CheckpointError> {
    let ckpt = Checkpoint::open(root)?;
    SHAPES.iter().map(|(n, _)| ckpt.read_whole(n)).collect()
}

fn expected() -> Vec<Vec<f32>> {
    vec![values(0, 24), values(1, 15), values(2, 7)]
}

#[test]
fn any_region_reads_back_whatever_layout_saved_it() {
    let s = Scratch::new("roundtrip");
    save(&s.0, 5, &[0, 1, 2]).unwrap();
    assert_eq!(read_all(&s.0).unwrap(), expected());
    let ckpt = Checkpoint::open(&s.0).unwrap();
    assert_eq!(ckpt.step(), 5);
    // Saved by columns, read by rows (another tensor-parallel split) and as a flat range
    // (a ZeRO shard).
    let a = values(0, 24);
    assert_eq!(
        ckpt.read("a", &Region::slice(&[4, 6], 0, 1, 2)).unwrap(),
        a[6..18].to_vec()
    );
    assert_eq!(
        ckpt.read("a", &Region::Flat { start: 5, len: 9 }).unwrap(),
        a[5..14].to_vec()
    );
    assert!(ckpt.verify().iter().all(|(_, _, ok)| *ok));
    // Another model: a missing tensor and a wrong shape are named.
    let err = ckpt.read_whole("d").unwrap_err().to_string();
    assert!(err.contains("no tensor `d`"), "{err}");
    let err = ckpt.expect_shape("a", &[6, 4]).unwrap_err().to_string();
    assert!(err.contains("tensor `a` has shape [4, 6]"), "{err}");
}

#[test]
fn a_save_that_dies_half_way_leaves_the_last_checkpoint_and_old_ones_are_pruned() {
    let s = Scratch::new("atomic");
    save(&s.0, 1, &[0, 1, 2]).unwrap();
    save(&s.0, 2, &[0, 1, 2]).unwrap();
    save(&s.0, 3, &[0, 1]).unwrap(); // rank 2 never wrote; nobody committed
    assert_eq!(Checkpoint::open(&s.0).unwrap().step(), 2);
    assert_eq!(read_all(&s.0).unwrap(), expected());
    prune(&s.0, 1).unwrap();
    let left: Vec<u64> = committed(&s.0).unwrap().iter().map(|(s, _)| *s).collect();
    assert_eq!(left, vec![2]);
    // The partial save of step 3 is newer than the newest commit: kept for inspection.
    assert!(s.0.join(".step-00000003.partial").exists());
    // Uncovered elements are refused at commit, leaving nothing visible.
    let dir = begin(&s.0, 4).unwrap();
    let half = PieceData {
        tensor: "x".into(),
        shape: vec![4],
        region: Region::Flat { start: 0, len: 2 },
        values: vec![1.0, 2.0],
    };
    let m = write_shard(&dir, 0, &[half]).unwrap();
    let err = commit(&s.0, 4, serde_json::json!({}), vec![m])
        .unwrap_err()
        .to_string();
    assert!(err.contains("hold 2 elements, the tensor has 4"), "{err}");
    assert_eq!(Checkpoint::open(&s.0).unwrap().step(), 2);
}

fn step_dir(root: &Path) -> PathBuf {
    committed(root).unwrap().pop().unwrap().1
}

#[test]
fn a_flipped_byte_or_a_truncated_shard_fails_load_naming_the_file() {
    let s = Scratch::new("corrupt");
    save(&s.0, 7, &[0, 1, 2]).unwrap();
    let shard = step_dir(&s.0).join("rank-00001.safetensors");
    let good = std::fs::read(&shard).unwrap();
    // A flipped byte in the data: caught by the piece checksum when read.
    let mut bad = good.clone();
    let last = bad.len() - 3;
    bad[last] ^= 0x40;
    std::fs::write(&shard, &bad).unwrap();
    let err = read_all(&s.0).unwrap_err().to_string();
    assert!(
        err.contains("rank-00001.safetensors") && err.contains("checksum"),
        "{err}"
    );
    let ckpt = Checkpoint::open(&s.0).unwrap();
    let report = ckpt.verify();
    assert!(!report[1].2 && report[0].2 && report[2].2, "{report:?}");
    // Truncated: caught at open.
    std::fs::write(&shard, &good[..good.len() - 10]).unwrap();
    let err = Checkpoint::open(&s.0).unwrap_err().to_string();
    assert!(
        err.contains("rank-00001.safetensors") && err.contains("truncated"),
        "{err}"
    );
    // Missing.
    std::fs::remove_file(&shard).unwrap();
    let err = Checkpoint::open(&s.0).unwrap_err().to_string();
    assert!(err.contains("rank-00001.safetensors"), "{err}");
}

/// xorshift64*: a small seeded generator for the fuzzer.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Replaces a random number in a JSON value with a hostile one.
fn mutate_json(v: &mut serde_json::Value, rng: &mut Rng) -> bool {
    use serde_json::Value;
    let hostile = [
        Value::from(u64::MAX),
        Value::from(0),
        Value::from(-1),
        Value::from(1u64 << 40),
        Value::from("x"),
        Value::Null,
        Value::from(vec![1u64 << 33, 1u64 << 33]),
    ];
    match v {
        Value::Number(_) => {
            *v = hostile[rng.below(hostile.len())].clone();
            true
        }
        Value::String(s) if rng.below(4) == 0 => {
            *s = [
                "../../etc/passwd",
                "",
                "F64",
                "rank-00000.safetensors",
                "flat",
            ][rng.below(5)]
            .into();
            true
        }
        Value::Array(a) if !a.is_empty() => {
            if rng.below(8) == 0 {
                a.pop();
                return true;
            }
            let i = rng.below(a.len());
            mutate_json(&mut a[i], rng)
        }
        Value::Object(o) if !o.is_empty() => {
            let keys: Vec<String> = o.keys().cloned().collect();
            let k = &keys[rng.below(keys.len())];
            if rng.below(10) == 0 {
                o.remove(k);
                return true;
            }
            mutate_json(o.get_mut(k).unwrap(), rng)
        }
        _ => false,
    }
}

#[test]
fn fuzzed_indexes_and_shards_give_errors_never_panics_or_wrong_data() {
    let s = Scratch::new("fuzz");
    save(&s.0, 9, &[0, 1, 2]).unwrap();
    let dir = step_dir(&s.0);
    let index_path = dir.join("index.json");
    let index = std::fs::read(&index_path).unwrap();
    let shards: Vec<(PathBuf, Vec<u8>)> = (0..3)
        .map(|r| {
            let p = dir.join(format!("rank-{r:05}.safetensors"));
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let (mut errors, mut oks) = (0, 0);
    for case in 0..600 {
        std::fs::write(&index_path, &index).unwrap();
        for (p, b) in &shards {
            std::fs::write(p, b).unwrap();
        }
        match case % 3 {
            // Structural edits of the index.
            0 => {
                let mut v: serde_json::Value = serde_json::from_slice(&index).unwrap();
                for _ in 0..1 + rng.below(3) {
                    mutate_json(&mut v, &mut rng);
                }
                std::fs::write(&index_path, serde_json::to_vec(&v).unwrap()).unwrap();
            }
            // Raw byte flips in the index.
            1 => {
                let mut b = index.clone();
                for _ in 0..1 + rng.below(4) {
                    let i = rng.below(b.len());
                    b[i] = rng.next() as u8;
                }
                std::fs::write(&index_path, b).unwrap();
            }
            // A shard: flips (header or data), truncation or extension.
            _ => {
                let (p, good) = &shards[rng.below(3)];
                let mut b = good.clone();
                match rng.below(3) {
                    0 => {
                        for _ in 0..1 + rng.below(4) {
                            let i = rng.below(b.len());
                            b[i] ^= 1 << rng.below(8);
                        }
                    }
                    1 => b.truncate(rng.below(b.len())),
                    _ => b.extend_from_slice(&[0u8; 16]),
                }
                std::fs::write(p, b).unwrap();
            }
        }
        let outcome = std::panic::catch_unwind(|| read_all(&s.0));
        match outcome {
            Err(_) => panic!("case {case}: a mutated checkpoint made the loader panic"),
            Ok(Ok(v)) => {
                // Accepted only if the data is still exactly right (e.g. a flip in a JSON
                // string's unused spelling, or in padding the checksum does not cover).
                assert_eq!(v, expected(), "case {case}: wrong data accepted");
                oks += 1;
            }
            Ok(Err(e)) => {
                assert!(!e.to_string().is_empty());
                errors += 1;
            }
        }
    }
    assert!(errors > 500, "{errors} errors, {oks} accepted");
}
