//! Which samples each data-parallel rank and micro-batch reads at each step.

use std::ops::Range;

/// Why a batch layout is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SamplerError {
    /// The global batch does not split evenly.
    #[error(
        "global batch {global_batch} does not split into {data_parallel} data-parallel ranks x {micro_batches} micro-batches: choose a batch that is a multiple of {}",
        data_parallel * micro_batches
    )]
    Indivisible {
        /// Global batch size (samples per step).
        global_batch: usize,
        /// Number of data-parallel ranks.
        data_parallel: usize,
        /// Micro-batches per step.
        micro_batches: usize,
    },
}

/// The global batch of step `s` is samples `s*B .. (s+1)*B`. Data-parallel rank `r` of `R`
/// reads the `r`-th contiguous slice, split further into `M` micro-batches. Concatenating every
/// rank's micro-batches in order gives the global batch, whatever `R` and `M` are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPlan {
    global_batch: usize,
    data_parallel: usize,
    rank: usize,
    micro_batches: usize,
}

impl BatchPlan {
    /// A plan for data-parallel `rank` of `data_parallel`.
    pub fn new(
        global_batch: usize,
        data_parallel: usize,
        rank: usize,
        micro_batches: usize,
    ) -> Result<Self, SamplerError> {
        if global_batch == 0
            || micro_batches == 0
            || !global_batch.is_multiple_of(data_parallel * micro_batches)
        {
            return Err(SamplerError::Indivisible {
                global_batch,
                data_parallel,
                micro_batches,
            });
        }
        assert!(
            rank < data_parallel,
            "rank {rank} outside {data_parallel} data-parallel ranks"
        );
        Ok(BatchPlan {
            global_batch,
            data_parallel,
            rank,
            micro_batches,
        })
    }

    /// Samples per micro-batch on one rank.
    pub fn micro_batch_size(&self) -> usize {
        self.global_batch / self.data_parallel / self.micro_batches
    }

    /// Micro-batches per step.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// Global sample indices of micro-batch `micro` of `step` on this rank.
    pub fn indices(&self, step: u64, micro: usize) -> Range<u64> {
        let mb = self.micro_batch_size() as u64;
        let start =
            step * self.global_batch as u64 + (self.rank * self.micro_batches + micro) as u64 * mb;
        start..start + mb
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_reads_the_same_global_batch() {
        for (dp, m) in [(1, 1), (2, 1), (4, 2), (3, 4)] {
            let mut seen = vec![];
            for r in 0..dp {
                let plan = BatchPlan::new(24, dp, r, m).unwrap();
                for micro in 0..m {
                    seen.extend(plan.indices(5, micro));
                }
            }
            assert_eq!(seen, (120..144).collect::<Vec<u64>>(), "dp={dp} m={m}");
        }
    }

    #[test]
    fn an_indivisible_batch_is_refused_with_the_fix() {
        let e = BatchPlan::new(10, 4, 0, 1).unwrap_err().to_string();
        assert!(e.contains("multiple of 4"), "{e}");
    }
}
