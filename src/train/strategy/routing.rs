//! A mixture-of-experts step's routing record: every layer's counts summed over the ranks that
//! route different tokens and over the pipeline stages, from which the routing biases move
//! and the step's [`MoeRecord`] is made. The counts are host values (routing is decided on the
//! host); the auxiliary losses stay on the device, summed there, and are read with the step's
//! loss and norm.

use crate::train::report::MoeRecord;
use burn::tensor::{Device, Tensor};
use flashover_models::moe::MoeStats;
use flashover_runtime::{CommunicatorExt, Group, RankError, ReduceOp, TensorCollectives, control};

/// A step's routing summed over the ranks that read different samples (and under pipelines
/// over the stages, which route disjoint layers).
pub(super) struct RoutingSums {
    /// Per layer (global index) and expert: assignments before dropping.
    pub routed: Vec<Vec<u64>>,
    /// Per layer and expert: assignments kept.
    kept: Vec<Vec<u64>>,
    /// Sums of the unweighted auxiliary losses `[aux, z]`, on the device, and of the forwards
    /// they cover.
    losses: Tensor<1>,
    forwards: f64,
    /// Token rows sent to other ep ranks.
    remote: f64,
}

impl RoutingSums {
    /// This rank's `stats` (layers by global index) and `remote` rows, as `[layers, experts]`
    /// counts, summed over each of `groups` in turn (collective; the losses on `device`).
    pub fn over(
        stats: MoeStats,
        remote: u64,
        [layers, experts]: [usize; 2],
        groups: &[&Group],
        device: &Device,
    ) -> Result<Self, RankError> {
        let padded = |per_layer: &[Vec<u64>]| -> Vec<f64> {
            (0..layers * experts)
                .map(|i| {
                    let counts = per_layer.get(i / experts.max(1));
                    counts
                        .and_then(|c| c.get(i % experts))
                        .map_or(0.0, |&c| c as f64)
                })
                .collect()
        };
        let mut sums = padded(&stats.routed);
        sums.extend(padded(&stats.kept));
        sums.extend([stats.forwards as f64, remote as f64]);
        // A stage whose layers recorded no losses (or none on): zeros, as every rank takes part.
        let mut losses = (stats.losses).unwrap_or_else(|| Tensor::zeros([2], device));
        for group in groups {
            control(|| group.all_reduce(&mut sums, ReduceOp::Sum))?;
            losses = group.all_reduce_tensor(losses, ReduceOp::Sum)?;
        }
        let per_layer = |part: usize| -> Vec<Vec<u64>> {
            sums[part * layers * experts..(part + 1) * layers * experts]
                .chunks(experts.max(1))
                .map(|c| c.iter().map(|&v| v as u64).collect())
                .collect()
        };
        let tail = &sums[2 * layers * experts..];
        Ok(RoutingSums {
            routed: per_layer(0),
            kept: per_layer(1),
            losses,
            forwards: tail[0],
            remote: tail[1],
        })
    }

    /// The step's record (`d_model`: the width of a token row), its auxiliary losses still on
    /// the device.
    pub fn record(self, d_model: usize) -> PendingMoeRecord {
        let total_routed: u64 = self.routed.iter().flatten().sum();
        let total_kept: u64 = self.kept.iter().flatten().sum();
        let imbalance = self
            .kept
            .iter()
            .map(|l| {
                let mean = l.iter().sum::<u64>() as f64 / l.len().max(1) as f64;
                l.iter().copied().max().unwrap_or(0) as f64 / mean.max(f64::MIN_POSITIVE)
            })
            .fold(0.0, f64::max);
        PendingMoeRecord {
            record: MoeRecord {
                tokens_per_expert: self.kept,
                imbalance,
                drop_rate: 1.0 - total_kept as f64 / (total_routed as f64).max(1.0),
                aux_loss: f64::NAN,
                z_loss: f64::NAN,
                a2a_remote_bytes: self.remote as u64 * d_model as u64 * 4,
                a2a_s: 0.0,
            },
            losses: self.losses,
            forwards: self.forwards,
        }
    }
}

/// A step's routing record whose auxiliary losses are still on the device (read with the
/// step's loss and norm).
pub(crate) struct PendingMoeRecord {
    /// The record, its `aux_loss` and `z_loss` unset.
    record: MoeRecord,
    /// The global batch's sums `[aux, z]`.
    losses: Tensor<1>,
    /// The forwards they cover.
    forwards: f64,
}

impl PendingMoeRecord {
    /// The sums to read, `[aux, z]`.
    pub fn losses(&self) -> Tensor<1> {
        self.losses.clone()
    }

    /// The record, given the sums read from [`Self::losses`]: their means over the forwards.
    pub fn finish(self, [aux, z]: [f32; 2]) -> MoeRecord {
        let per_forward = |sum: f32| sum as f64 / self.forwards.max(1.0);
        MoeRecord {
            aux_loss: per_forward(aux),
            z_loss: per_forward(z),
            ..self.record
        }
    }
}
