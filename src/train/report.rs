//! What a training run measured: per-step records (the JSONL log) and the final summary.

use flashover_parallel::zero::MemoryReport;
use flashover_runtime::transfers::{Cause, Transfers};
use flashover_runtime::{Axis, GroupTraffic, HostBuffers};
use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};
use std::fmt;

/// Bytes in a MiB, for the summary.
const MIB: f64 = (1 << 20) as f64;

/// Buckets of [`RankTimes::axes`]: one per mesh axis, in [`Axis::ALL`] order, then the world
/// group, then the groups over several axes of more than one rank (HSDP's `dp+fsdp`, data
/// parallelism over `dp+cp`).
pub const AXIS_BUCKETS: usize = Axis::ALL.len() + 2;

/// The name of bucket `i` of [`RankTimes::axes`].
pub fn axis_bucket_name(i: usize) -> &'static str {
    match Axis::ALL.get(i) {
        Some(axis) => axis.name(),
        None if i == Axis::ALL.len() => "world",
        None => "several",
    }
}

/// The bucket of a traffic label ([`flashover_runtime::RankContext::traffic_by_axis`]).
fn axis_bucket(label: &str) -> usize {
    match Axis::ALL.iter().position(|a| a.name() == label) {
        Some(axis) => axis,
        None if label == "world" => Axis::ALL.len(),
        None => Axis::ALL.len() + 1,
    }
}

/// One bucket's collectives in one step on one rank.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct AxisComm {
    /// Calls.
    pub calls: u64,
    /// Bytes of this rank's largest buffer, summed over calls.
    pub bytes: u64,
    /// Wall time inside the collectives, on any thread.
    pub comm_s: f64,
    /// Of that, on communication threads while nothing waited for it.
    pub overlapped_s: f64,
    /// Time the computing thread spent in them or waiting for them.
    pub exposed_s: f64,
}

impl AxisComm {
    fn add(&mut self, other: &AxisComm) {
        self.calls += other.calls;
        self.bytes += other.bytes;
        self.comm_s += other.comm_s;
        self.overlapped_s += other.overlapped_s;
        self.exposed_s += other.exposed_s;
    }
}

/// The calls on host buffers between two snapshots of a rank's tally.
pub(crate) fn host_buffer_calls(now: &HostBuffers, before: &HostBuffers) -> HostBufferCalls {
    HostBufferCalls {
        staged: now.staged.calls - before.staged.calls,
        control: now.control.calls - before.control.calls,
        outside_adapter: now.unmarked.calls - before.unmarked.calls,
    }
}

/// Each bucket's traffic between two snapshots of a rank's groups (`before` may lack groups
/// made during the step).
pub(crate) fn axis_comm(now: &[GroupTraffic], before: &[GroupTraffic]) -> [AxisComm; AXIS_BUCKETS] {
    let mut axes = [AxisComm::default(); AXIS_BUCKETS];
    for group in now {
        let step = match before.iter().find(|b| b.label == group.label) {
            Some(b) => group.since(b),
            None => group.clone(),
        };
        axes[axis_bucket(&group.label)].add(&AxisComm {
            calls: step.calls,
            bytes: step.bytes,
            comm_s: step.time.as_secs_f64(),
            overlapped_s: step.overlapped().as_secs_f64(),
            exposed_s: step.exposed().as_secs_f64(),
        });
    }
    axes
}

/// The buckets with calls, as a map from bucket name.
fn serialize_axes<S: Serializer>(
    axes: &[AxisComm; AXIS_BUCKETS],
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let used = axes.iter().filter(|a| a.calls > 0).count();
    let mut map = serializer.serialize_map(Some(used))?;
    for (i, a) in axes.iter().enumerate().filter(|(_, a)| a.calls > 0) {
        map.serialize_entry(axis_bucket_name(i), a)?;
    }
    map.end()
}

/// Where one rank's time went in one step.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct RankTimes {
    /// Global rank.
    pub rank: usize,
    /// Wall time of the step on this rank.
    pub step_s: f64,
    /// Time the training thread computed: the step minus `exposed_comm_s`.
    pub compute_s: f64,
    /// Time inside every collective of the step, on any thread (the sum of `axes`).
    pub comm_s: f64,
    /// Part of `comm_s` on communication threads while nothing waited for it: hidden behind
    /// compute (the sum of `axes`).
    pub overlapped_s: f64,
    /// Time the training thread spent in collectives or waiting for them (the sum of
    /// `axes`): the summary's per-axis table, summed over this rank's axes.
    pub exposed_comm_s: f64,
    /// Pipeline: the schedule's idle part (receive waits and hand-offs between its actions),
    /// part of which is `exposed_comm_s`; 0 without a pipeline.
    pub bubble_s: f64,
    /// Time this rank's collectives waited for slower peers to arrive (load imbalance),
    /// inside `comm_s`.
    pub idle_s: f64,
    /// Bytes this rank held for training state in the step: parameters, gradients (peak),
    /// optimizer state and gathered parameters (peak), as the strategy measured them.
    pub memory: MemoryReport,
    /// Pipeline: the most micro-batches whose activations this rank held at once (0 without
    /// a pipeline).
    pub in_flight: usize,
    /// Pipeline: wall time of the schedule (forwards, backwards and the waits between them,
    /// `bubble_s`). 0 without a pipeline.
    pub pipeline_s: f64,
    /// Context parallelism: time this rank spent computing attention blocks in forward (the
    /// causal work load balancing evens out); 0 without a cp axis.
    pub attention_s: f64,
    /// Context parallelism: attention scores this rank computed in forward; 0 without cp.
    pub attention_scores: u64,
    /// Bytes the rank's device allocator held for live tensors after the step, and bytes it
    /// had reserved, where the backend reports them (the CubeCL devices: wgpu, CUDA; `None`
    /// on Flex). Ranks sharing one device (threads on one GPU or adapter) report the same
    /// device-wide figure.
    pub device_memory: Option<DeviceMemory>,
    /// Every collective of the step by the mesh axis its group spans (see [`AXIS_BUCKETS`]):
    /// all of the rank's communication, which `comm_s`, `overlapped_s` and `exposed_comm_s`
    /// sum. In the log, a map from axis name over the axes with calls.
    #[serde(serialize_with = "serialize_axes")]
    pub axes: [AxisComm; AXIS_BUCKETS],
    /// The step's byte-level collective calls on host buffers, by purpose.
    pub host_buffers: HostBufferCalls,
    /// Reads of tensor values to the host this rank's thread made in the step, every cause
    /// but collective staging (which `host_buffers` gives): on a GPU each waits for the
    /// device's queue to drain. The run's summary gives them by cause.
    pub host_reads: u64,
}

/// One rank's byte-level collective calls on host buffers in a step, by purpose
/// (`flashover_comm::host_buffers`): every tensor should reach its engine through the tensor
/// adapter, so `outside_adapter` should be 0.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct HostBufferCalls {
    /// A tensor's bytes staged by the adapter for an engine that takes host memory.
    pub staged: u64,
    /// Control values: counts, flags, codes, scalar metrics.
    pub control: u64,
    /// Host buffers handed to an engine outside the adapter.
    pub outside_adapter: u64,
}

/// What a device's allocator holds, as Burn reports it (`Device::memory_pool_usage`).
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct DeviceMemory {
    /// Bytes of live allocations (padding excluded).
    pub in_use: u64,
    /// Bytes reserved from the device (live allocations plus pages kept for reuse).
    pub reserved: u64,
}

/// One optimizer step, as written to the JSONL log.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StepRecord {
    /// Step index (0-based).
    pub step: usize,
    /// Mean next-token loss over the global batch (nats).
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Activation checkpointing: block forwards run again in backward this step because the
    /// job's policy names them (the most on any rank; 0 without block-level recomputation).
    /// ZeRO-3's resharding after forward recomputes nothing: its units gather again in
    /// backward.
    pub recomputed_blocks: u64,
    /// Tokens per second over the whole job.
    pub tokens_per_s: f64,
    /// Wall time of the step (slowest rank).
    pub step_time_s: f64,
    /// Per-rank times.
    pub ranks: Vec<RankTimes>,
    /// Mixture of experts: routing over the global batch (absent for dense models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeRecord>,
    /// Loss scaling: the scale this step's losses were multiplied by (absent without).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f32>,
    /// Whether the optimizer step was skipped because a scaled gradient overflowed.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
}

/// One step's expert routing over the global batch and every micro-batch.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct MoeRecord {
    /// Per layer: assignments each expert processed (after dropping).
    pub tokens_per_expert: Vec<Vec<u64>>,
    /// Largest over layers of max / mean assignments per expert (1: perfectly balanced).
    pub imbalance: f64,
    /// Share of the routed assignments dropped for want of capacity.
    pub drop_rate: f64,
    /// Load-balancing loss, unweighted, mean over layers and micro-batches of the ranks.
    pub aux_loss: f64,
    /// Router z-loss, unweighted, mean over layers and micro-batches of the ranks.
    pub z_loss: f64,
    /// Bytes of token rows the all-to-alls moved between different ranks (forward and
    /// backward, all ranks).
    pub a2a_remote_bytes: u64,
    /// Time in all-to-alls (slowest rank), seconds: waiting for peers and moving rows.
    pub a2a_s: f64,
}

/// A finished run.
#[derive(Debug, Clone)]
pub struct TrainReport {
    /// Every step.
    pub steps: Vec<StepRecord>,
    /// Final parameters by name (rank 0's copy), in layout order.
    pub params: Vec<(String, Vec<f32>)>,
    /// The data's known loss floor, if any.
    pub loss_floor: Option<f64>,
    /// Parameters in the model.
    pub num_params: usize,
    /// The mesh, as written.
    pub mesh: String,
    /// Gradient buckets per step.
    pub buckets: usize,
    /// Whether gradient reduction overlapped backward.
    pub overlap: bool,
    /// When the gradient buckets were reduced: during backward, or after it and why.
    pub reduction: String,
    /// Every rank's measured memory in the last step.
    pub memory: Vec<MemoryReport>,
    /// ZeRO stage (0: DDP).
    pub zero: u8,
    /// Ranks that state is sharded over (ZeRO-1/2: data-parallel ranks; ZeRO-3: `fsdp`).
    pub shard_degree: usize,
    /// Parameters in routed experts (0 for dense models), split over `expert_degree` ranks.
    pub expert_params: usize,
    /// Ranks the routed experts are split over (`ep`).
    pub expert_degree: usize,
    /// Wall time of the whole run.
    pub wall_s: f64,
    /// Tokens processed.
    pub tokens: usize,
    /// Host transfers of the communication, gradient and optimizer paths over the run, by
    /// cause, summed over this process's ranks (`flashover_runtime::transfers`).
    pub host_transfers: Transfers,
}

/// Bytes per rank the usual formula gives for `params` fp32 parameters with AdamW, sharded
/// over `n` ranks at ZeRO `stage` (0: DDP 16 B/param; 1: 4 + 4 + 8/N; 2: 4 + 12/N; 3: 16/N),
/// not counting gathered units.
pub fn memory_formula(stage: u8, params: usize, n: usize) -> f64 {
    let (p, n) = (params as f64, n.max(1) as f64);
    match stage {
        0 => 16.0 * p,
        1 => 8.0 * p + 8.0 * p / n,
        2 => 4.0 * p + 12.0 * p / n,
        _ => 16.0 * p / n,
    }
}

impl TrainReport {
    /// Parameters one rank holds before ZeRO sharding: everything but the routed experts, and
    /// its share of those.
    pub fn params_per_rank(&self) -> usize {
        self.num_params - self.expert_params + self.expert_params / self.expert_degree.max(1)
    }

    /// Final loss: the mean of the last `min(10, steps)` steps.
    pub fn final_loss(&self) -> f64 {
        let tail = &self.steps[self.steps.len().saturating_sub(10)..];
        tail.iter().map(|s| s.loss).sum::<f64>() / tail.len().max(1) as f64
    }

    /// Per-rank totals over the run (steps after the first, which includes warm-up).
    pub fn rank_totals(&self) -> Vec<RankTimes> {
        let n = self.steps.first().map_or(0, |s| s.ranks.len());
        let mut totals: Vec<RankTimes> = (0..n)
            .map(|rank| RankTimes {
                rank,
                ..Default::default()
            })
            .collect();
        for s in self.steps.iter().skip(1) {
            for (t, r) in totals.iter_mut().zip(&s.ranks) {
                t.step_s += r.step_s;
                t.compute_s += r.compute_s;
                t.comm_s += r.comm_s;
                t.overlapped_s += r.overlapped_s;
                t.exposed_comm_s += r.exposed_comm_s;
                t.bubble_s += r.bubble_s;
                t.idle_s += r.idle_s;
                t.host_reads += r.host_reads;
                for (total, axis) in t.axes.iter_mut().zip(&r.axes) {
                    total.add(axis);
                }
            }
        }
        totals
    }
}

impl fmt::Display for TrainReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "summary: mesh {}, {} parameters, {} steps in {:.2} s",
            self.mesh,
            self.num_params,
            self.steps.len(),
            self.wall_s
        )?;
        match self.loss_floor {
            Some(floor) => writeln!(
                f,
                "  final loss {:.4} nats (mean of last 10 steps); known floor {:.4}; gap {:.4}",
                self.final_loss(),
                floor,
                self.final_loss() - floor
            )?,
            None => writeln!(
                f,
                "  final loss {:.4} nats (mean of last 10 steps)",
                self.final_loss()
            )?,
        }
        writeln!(
            f,
            "  throughput {:.0} tokens/s ({} tokens)",
            self.tokens as f64 / self.wall_s,
            self.tokens
        )?;
        if self.zero == 3 {
            writeln!(
                f,
                "  gradients reduce-scattered per unit inside backward (ZeRO-3); the rest in {} \
                 buckets, reduced {}",
                self.buckets, self.reduction
            )?;
        } else {
            writeln!(
                f,
                "  gradient buckets per step: {}; reduced {}",
                self.buckets, self.reduction
            )?;
        }
        let formula = memory_formula(self.zero, self.params_per_rank(), self.shard_degree);
        let experts = if self.expert_params > 0 {
            format!("; experts over {} ranks", self.expert_degree)
        } else {
            String::new()
        };
        writeln!(
            f,
            "  memory per rank (MiB, measured in the last step; ZeRO {} over {} ranks{experts}; formula {:.3}):",
            self.zero,
            self.shard_degree,
            formula / MIB
        )?;
        writeln!(
            f,
            "    rank  params   grads   optim  gathered   total  total-gathered/formula"
        )?;
        for (rank, m) in self.memory.iter().enumerate() {
            writeln!(
                f,
                "    {:>4} {:>7.3} {:>7.3} {:>7.3} {:>9.3} {:>7.3} {:>8.3}",
                rank,
                m.params as f64 / MIB,
                m.grads as f64 / MIB,
                m.optimizer as f64 / MIB,
                m.gathered_peak as f64 / MIB,
                m.total() as f64 / MIB,
                (m.total() - m.gathered_peak) as f64 / formula
            )?;
        }
        if let Some(last) = self.steps.last()
            && last.ranks.iter().any(|r| r.device_memory.is_some())
        {
            writeln!(
                f,
                "  device memory per rank after the last step (MiB, the device allocator's figures; ranks on one device share them):"
            )?;
            for r in &last.ranks {
                if let Some(m) = r.device_memory {
                    writeln!(
                        f,
                        "    {:>4} in use {:>9.3}  reserved {:>9.3}",
                        r.rank,
                        m.in_use as f64 / MIB,
                        m.reserved as f64 / MIB
                    )?;
                }
            }
        }
        let moe: Vec<&MoeRecord> = self.steps.iter().filter_map(|s| s.moe.as_ref()).collect();
        if !moe.is_empty() {
            let n = moe.len() as f64;
            writeln!(
                f,
                "  experts: mean drop rate {:.4}, mean imbalance (max/mean) {:.3}, all-to-all {:.1} MiB/step between ranks, {:.3} s/step",
                moe.iter().map(|m| m.drop_rate).sum::<f64>() / n,
                moe.iter().map(|m| m.imbalance).sum::<f64>() / n,
                moe.iter().map(|m| m.a2a_remote_bytes as f64).sum::<f64>() / n / MIB,
                moe.iter().map(|m| m.a2a_s).sum::<f64>() / n,
            )?;
        }
        let steps = self.steps.len().max(1) as f64;
        let calls = |of: fn(&HostBufferCalls) -> u64| {
            let all = self.steps.iter().flat_map(|s| &s.ranks);
            all.map(|r| of(&r.host_buffers)).sum::<u64>() as f64 / steps
        };
        writeln!(
            f,
            "  collective calls on host buffers per step (all ranks): {:.1} staged by the tensor adapter, {:.1} control values, {:.1} outside the adapter",
            calls(|c| c.staged),
            calls(|c| c.control),
            calls(|c| c.outside_adapter),
        )?;
        writeln!(
            f,
            "  host transfers per step (mean over the run, all ranks of this process; device->host / host->device, MiB):"
        )?;
        for cause in Cause::ALL {
            let c = self.host_transfers.of(cause);
            if c.to_host.count + c.to_device.count == 0 {
                continue;
            }
            writeln!(
                f,
                "    {:<38} {:>8.1} / {:>8.1}  ({:.3} / {:.3} MiB)",
                cause.name(),
                c.to_host.count as f64 / steps,
                c.to_device.count as f64 / steps,
                c.to_host.bytes as f64 / steps / MIB,
                c.to_device.bytes as f64 / steps / MIB,
            )?;
        }
        // Steps after the first, as the totals count them.
        let timed = self.steps.len().saturating_sub(1).max(1) as f64;
        let reads: Vec<String> = (self.rank_totals().iter())
            .map(|t| format!("{:.1}", t.host_reads as f64 / timed))
            .collect();
        writeln!(
            f,
            "  host reads per step on each rank's thread, steps 2..{} (every cause but collective staging): {}",
            self.steps.len(),
            reads.join(" / ")
        )?;
        writeln!(
            f,
            "  per rank, steps 2..{} (seconds; comm, overlapped and exposed: the per-axis table's, \
             summed over the rank's axes; bubble: a pipeline schedule's idle time):",
            self.steps.len()
        )?;
        writeln!(
            f,
            "    rank    step  compute  comm(all)  overlapped  exposed   idle  bubble"
        )?;
        for t in self.rank_totals() {
            writeln!(
                f,
                "    {:>4} {:>7.3} {:>8.3} {:>10.3} {:>11.3} {:>8.3} {:>6.3} {:>7.3}",
                t.rank,
                t.step_s,
                t.compute_s,
                t.comm_s,
                t.overlapped_s,
                t.exposed_comm_s,
                t.idle_s,
                t.bubble_s
            )?;
        }
        self.write_axes(f)
    }
}

impl TrainReport {
    /// Every collective by mesh axis, summed over ranks and steps 2..N.
    fn write_axes(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut totals = [AxisComm::default(); AXIS_BUCKETS];
        for t in self.rank_totals() {
            for (total, axis) in totals.iter_mut().zip(&t.axes) {
                total.add(axis);
            }
        }
        if totals.iter().all(|a| a.calls == 0) {
            return Ok(());
        }
        writeln!(
            f,
            "  collectives by mesh axis, steps 2..{}, all ranks (seconds; `several`: groups \
             over several axes, such as dp+fsdp):",
            self.steps.len()
        )?;
        writeln!(
            f,
            "    axis        calls        MiB      time  overlapped   exposed"
        )?;
        for (i, a) in totals.iter().enumerate().filter(|(_, a)| a.calls > 0) {
            writeln!(
                f,
                "    {:<8} {:>8} {:>10.1} {:>9.3} {:>11.3} {:>9.3}",
                axis_bucket_name(i),
                a.calls,
                a.bytes as f64 / MIB,
                a.comm_s,
                a.overlapped_s,
                a.exposed_s
            )?;
        }
        Ok(())
    }
}
