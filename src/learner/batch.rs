//! Each data-parallel rank's share of a data loader's batches, cut before they are batched.

use burn::data::dataloader::batcher::Batcher;
use burn::tensor::Device;
use flashover_parallel::parallelize::Parallelized;
use std::cell::Cell;

thread_local! {
    /// Batches a [`ShareBatcher`] made on this thread.
    static BATCHED_HERE: Cell<u64> = const { Cell::new(0) };
}

/// How many batches a [`ShareBatcher`] has made on this thread: a data loader without worker
/// threads batches inside its iterator's `next`, on the rank's own thread.
pub(super) fn batched_here() -> u64 {
    BATCHED_HERE.with(Cell::get)
}

/// Your `Batcher`, batching only this data-parallel rank's share of each batch's items: of a
/// batch of `n` items, the `n / ranks` consecutive ones at `rank * n / ranks` (`dp` x `fsdp` x
/// `ep` ranks; `tp` peers batch the same share). Every rank builds its data loaders the same way
/// (same data set, batch size and shuffle seed), so each sees the same global batches and
/// batches its own part of them: what one device's batch would be, cut in equal shares.
///
/// ```text
/// let loader = DataLoaderBuilder::new(ShareBatcher::new(MyBatcher, &par))   // was MyBatcher
///     .batch_size(32)
///     .shuffle(seed)
///     .build(dataset);
/// ```
///
/// Panics, naming the sizes, when a batch's items do not split evenly (the last batch of an
/// epoch too: use a data set whose size is a multiple of the batch size).
///
/// Build the loaders without `num_workers`: worker threads deliver batches in the order they
/// finish them, which differs between ranks, so ranks would take their shares of different
/// batches. The strategy refuses batches not made on the rank's own thread.
#[derive(Clone, Debug)]
pub struct ShareBatcher<B> {
    inner: B,
    rank: usize,
    ranks: usize,
}

impl<B> ShareBatcher<B> {
    /// `inner` batching this rank's share, for the ranks `par` reads different samples on.
    pub fn new(inner: B, par: &Parallelized) -> Self {
        let data = par.data().ranks();
        ShareBatcher {
            inner,
            rank: data.rank(),
            ranks: data.size(),
        }
    }
}

impl<I, O, B: Batcher<I, O>> Batcher<I, O> for ShareBatcher<B> {
    fn batch(&self, items: Vec<I>, device: &Device) -> O {
        let (n, ranks) = (items.len(), self.ranks);
        assert!(
            n.is_multiple_of(ranks),
            "a batch of {n} samples does not split over {ranks} data-parallel ranks (dp x fsdp \
             x ep): use a batch size that is a multiple of {ranks}, for the last batch of an \
             epoch too (a data set whose size is a multiple of it)"
        );
        BATCHED_HERE.with(|c| c.set(c.get() + 1));
        let per = n / ranks;
        let share = items.into_iter().skip(self.rank * per).take(per).collect();
        self.inner.batch(share, device)
    }
}
