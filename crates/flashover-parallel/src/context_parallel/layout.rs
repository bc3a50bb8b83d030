//! Which sequence positions each context-parallel rank holds.

use crate::ParallelError;
use std::ops::Range;

/// How the positions `0..seq_len` of every sequence are spread over `ranks` ranks.
///
/// Contiguous: rank `r` holds chunk `r` of `ranks` equal chunks. Under a causal mask that gives
/// the last rank `ranks` times the attention work of the first. Load-balanced: the sequence is
/// cut into `2 x ranks` chunks and rank `r` holds chunks `r` and `2 x ranks - 1 - r` (an early
/// and a late one), so every rank's queries see the same number of keys in total.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceLayout {
    /// Positions per sequence.
    pub seq_len: usize,
    /// Context-parallel ranks.
    pub ranks: usize,
    /// Head-and-tail chunks (`true`) or one contiguous chunk per rank.
    pub load_balanced: bool,
}

impl SequenceLayout {
    /// Checks that the sequence cuts into equal chunks; the error says what to change.
    pub fn new(seq_len: usize, ranks: usize, load_balanced: bool) -> Result<Self, ParallelError> {
        let layout = SequenceLayout {
            seq_len,
            ranks,
            load_balanced,
        };
        let chunks = layout.num_chunks();
        if ranks == 0 || seq_len == 0 || !seq_len.is_multiple_of(chunks) {
            let how = if load_balanced {
                format!("2 x cp = {chunks} chunks (load balancing)")
            } else {
                format!("cp = {chunks} chunks")
            };
            return Err(ParallelError::Invalid(format!(
                "sequence length {seq_len} does not cut into {how} of equal length: use a sequence length that is a multiple of {chunks}"
            )));
        }
        Ok(layout)
    }

    fn num_chunks(&self) -> usize {
        if self.load_balanced {
            2 * self.ranks
        } else {
            self.ranks
        }
    }

    /// Positions per chunk.
    pub fn chunk_len(&self) -> usize {
        self.seq_len / self.num_chunks()
    }

    /// Positions each rank holds.
    pub fn local_len(&self) -> usize {
        self.seq_len / self.ranks
    }

    /// The chunks `rank` holds, in local order.
    pub fn chunks(&self, rank: usize) -> Vec<Range<usize>> {
        let c = self.chunk_len();
        let chunk = |i: usize| i * c..(i + 1) * c;
        if self.load_balanced {
            vec![chunk(rank), chunk(2 * self.ranks - 1 - rank)]
        } else {
            vec![chunk(rank)]
        }
    }

    /// The global positions `rank` holds, in local order.
    pub fn positions(&self, rank: usize) -> Vec<usize> {
        self.chunks(rank).into_iter().flatten().collect()
    }

    /// Query-key pairs a rank's attention must compute under the causal mask, counted by
    /// chunk pairs as the blocks are computed (a diagonal chunk pair counts whole): the work
    /// [`SequenceLayout::load_balanced`] evens out.
    pub fn causal_pairs(&self, rank: usize) -> usize {
        let mine = self.chunks(rank);
        (0..self.ranks)
            .flat_map(|src| self.chunks(src))
            .map(|k| {
                mine.iter()
                    .filter(|q| Visibility::of(q, &k) != Visibility::Hidden)
                    .count()
                    * self.chunk_len()
                    * self.chunk_len()
            })
            .sum()
    }
}

/// What a chunk of queries sees of a chunk of keys under the causal mask (chunks of equal
/// length on a common grid: equal, wholly before or wholly after each other).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visibility {
    /// Every key precedes every query.
    All,
    /// The same positions: each query sees the keys up to itself.
    Diagonal,
    /// Every key follows every query: nothing to compute.
    Hidden,
}

impl Visibility {
    /// How queries at `q` see keys at `k`.
    pub fn of(q: &Range<usize>, k: &Range<usize>) -> Self {
        if k.end <= q.start {
            Visibility::All
        } else if k.start >= q.end {
            Visibility::Hidden
        } else {
            debug_assert_eq!(q, k, "chunks must lie on one grid");
            Visibility::Diagonal
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_position_is_held_once() {
        for (t, n, balanced) in [(12, 3, true), (12, 4, false), (8, 2, true), (5, 1, false)] {
            let layout = SequenceLayout::new(t, n, balanced).unwrap();
            let mut all: Vec<usize> = (0..n).flat_map(|r| layout.positions(r)).collect();
            assert!((0..n).all(|r| layout.positions(r).len() == layout.local_len()));
            all.sort();
            assert_eq!(all, (0..t).collect::<Vec<_>>());
        }
        assert_eq!(
            SequenceLayout::new(8, 2, true).unwrap().positions(0),
            vec![0, 1, 6, 7]
        );
    }

    #[test]
    fn lengths_that_do_not_cut_evenly_are_refused_with_the_multiple_to_use() {
        let e = SequenceLayout::new(10, 3, true).unwrap_err().to_string();
        assert!(e.contains("multiple of 6"), "{e}");
        let e = SequenceLayout::new(10, 4, false).unwrap_err().to_string();
        assert!(e.contains("multiple of 4"), "{e}");
    }

    #[test]
    fn load_balancing_evens_the_causal_work() {
        let plain = SequenceLayout::new(64, 4, false).unwrap();
        let balanced = SequenceLayout::new(64, 4, true).unwrap();
        let work = |l: &SequenceLayout| (0..4).map(|r| l.causal_pairs(r)).collect::<Vec<_>>();
        // Contiguous: rank r computes r full blocks and its diagonal.
        assert_eq!(work(&plain), vec![256, 512, 768, 1024]);
        // Balanced: every rank computes the same.
        assert!(work(&balanced).iter().all(|&w| w == work(&balanced)[0]));
        // Both compute the chunk pairs on or below the diagonal: 10 of 16-position chunks,
        // 36 of 8-position chunks.
        let total = |w: Vec<usize>| w.iter().sum::<usize>();
        assert_eq!(total(work(&plain)), 10 * 16 * 16);
        assert_eq!(total(work(&balanced)), 36 * 8 * 8);
    }
}
