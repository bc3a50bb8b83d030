//! Which elements of a global tensor a piece holds, and copying between two pieces' overlap.
//!
//! A region is either a range of the tensor's row-major flattening (how flat-sharded
//! optimizers such as ZeRO split parameters) or a block (an offset and extent per dimension:
//! how tensor parallelism splits a weight along a dimension). Both reduce to *runs*: maximal
//! stretches contiguous in the flattening, which is all that copying needs, so a checkpoint
//! saved in one layout can be read in any other.

use serde::{Deserialize, Serialize};

/// Elements of a global tensor held by one piece (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Region {
    /// Elements `start..start + len` of the row-major flattening.
    Flat {
        /// First element.
        start: u64,
        /// Number of elements.
        len: u64,
    },
    /// Indices `offsets[d]..offsets[d] + shape[d]` along every dimension `d`.
    Block {
        /// Start per dimension.
        offsets: Vec<u64>,
        /// Extent per dimension.
        shape: Vec<u64>,
    },
}

/// A stretch of a region contiguous in the global flattening: `len` elements from global
/// element `global`, stored from element `local` of the piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// First global element.
    pub global: usize,
    /// First element within the piece.
    pub local: usize,
    /// Elements.
    pub len: usize,
}

impl Region {
    /// The whole tensor of `shape`.
    pub fn whole(shape: &[usize]) -> Self {
        Region::Flat {
            start: 0,
            len: shape.iter().product::<usize>() as u64,
        }
    }

    /// Rows `start..start + len` along dimension `dim` of a tensor of `shape`, everything else
    /// whole (a tensor-parallel split).
    pub fn slice(shape: &[usize], dim: usize, start: usize, len: usize) -> Self {
        let mut offsets = vec![0u64; shape.len()];
        let mut extent: Vec<u64> = shape.iter().map(|&s| s as u64).collect();
        offsets[dim] = start as u64;
        extent[dim] = len as u64;
        Region::Block {
            offsets,
            shape: extent,
        }
    }

    /// Checks the region lies within a tensor of `shape` (untrusted input: every sum and
    /// product is checked) and returns its number of elements.
    pub fn check(&self, shape: &[usize]) -> Result<usize, String> {
        let numel = checked_numel(shape).ok_or("the tensor's element count overflows")?;
        match self {
            Region::Flat { start, len } => {
                let end = start
                    .checked_add(*len)
                    .ok_or("the region's end overflows")?;
                if end > numel as u64 {
                    return Err(format!(
                        "elements {start}..{end} lie outside a tensor of {numel} elements"
                    ));
                }
                Ok(*len as usize)
            }
            Region::Block {
                offsets,
                shape: extent,
            } => {
                if offsets.len() != shape.len() || extent.len() != shape.len() {
                    return Err(format!(
                        "a block of rank {}/{} in a tensor of rank {}",
                        offsets.len(),
                        extent.len(),
                        shape.len()
                    ));
                }
                let mut n = 1usize;
                for d in 0..shape.len() {
                    let end = offsets[d]
                        .checked_add(extent[d])
                        .ok_or("the block's end overflows")?;
                    if end > shape[d] as u64 {
                        return Err(format!(
                            "block {offsets:?} + {extent:?} lies outside shape {shape:?}"
                        ));
                    }
                    n = n
                        .checked_mul(extent[d] as usize)
                        .ok_or("the block's element count overflows")?;
                }
                Ok(n)
            }
        }
    }

    /// The region's runs in increasing global order, adjacent runs merged. The region must
    /// have passed [`Region::check`] for `shape`.
    pub fn runs(&self, shape: &[usize]) -> Vec<Run> {
        match self {
            Region::Flat { start, len } => vec![Run {
                global: *start as usize,
                local: 0,
                len: *len as usize,
            }],
            Region::Block {
                offsets,
                shape: extent,
            } => {
                let rank = shape.len();
                let extent: Vec<usize> = extent.iter().map(|&e| e as usize).collect();
                let offsets: Vec<usize> = offsets.iter().map(|&o| o as usize).collect();
                if rank == 0 {
                    return vec![Run {
                        global: 0,
                        local: 0,
                        len: 1,
                    }];
                }
                if extent.contains(&0) {
                    return vec![];
                }
                let strides = strides(shape);
                let row = extent[rank - 1];
                let rows: usize = extent[..rank - 1].iter().product();
                let mut out: Vec<Run> = Vec::new();
                let mut index = vec![0usize; rank - 1];
                for r in 0..rows {
                    let global = (0..rank)
                        .map(|d| (offsets[d] + index.get(d).copied().unwrap_or(0)) * strides[d])
                        .sum();
                    match out.last_mut() {
                        Some(last) if last.global + last.len == global => last.len += row,
                        _ => out.push(Run {
                            global,
                            local: r * row,
                            len: row,
                        }),
                    }
                    for d in (0..rank - 1).rev() {
                        index[d] += 1;
                        if index[d] < extent[d] {
                            break;
                        }
                        index[d] = 0;
                    }
                }
                out
            }
        }
    }
}

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// Product of `shape`, `None` on overflow.
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// Copies the overlap of two regions' runs: for every global element in both, `put(dst_local,
/// src_local, len)` for each maximal common stretch. Both run lists must be sorted.
pub fn overlap(dst: &[Run], src: &[Run], mut put: impl FnMut(usize, usize, usize)) {
    let (mut i, mut j) = (0, 0);
    while i < dst.len() && j < src.len() {
        let (a, b) = (dst[i], src[j]);
        let start = a.global.max(b.global);
        let end = (a.global + a.len).min(b.global + b.len);
        if start < end {
            put(
                a.local + (start - a.global),
                b.local + (start - b.global),
                end - start,
            );
        }
        if a.global + a.len <= b.global + b.len {
            i += 1;
        } else {
            j += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_become_runs_and_overlaps_copy_the_common_elements() {
        // A 4 x 6 matrix split by columns 2..5: four runs of three.
        let shape = [4, 6];
        let cols = Region::slice(&shape, 1, 2, 3);
        assert_eq!(cols.check(&shape), Ok(12));
        let runs = cols.runs(&shape);
        assert_eq!(runs.len(), 4);
        assert_eq!(
            runs[1],
            Run {
                global: 8,
                local: 3,
                len: 3
            }
        );
        // Rows 1..3: one merged run.
        let rows = Region::slice(&shape, 0, 1, 2);
        assert_eq!(
            rows.runs(&shape),
            vec![Run {
                global: 6,
                local: 0,
                len: 12
            }]
        );
        // Their overlap: rows 1..3, columns 2..5.
        let mut copied = vec![];
        overlap(&cols.runs(&shape), &rows.runs(&shape), |d, s, n| {
            copied.push((d, s, n))
        });
        assert_eq!(copied, vec![(3, 2, 3), (6, 8, 3)]);
        assert!(Region::slice(&shape, 1, 4, 3).check(&shape).is_err());
        assert!(
            Region::Flat {
                start: u64::MAX,
                len: 2
            }
            .check(&shape)
            .is_err()
        );
    }
}
