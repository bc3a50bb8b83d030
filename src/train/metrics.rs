//! What each rank measures in a step, and rank 0's step record made from every rank's.
//!
//! Ranks send their [`RankMetrics`] to rank 0 as one small all-gather of f64s; the order of the
//! fields on the wire lives in [`RankMetrics::to_wire`] and [`RankMetrics::from_wire`] only.

use super::report::{
    AXIS_BUCKETS, AxisComm, DeviceMemory, HostBufferCalls, MoeRecord, RankTimes, StepRecord,
};
use flashover_parallel::zero::MemoryReport;

/// One rank's measurements of one step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct RankMetrics {
    /// Mean loss of this rank's micro-batches.
    pub loss: f64,
    /// Wall time of the step.
    pub step_s: f64,
    /// Pipeline: the schedule's idle part (receive waits and hand-offs).
    pub bubble_s: f64,
    /// Time waiting at collectives' entry for other ranks.
    pub idle_s: f64,
    /// The global gradient norm this rank computed.
    pub grad_norm: f64,
    /// Training-state bytes held.
    pub memory: MemoryReport,
    /// Pipeline: most micro-batches held at once.
    pub in_flight: usize,
    /// Pipeline: wall time of the schedule.
    pub pipeline_s: f64,
    /// Mixture of experts: time in all-to-alls.
    pub a2a_s: f64,
    /// Context parallelism: attention time.
    pub attention_s: f64,
    /// Context parallelism: attention score elements computed.
    pub attention_scores: u64,
    /// Block forwards recomputed in backward.
    pub recomputed_blocks: u64,
    /// Device memory from the allocator, where the backend reports it.
    pub device_memory: Option<DeviceMemory>,
    /// Every collective by mesh axis.
    pub axes: [AxisComm; AXIS_BUCKETS],
    /// Byte-level collective calls on host buffers, by purpose.
    pub host_buffers: HostBufferCalls,
    /// Reads of tensor values to the host on this rank's thread, but collective staging.
    pub host_reads: u64,
}

impl RankMetrics {
    /// The fixed fields on the wire, before the axes'.
    const FIXED_LEN: usize = 21;
    /// f64s per axis bucket on the wire.
    const AXIS_LEN: usize = 5;
    /// Number of f64s on the wire.
    pub const WIRE_LEN: usize = Self::FIXED_LEN + Self::AXIS_LEN * AXIS_BUCKETS;

    /// The f64s sent to rank 0.
    pub fn to_wire(self) -> [f64; Self::WIRE_LEN] {
        let m = &self.memory;
        let (in_use, reserved) = self
            .device_memory
            .map_or((-1.0, -1.0), |d| (d.in_use as f64, d.reserved as f64));
        let fixed = [
            self.loss,
            self.step_s,
            self.bubble_s,
            self.idle_s,
            self.grad_norm,
            m.params as f64,
            m.grads as f64,
            m.optimizer as f64,
            m.gathered_peak as f64,
            self.in_flight as f64,
            self.pipeline_s,
            self.a2a_s,
            self.attention_s,
            self.attention_scores as f64,
            self.recomputed_blocks as f64,
            in_use,
            reserved,
            self.host_buffers.staged as f64,
            self.host_buffers.control as f64,
            self.host_buffers.outside_adapter as f64,
            self.host_reads as f64,
        ];
        let mut wire = [0.0; Self::WIRE_LEN];
        wire[..Self::FIXED_LEN].copy_from_slice(&fixed);
        for (a, slot) in self
            .axes
            .iter()
            .zip(wire[Self::FIXED_LEN..].chunks_exact_mut(Self::AXIS_LEN))
        {
            slot.copy_from_slice(&[
                a.calls as f64,
                a.bytes as f64,
                a.comm_s,
                a.overlapped_s,
                a.exposed_s,
            ]);
        }
        wire
    }

    /// The metrics [`RankMetrics::to_wire`] sent.
    pub fn from_wire(w: &[f64]) -> Self {
        RankMetrics {
            loss: w[0],
            step_s: w[1],
            bubble_s: w[2],
            idle_s: w[3],
            grad_norm: w[4],
            memory: MemoryReport {
                params: w[5] as usize,
                grads: w[6] as usize,
                optimizer: w[7] as usize,
                gathered_peak: w[8] as usize,
            },
            in_flight: w[9] as usize,
            pipeline_s: w[10],
            a2a_s: w[11],
            attention_s: w[12],
            attention_scores: w[13] as u64,
            recomputed_blocks: w[14] as u64,
            device_memory: (w[15] >= 0.0).then(|| DeviceMemory {
                in_use: w[15] as u64,
                reserved: w[16] as u64,
            }),
            host_buffers: HostBufferCalls {
                staged: w[17] as u64,
                control: w[18] as u64,
                outside_adapter: w[19] as u64,
            },
            host_reads: w[20] as u64,
            axes: std::array::from_fn(|i| {
                let a = &w[Self::FIXED_LEN + i * Self::AXIS_LEN..][..Self::AXIS_LEN];
                AxisComm {
                    calls: a[0] as u64,
                    bytes: a[1] as u64,
                    comm_s: a[2],
                    overlapped_s: a[3],
                    exposed_s: a[4],
                }
            }),
        }
    }

    /// This rank's line of the step record.
    fn times(&self, rank: usize) -> RankTimes {
        // The per-axis figures summed: the summary's two tables then say the same thing.
        let sum = |f: fn(&AxisComm) -> f64| self.axes.iter().map(f).sum::<f64>();
        let exposed = sum(|a| a.exposed_s);
        RankTimes {
            rank,
            step_s: self.step_s,
            compute_s: (self.step_s - exposed).max(0.0),
            comm_s: sum(|a| a.comm_s),
            overlapped_s: sum(|a| a.overlapped_s),
            exposed_comm_s: exposed,
            bubble_s: self.bubble_s,
            idle_s: self.idle_s,
            memory: self.memory,
            in_flight: self.in_flight,
            pipeline_s: self.pipeline_s,
            attention_s: self.attention_s,
            attention_scores: self.attention_scores,
            device_memory: self.device_memory,
            axes: self.axes,
            host_buffers: self.host_buffers,
            host_reads: self.host_reads,
        }
    }
}

/// What a step's record takes besides the ranks' metrics.
pub(crate) struct StepFacts {
    pub step: usize,
    pub lr: f64,
    pub tokens_per_step: f64,
    pub moe: Option<MoeRecord>,
    pub loss_scale: Option<f32>,
    pub skipped: bool,
}

/// The step record from every rank's metrics (in rank order): the loss is the ranks' mean, the
/// step as long as the slowest rank's, the norm rank 0's (every rank computes the same).
pub(crate) fn step_record(facts: StepFacts, ranks: &[RankMetrics]) -> StepRecord {
    let step_time = ranks.iter().map(|r| r.step_s).fold(0.0, f64::max);
    StepRecord {
        step: facts.step,
        loss: ranks.iter().map(|r| r.loss).sum::<f64>() / ranks.len() as f64,
        lr: facts.lr,
        grad_norm: ranks[0].grad_norm,
        recomputed_blocks: ranks.iter().map(|r| r.recomputed_blocks).max().unwrap_or(0),
        tokens_per_s: facts.tokens_per_step / step_time,
        step_time_s: step_time,
        ranks: ranks.iter().enumerate().map(|(i, r)| r.times(i)).collect(),
        moe: facts.moe.map(|m| MoeRecord {
            a2a_s: ranks.iter().map(|r| r.a2a_s).fold(0.0, f64::max),
            ..m
        }),
        loss_scale: facts.loss_scale,
        skipped: facts.skipped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_survive_the_wire_field_by_field() {
        let m = RankMetrics {
            loss: 1.5,
            step_s: 2.0,
            bubble_s: 0.125,
            idle_s: 0.0625,
            grad_norm: 3.0,
            memory: MemoryReport {
                params: 10,
                grads: 20,
                optimizer: 30,
                gathered_peak: 40,
            },
            in_flight: 3,
            pipeline_s: 1.25,
            a2a_s: 0.75,
            attention_s: 0.375,
            attention_scores: 99,
            recomputed_blocks: 4,
            device_memory: Some(DeviceMemory {
                in_use: 7,
                reserved: 8,
            }),
            axes: std::array::from_fn(|i| AxisComm {
                calls: i as u64 + 1,
                bytes: 100 * i as u64,
                comm_s: 0.5 * i as f64,
                overlapped_s: 0.25 * i as f64,
                exposed_s: 0.125 * i as f64,
            }),
            host_buffers: HostBufferCalls {
                staged: 5,
                control: 6,
                outside_adapter: 7,
            },
            host_reads: 9,
        };
        assert_eq!(RankMetrics::from_wire(&m.to_wire()), m);
        // The per-rank line is the per-axis figures summed: the summary's tables agree.
        let t = m.times(0);
        let n = AXIS_BUCKETS as f64;
        let triangle = n * (n - 1.0) / 2.0;
        assert_eq!(t.comm_s, 0.5 * triangle);
        assert_eq!(t.overlapped_s, 0.25 * triangle);
        assert_eq!(t.exposed_comm_s, 0.125 * triangle);
        assert_eq!(t.compute_s, (m.step_s - t.exposed_comm_s).max(0.0));
        assert_eq!(t.bubble_s, 0.125);
        let none = RankMetrics::default();
        assert_eq!(RankMetrics::from_wire(&none.to_wire()), none);
    }
}
