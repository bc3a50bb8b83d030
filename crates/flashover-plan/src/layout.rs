//! A candidate layout: the mesh and the options that change memory and time.

use crate::hardware::Hardware;
use crate::model::{ModelSpec, Workload};
use flashover_mesh::Axis;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Pipeline schedules the cost model knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PipelineSchedule {
    /// All forwards, then all backwards.
    Gpipe,
    /// One forward, one backward.
    OneFOneB,
    /// 1F1B over `chunks` model chunks per rank.
    Interleaved {
        /// Model chunks per rank.
        chunks: usize,
    },
    /// Zero-bubble H1: backward split into input and weight gradients.
    ZbH1,
}

/// What activations are recomputed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Recompute {
    /// Keep everything.
    None,
    /// Keep matrix products, recompute attention's memory-bound parts.
    Selective,
    /// Keep each block's input only.
    Full,
}

/// Bytes per parameter and per activation element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// BF16 weights and gradients, FP32 master weights and Adam moments (the ZeRO paper's
    /// 2 + 2 + 12 bytes per parameter), BF16 activations.
    Mixed,
    /// FP32 everything (4 + 4 + 8 bytes per parameter): what Flashover trains today.
    Fp32,
}

impl Precision {
    /// Bytes per parameter of weights, gradients and optimizer state.
    pub fn state_bytes(self) -> (f64, f64, f64) {
        match self {
            Precision::Mixed => (2.0, 2.0, 12.0),
            Precision::Fp32 => (4.0, 4.0, 8.0),
        }
    }

    /// Bytes per activation element.
    pub fn activation_bytes(self) -> f64 {
        match self {
            Precision::Mixed => 2.0,
            Precision::Fp32 => 4.0,
        }
    }
}

/// One layout: degrees of every mesh axis and the options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    /// Pipeline stages.
    pub pp: usize,
    /// Replicas (DDP, ZeRO-1/2 shard over them; with ZeRO-3, replicas of the shard groups).
    pub dp: usize,
    /// ZeRO-3 shard group.
    pub fsdp: usize,
    /// Expert parallel.
    pub ep: usize,
    /// Context parallel.
    pub cp: usize,
    /// Tensor parallel.
    pub tp: usize,
    /// ZeRO stage (0: DDP).
    pub zero: u8,
    /// Sequence parallelism with tp.
    pub sequence_parallel: bool,
    /// Pipeline schedule (with pp > 1).
    pub schedule: PipelineSchedule,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// Sequences per micro-batch on one rank (the rank's share of the global batch is cut into
    /// micro-batches of this size, accumulated before the optimizer steps).
    pub micro_batch: usize,
    /// With a pipeline: blocks per virtual stage, when a job fixes them (`parallel.pp_blocks`
    /// or `pp_split = "even"`); `None` cuts them to balance compute, as `pp_split = "cost"`
    /// does (what the search assumes).
    pub stage_blocks: Option<Vec<usize>>,
}

impl Layout {
    /// One rank: every degree 1, DDP, no sequence parallelism, 1F1B, no recomputation.
    pub fn single() -> Self {
        Layout {
            pp: 1,
            dp: 1,
            fsdp: 1,
            ep: 1,
            cp: 1,
            tp: 1,
            zero: 0,
            sequence_parallel: false,
            schedule: PipelineSchedule::OneFOneB,
            recompute: Recompute::None,
            micro_batch: 1,
            stage_blocks: None,
        }
    }

    /// Degrees in mesh order (outermost first), as [`Axis::ALL`].
    pub fn degrees(&self) -> [(Axis, usize); 6] {
        [
            (Axis::Pp, self.pp),
            (Axis::Dp, self.dp),
            (Axis::Fsdp, self.fsdp),
            (Axis::Ep, self.ep),
            (Axis::Cp, self.cp),
            (Axis::Tp, self.tp),
        ]
    }

    /// Devices used.
    pub fn world(&self) -> usize {
        self.degrees().iter().map(|(_, d)| d).product()
    }

    /// The mesh as `flashover train --mesh` takes it (axes of degree 1 left out).
    pub fn mesh_spec(&self) -> String {
        let parts: Vec<String> = self
            .degrees()
            .iter()
            .filter(|(_, d)| *d > 1)
            .map(|(a, d)| format!("{a}={d}"))
            .collect();
        if parts.is_empty() {
            "dp=1".into()
        } else {
            parts.join(",")
        }
    }

    /// Ranks each sequence's batch is split over (the data-parallel ranks).
    pub fn batch_ranks(&self) -> usize {
        self.dp * self.fsdp * self.ep
    }

    /// Ranks a ZeRO-1/2 or ZeRO-3 stage shards state over (1 for DDP).
    pub fn shard_ranks(&self) -> usize {
        match self.zero {
            0 => 1,
            3 => self.fsdp,
            _ => self.dp * self.cp * self.ep,
        }
    }

    /// Model chunks per pipeline rank: the interleaved schedule's, otherwise 1.
    pub fn chunks(&self) -> usize {
        match self.schedule {
            PipelineSchedule::Interleaved { chunks } if self.pp > 1 => chunks,
            _ => 1,
        }
    }

    /// Micro-batches per step on one rank.
    pub fn micro_batches(&self, work: &Workload) -> usize {
        work.global_batch / self.batch_ranks() / self.micro_batch.max(1)
    }

    /// Number of parallel dimensions in use (axes of degree > 1).
    pub fn dimensions(&self) -> usize {
        self.degrees().iter().filter(|(_, d)| *d > 1).count()
    }

    /// Whether the group along `axes` stays inside one node: ranks are numbered with the
    /// innermost axis fastest (tp, then cp, ep, fsdp, dp, pp), so a group spans the product of
    /// its own and all inner axes' degrees.
    pub fn within_node(&self, axes: &[Axis], hw: &Hardware) -> bool {
        let outermost = Axis::ALL
            .iter()
            .position(|a| axes.contains(a))
            .unwrap_or(Axis::ALL.len());
        let span: usize = self.degrees()[outermost..].iter().map(|(_, d)| d).product();
        span <= hw.devices_per_node
    }

    /// Why this layout cannot run `model` on `world` devices of `hw` (empty when it can).
    pub fn problems(
        &self,
        model: &ModelSpec,
        work: &Workload,
        hw: &Hardware,
        world: usize,
    ) -> Vec<String> {
        let mut p = vec![];
        if self.world() != world {
            p.push(format!(
                "the mesh {} uses {} devices, not {world}",
                self.mesh_spec(),
                self.world()
            ));
        }
        let tp = self.tp;
        if tp > hw.devices_per_node || !hw.devices_per_node.is_multiple_of(tp) {
            p.push(format!(
                "tp = {tp} does not fit in a node of {} devices: tensor-parallel groups need the fastest links",
                hw.devices_per_node
            ));
        }
        for (what, n) in [
            ("model.heads", model.heads),
            ("model.kv_heads", model.kv_heads),
            ("model.ffn", model.ffn),
        ] {
            if !n.is_multiple_of(tp) {
                p.push(format!("tp = {tp} does not divide {what} = {n}"));
            }
        }
        let chunks = self.chunks();
        // Stages may hold different numbers of blocks (the training job cuts them to balance
        // their compute), but every virtual stage needs one.
        if model.layers < self.pp * chunks {
            p.push(format!(
                "pp = {} x {chunks} chunks needs at least as many blocks, model.layers = {}",
                self.pp, model.layers
            ));
        }
        if !work.seq_len.is_multiple_of(2 * self.cp) {
            p.push(format!(
                "cp = {} needs the sequence length {} to cut into 2 x cp chunks",
                self.cp, work.seq_len
            ));
        }
        if self.sequence_parallel && !(work.seq_len / self.cp).is_multiple_of(tp) {
            p.push(format!(
                "sequence parallelism needs tp = {tp} to divide the local sequence {}",
                work.seq_len / self.cp
            ));
        }
        if self.ep > 1 && (model.experts == 0 || !model.experts.is_multiple_of(self.ep)) {
            p.push(format!(
                "ep = {} needs model.experts ({}) to divide by it",
                self.ep, model.experts
            ));
        }
        let batch = self.batch_ranks() * self.micro_batch.max(1);
        if work.global_batch == 0 || !work.global_batch.is_multiple_of(batch) {
            p.push(format!(
                "global batch {} does not divide by the batch ranks dp x fsdp x ep ({}) x micro-batch size ({})",
                work.global_batch,
                self.batch_ranks(),
                self.micro_batch
            ));
        }
        let m = self.micro_batches(work);
        if let PipelineSchedule::Interleaved { .. } = self.schedule
            && self.pp > 1
            && !m.is_multiple_of(self.pp)
        {
            p.push(format!(
                "the interleaved schedule needs micro-batches ({m}) to be a multiple of pp = {}",
                self.pp
            ));
        }
        if self.zero == 3 && self.fsdp == 1 {
            p.push("ZeRO-3 shards over the fsdp axis: fsdp must be at least 2".into());
        }
        if self.zero != 3 && self.fsdp > 1 {
            p.push("an fsdp axis needs ZeRO-3".into());
        }
        p
    }

    /// Why Flashover's training job refuses this layout for `model` (empty when it trains):
    /// the reasons of [`crate::rules::refusals`].
    pub fn unsupported(&self, model: &ModelSpec) -> Vec<String> {
        crate::rules::refusals(self, model.experts > 0)
            .into_iter()
            .map(|r| r.reason.to_string())
            .collect()
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.mesh_spec())?;
        if self.zero > 0 {
            write!(f, " zero{}", self.zero)?;
        }
        if self.sequence_parallel {
            f.write_str(" sp")?;
        }
        if self.pp > 1 {
            match self.schedule {
                PipelineSchedule::Gpipe => f.write_str(" gpipe")?,
                PipelineSchedule::OneFOneB => f.write_str(" 1f1b")?,
                PipelineSchedule::Interleaved { chunks } => write!(f, " interleaved x{chunks}")?,
                PipelineSchedule::ZbH1 => f.write_str(" zb-h1")?,
            }
        }
        match self.recompute {
            Recompute::None => Ok(()),
            Recompute::Selective => f.write_str(" recompute=selective"),
            Recompute::Full => f.write_str(" recompute=full"),
        }
    }
}
