//! Which elements of a flat parameter buffer each rank of a sharding group owns.
//!
//! Two layouts exist. [`ShardLayout`] cuts one buffer into `size` equal contiguous shards (the
//! fully sharded units of ZeRO-3). [`ShardMap`] describes ownership as runs of the flat layout,
//! which lets ZeRO-1/2 own "chunk `r` of every gradient bucket": the reduce-scatter of a bucket
//! then hands each rank exactly the gradient of the parameters it steps, with no reshuffling.
//! Every rank owns the same number of elements; the tail of a bucket that does not divide by
//! the group size is padding, which never reaches a parameter.

use std::ops::Range;

/// How a flat buffer of `numel` elements is cut into `size` equal shards (the last ones padded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLayout {
    /// Real elements.
    pub numel: usize,
    /// Elements per shard: `ceil(numel / size)`.
    pub shard: usize,
    /// Number of shards (the group size).
    pub size: usize,
}

impl ShardLayout {
    /// Shards of `numel` elements over `size` ranks.
    pub fn new(numel: usize, size: usize) -> Self {
        ShardLayout {
            numel,
            shard: numel.div_ceil(size.max(1)),
            size: size.max(1),
        }
    }

    /// Padded length: `shard x size`.
    pub fn padded(&self) -> usize {
        self.shard * self.size
    }

    /// The padded range rank `r` owns.
    pub fn range(&self, r: usize) -> Range<usize> {
        r * self.shard..(r + 1) * self.shard
    }

    /// The real (unpadded) elements of rank `r`'s range.
    pub fn real_range(&self, r: usize) -> Range<usize> {
        let range = self.range(r);
        range.start.min(self.numel)..range.end.min(self.numel)
    }
}

/// A stretch of a rank's shard: `len` elements that are either flat elements starting at
/// `flat`, or padding (`flat == None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// First flat (layout-order) element, or `None` for padding.
    pub flat: Option<usize>,
    /// Elements in the run.
    pub len: usize,
}

/// Per rank of a group, the runs of the flat layout it owns, in shard order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardMap {
    numel: usize,
    shard_len: usize,
    runs: Vec<Vec<Run>>,
}

impl ShardMap {
    /// Rank `r` owns the contiguous `r`-th shard of the whole buffer.
    pub fn contiguous(numel: usize, size: usize) -> Self {
        let layout = ShardLayout::new(numel, size);
        let runs = (0..layout.size)
            .map(|r| {
                let real = layout.real_range(r);
                let mut runs = vec![];
                push_run(&mut runs, Some(real.start), real.len());
                push_run(&mut runs, None, layout.shard - real.len());
                runs
            })
            .collect();
        ShardMap {
            numel,
            shard_len: layout.shard,
            runs,
        }
    }

    /// Rank `r` owns chunk `r` of every bucket. A bucket lists `(flat offset, numel)` of its
    /// parameters in the order they are laid out in the bucket; each bucket of `len` elements is
    /// cut into `size` chunks of `ceil(len / size)`, padded at the end.
    pub fn bucketed(numel: usize, buckets: &[Vec<(usize, usize)>], size: usize) -> Self {
        let size = size.max(1);
        let mut runs = vec![vec![]; size];
        let mut shard_len = 0;
        for bucket in buckets {
            let len: usize = bucket.iter().map(|&(_, n)| n).sum();
            let chunk = len.div_ceil(size);
            shard_len += chunk;
            for (r, rank_runs) in runs.iter_mut().enumerate() {
                let want = r * chunk..(r + 1) * chunk;
                let mut covered = 0;
                let mut at = 0;
                for &(offset, n) in bucket {
                    let lo = want.start.max(at);
                    let hi = want.end.min(at + n);
                    if lo < hi {
                        push_run(rank_runs, Some(offset + lo - at), hi - lo);
                        covered += hi - lo;
                    }
                    at += n;
                }
                push_run(rank_runs, None, chunk - covered);
            }
        }
        ShardMap {
            numel,
            shard_len,
            runs,
        }
    }

    /// Elements each rank owns (padding included).
    pub fn shard_len(&self) -> usize {
        self.shard_len
    }

    /// Elements of the flat buffer.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.runs.len()
    }

    /// Rank `r`'s runs.
    pub fn runs(&self, r: usize) -> &[Run] {
        &self.runs[r]
    }

    /// Rank `r`'s elements of `flat` (layout order), padding as zero.
    pub fn take(&self, r: usize, flat: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.shard_len);
        for run in &self.runs[r] {
            match run.flat {
                Some(start) => out.extend_from_slice(&flat[start..start + run.len]),
                None => out.resize(out.len() + run.len, 0.0),
            }
        }
        out
    }

    /// Writes every rank's shard (concatenated in rank order, as an all-gather returns them)
    /// back into `flat`.
    pub fn put_all(&self, gathered: &[f32], flat: &mut [f32]) {
        assert_eq!(
            gathered.len(),
            self.shard_len * self.size(),
            "gathered shards"
        );
        for (r, shard) in gathered.chunks(self.shard_len.max(1)).enumerate() {
            let mut at = 0;
            for run in &self.runs[r] {
                if let Some(start) = run.flat {
                    flat[start..start + run.len].copy_from_slice(&shard[at..at + run.len]);
                }
                at += run.len;
            }
        }
    }
}

/// Appends a run, merging it into the previous one when they are adjacent.
fn push_run(runs: &mut Vec<Run>, flat: Option<usize>, len: usize) {
    if len == 0 {
        return;
    }
    if let Some(last) = runs.last_mut() {
        let adjacent = match (last.flat, flat) {
            (Some(a), Some(b)) => a + last.len == b,
            (None, None) => true,
            _ => false,
        };
        if adjacent {
            last.len += len;
            return;
        }
    }
    runs.push(Run { flat, len });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_buffer_with_padding_at_the_end() {
        let s = ShardLayout::new(10, 3);
        assert_eq!((s.shard, s.padded()), (4, 12));
        assert_eq!(s.range(2), 8..12);
        assert_eq!(s.real_range(2), 8..10);
        assert_eq!(ShardLayout::new(12, 4).padded(), 12);
        assert_eq!(ShardLayout::new(0, 4).shard, 0);
    }

    /// Every flat element is owned exactly once, and take/put_all round-trip.
    fn check_partition(map: &ShardMap) {
        let flat: Vec<f32> = (0..map.numel()).map(|i| i as f32 + 1.0).collect();
        let mut owners = vec![0; map.numel()];
        let mut gathered = vec![];
        for r in 0..map.size() {
            for run in map.runs(r) {
                if let Some(s) = run.flat {
                    owners[s..s + run.len].iter_mut().for_each(|o| *o += 1);
                }
            }
            let shard = map.take(r, &flat);
            assert_eq!(shard.len(), map.shard_len());
            gathered.extend(shard);
        }
        assert!(owners.iter().all(|&o| o == 1), "{owners:?}");
        let mut back = vec![0.0; map.numel()];
        map.put_all(&gathered, &mut back);
        assert_eq!(back, flat);
    }

    #[test]
    fn contiguous_and_bucketed_maps_partition_the_buffer() {
        check_partition(&ShardMap::contiguous(10, 3));
        check_partition(&ShardMap::contiguous(12, 4));
        // Buckets in reverse layout order, as DDP plans them: params at 0..10, 10..15, 15..35.
        let buckets = vec![vec![(15, 20)], vec![(10, 5), (0, 10)]];
        for size in 1..=4 {
            let map = ShardMap::bucketed(35, &buckets, size);
            assert_eq!(
                map.shard_len(),
                20usize.div_ceil(size) + 15usize.div_ceil(size)
            );
            check_partition(&map);
        }
        // Chunk 1 of the second bucket (positions 8..15 of [10..15, 0..10]) at world 2.
        let map = ShardMap::bucketed(35, &buckets, 2);
        assert_eq!(
            map.runs(1)[1..],
            [
                Run {
                    flat: Some(3),
                    len: 7
                },
                Run { flat: None, len: 1 }
            ]
        );
    }
}
