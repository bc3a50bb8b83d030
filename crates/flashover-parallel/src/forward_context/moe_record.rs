//! What a forward's mixture-of-experts layers leave behind: auxiliary losses for the training
//! loss, and routing statistics for balancing and reports.

use burn::tensor::Tensor;
use std::sync::{Arc, Mutex};

/// One step's routing statistics, summed over layers and micro-batches (per layer).
#[derive(Debug, Clone, Default)]
pub struct MoeStats {
    /// Per layer: assignments per expert before dropping.
    pub routed: Vec<Vec<u64>>,
    /// Per layer: assignments per expert kept.
    pub kept: Vec<Vec<u64>>,
    /// The sums of the load-balancing and router z-losses (unweighted) over layers and
    /// micro-batches, `[aux, z]` on the device (`None` while no layer recorded any): read
    /// with the step's other scalars, not per layer.
    pub losses: Option<Tensor<1>>,
    /// How many (layer, micro-batch) forwards the sums cover.
    pub forwards: u64,
}

impl MoeStats {
    /// Adds one forward's assignments per expert (before dropping, and kept) as layer
    /// `layer`'s.
    fn record(&mut self, layer: usize, routed: &[usize], kept: &[usize]) {
        let as_u64 = |counts: &[usize]| counts.iter().map(|&c| c as u64).collect::<Vec<_>>();
        self.add_counts(layer, &as_u64(routed), &as_u64(kept));
    }

    /// Adds `other`, the statistics of one layer's forwards recorded as layer 0, as layer
    /// `layer`.
    fn add_layer(&mut self, layer: usize, other: MoeStats) {
        let first = |per_layer: &[Vec<u64>]| per_layer.first().cloned().unwrap_or_default();
        self.add_counts(layer, &first(&other.routed), &first(&other.kept));
        self.add_losses(other.losses);
        self.forwards += other.forwards;
    }

    /// Adds `[aux, z]` losses to the sums, on the device.
    fn add_losses(&mut self, losses: Option<Tensor<1>>) {
        self.losses = match (self.losses.take(), losses) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
    }

    /// Adds per-expert counts to layer `layer`'s.
    fn add_counts(&mut self, layer: usize, routed: &[u64], kept: &[u64]) {
        if self.routed.len() <= layer {
            self.routed.resize(layer + 1, vec![]);
            self.kept.resize(layer + 1, vec![]);
        }
        for (sums, counts) in [
            (&mut self.routed[layer], routed),
            (&mut self.kept[layer], kept),
        ] {
            if sums.len() < counts.len() {
                sums.resize(counts.len(), 0);
            }
            sums.iter_mut().zip(counts).for_each(|(s, &c)| *s += c);
        }
    }
}

/// Where a forward's mixture-of-experts layers leave their weighted auxiliary losses and
/// routing statistics. Shared by a step's micro-batches. (Where the experts run is the
/// layer's own business: `crate::expert_parallel::MoeForward`.)
#[derive(Clone, Default)]
pub struct MoeHook {
    /// The auxiliary losses of the forwards since the last [`MoeHook::take_aux_loss`].
    aux: Arc<Mutex<Vec<Tensor<1>>>>,
    /// Routing statistics since the last [`MoeHook::take_stats`].
    stats: Arc<Mutex<MoeStats>>,
}

impl std::fmt::Debug for MoeHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MoeHook")
    }
}

impl PartialEq for MoeHook {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.aux, &other.aux)
    }
}

impl MoeHook {
    /// A hook with no losses or statistics yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one forward of a layer as layer `layer`: its assignments per expert (before
    /// dropping, and kept) and its unweighted load-balancing and z-losses (`[aux, z]`, on the
    /// device, untracked; `None` where both are off).
    pub(crate) fn record(
        &self,
        layer: usize,
        [routed, kept]: [&[usize]; 2],
        losses: Option<Tensor<1>>,
    ) {
        let mut stats = self.stats.lock().expect("moe stats");
        stats.record(layer, routed, kept);
        stats.add_losses(losses);
        stats.forwards += 1;
    }

    /// The weighted auxiliary losses added since the last call, summed (`None` if there were
    /// none): add it to the training loss before backward.
    pub fn take_aux_loss(&self) -> Option<Tensor<1>> {
        let terms = std::mem::take(&mut *self.aux.lock().expect("aux losses"));
        terms.into_iter().reduce(|a, b| a + b)
    }

    /// The statistics gathered since the last call.
    pub fn take_stats(&self) -> MoeStats {
        std::mem::take(&mut *self.stats.lock().expect("moe stats"))
    }

    /// Adds `stats`, what a layer's own hook recorded (as layer 0), as layer `layer`'s: for a
    /// layer that runs its experts through a hook of its own (spread over `ep` by a plan)
    /// inside a forward whose hook counts every layer.
    pub fn add_layer_stats(&self, layer: usize, stats: MoeStats) {
        self.stats
            .lock()
            .expect("moe stats")
            .add_layer(layer, stats);
    }

    /// Adds a weighted auxiliary loss, as an MoE layer's forward does.
    pub fn push_aux_loss(&self, aux: Tensor<1>) {
        self.aux.lock().expect("aux losses").push(aux);
    }

    /// The same statistics, with auxiliary losses collected apart (for a caller that routes
    /// them itself: a recomputed block returns them with its output).
    pub fn with_own_aux_losses(&self) -> Self {
        MoeHook {
            aux: Arc::default(),
            ..self.clone()
        }
    }

    /// A hook recording neither auxiliary losses nor statistics where this one does: a
    /// forward run a second time (recomputation in backward) must not count twice.
    pub fn replaying(&self) -> Self {
        MoeHook::default()
    }
}
