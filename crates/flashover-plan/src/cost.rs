//! The cost model: per-device memory and step time of a layout, from published formulas, each
//! assumption stated where it is made ([`ASSUMPTIONS`] collects them for the report).

use crate::hardware::Hardware;
use crate::layout::{Layout, PipelineSchedule, Precision, Recompute};
use crate::model::{ModelSpec, Workload};
use crate::stages::{balanced_stages, cut_imbalance, per_rank};
use flashover_mesh::Axis;
use serde::Serialize;

/// Every assumption the estimates rest on, for `flashover plan` to print.
pub const ASSUMPTIONS: &[&str] = &[
    "model state per parameter: mixed precision 2 (weights) + 2 (gradients) + 12 (fp32 master and Adam moments) bytes, fp32 4 + 4 + 8; ZeRO-1 shards the optimizer state, ZeRO-2 also gradients, ZeRO-3 everything (Rajbhandari et al. 2020)",
    "ZeRO-3 also holds two gathered blocks (the one computing and the one prefetched); under pipelines, the whole stage's parameters and gradient for the step; pipelines reduce-scatter gradients once per step, so under them ZeRO-2 holds the whole gradient as ZeRO-1 does",
    "activations per block and micro-batch: s b h (10 + 24/t) + 5 a s S b / t bytes at 16 bits, s b h 34/t + 5 a s S b / t with sequence parallelism (Korthikanti et al. 2022; a GPT block, s the local and S the whole sequence, scores materialised); selective recomputation (Burn's balanced checkpointing, which keeps matrix products' outputs) keeps the scores q k^T, 2 of the score term's 5 bytes, full recomputation keeps 2 s b h per block plus one block live again in backward; fp32 doubles them",
    "pipelines hold activations of min(m, pp - i) micro-batches on stage i (1F1B, ZB-H1), m with GPipe, x (1 + (pp-1)/(pp v)) interleaved; the last stage also holds fp32 logits and their gradient; stages hold the blocks the training job's cost split gives them (pp_split = \"cost\"; any number of blocks, at least one per virtual stage), memory is the busiest stage's",
    "micro-batch size: searched over powers of two dividing each rank's share of the global batch (unless fixed); a rank runs share / size micro-batches per step",
    "compute: 6 N_active + 12 L h S FLOPs per token (PaLM), split evenly over the devices, at the hardware's efficiency x peak; full recomputation adds a forward of the blocks (1/3), selective the attention scores' forward; ZeRO-3 recomputes at least selectively: the training job's units reshard after forward (parallel.reshard_after_forward, on by default) on a device with Burn's balanced checkpointing, which gathers them again in backward and recomputes the memory-bound ops as selective recomputation does, so a ZeRO-3 layout asking for none is costed and listed as recompute=selective",
    "pipeline bubble: (pp - 1)/m of the compute for GPipe and 1F1B, (pp - 1)/(v m) interleaved, a third of 1F1B's for ZB-H1",
    "pipeline stage imbalance: stages hold whole blocks (6 N_block + 12 h S FLOPs per token) and the last also the LM head (6 h V), cut to balance them as the training job cuts them; the busiest stage's excess over the mean is added to the compute",
    "collectives: latency x steps + bytes x (nccl-tests busbw factor) / busbw of the link (intra-node if the group's ranks fit in one node given the rank order pp, dp, fsdp, ep, cp, tp from outermost), ring algorithms",
    "tensor-parallel all-reduces (4 per block and micro-batch, 6 with full recomputation) and expert all-to-alls are exposed, except the two in backward where activations enter the column-parallel layers (attention's q, k, v; the MLP's gate and up): each all-reduce (with sequence parallelism, reduce-scatter: half of one) is hidden behind those layers' weight gradients when shorter (Megatron's asynchronous tensor parallelism, as Flashover runs it); ring attention's key/value passes hide behind the forward's attention compute, their gradients' passes in backward are exposed; gradient reduction (once per step) hides behind the last micro-batch's backward (2/3 of its compute); ZeRO-3, as the units overlap them: every block's all-gather in forward, its all-gather again in backward and its gradient's reduce-scatter run in turn on one communication stream, prefetched or (the reduce-scatters) waited for after the step's last backward, so they are exposed only where the stream's time per micro-batch exceeds the blocks' compute (a forward and a backward of twice a forward, and a rerun under full recomputation), plus the last reduce-scatter of the step; the parameters outside the blocks (embedding, head) are gathered and reduce-scattered once per micro-batch, exposed",
];

/// Per-device memory, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MemoryEstimate {
    /// Parameters held.
    pub params: f64,
    /// Gradients held.
    pub grads: f64,
    /// Optimizer state held.
    pub optimizer: f64,
    /// Gathered parameters (ZeRO-3).
    pub gathered: f64,
    /// Activations (the busiest stage).
    pub activations: f64,
}

impl MemoryEstimate {
    /// Everything.
    pub fn total(&self) -> f64 {
        self.params + self.grads + self.optimizer + self.gathered + self.activations
    }

    /// Parameters, gradients and optimizer state (what ZeRO's formulas count).
    pub fn model_state(&self) -> f64 {
        self.params + self.grads + self.optimizer
    }
}

/// Per-step time, seconds, by cause.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TimeEstimate {
    /// Model FLOPs at the hardware's efficiency.
    pub compute: f64,
    /// Recomputed forwards.
    pub recompute: f64,
    /// Pipeline bubble.
    pub bubble: f64,
    /// Pipeline stages holding whole blocks (and the last the LM head): the busiest stage's
    /// compute beyond the mean stage's.
    pub stage_imbalance: f64,
    /// Tensor-parallel collectives.
    pub tensor_parallel: f64,
    /// Context-parallel exchanges not hidden behind attention.
    pub context_parallel: f64,
    /// Pipeline sends and receives.
    pub pipeline_comm: f64,
    /// Gradient reduction and ZeRO gathers not hidden behind compute.
    pub data_parallel: f64,
    /// Expert all-to-alls.
    pub expert_parallel: f64,
}

impl TimeEstimate {
    /// The step.
    pub fn step(&self) -> f64 {
        self.compute
            + self.recompute
            + self.bubble
            + self.stage_imbalance
            + self.tensor_parallel
            + self.context_parallel
            + self.pipeline_comm
            + self.data_parallel
            + self.expert_parallel
    }

    /// `(name, seconds)` of everything besides compute, largest first.
    pub fn overheads(&self) -> Vec<(&'static str, f64)> {
        let mut v = vec![
            ("recomputation", self.recompute),
            ("pipeline bubble", self.bubble),
            ("pipeline stage imbalance", self.stage_imbalance),
            ("tensor-parallel communication", self.tensor_parallel),
            ("context-parallel communication", self.context_parallel),
            ("pipeline sends", self.pipeline_comm),
            ("exposed data-parallel communication", self.data_parallel),
            ("expert all-to-alls", self.expert_parallel),
        ];
        v.sort_by(|a, b| b.1.total_cmp(&a.1));
        v
    }
}

/// FLOPs per token of one block (`6 N_block + 12 h S`) and of the LM head (`6 h V`): what the
/// training job's cost split balances between stages.
fn block_and_head_flops(model: &ModelSpec, work: &Workload) -> (f64, f64) {
    let h = model.hidden as f64;
    (
        6.0 * model.active_block_params() + 12.0 * h * work.seq_len as f64,
        6.0 * h * model.vocab as f64,
    )
}

/// Blocks per virtual stage (`pp x chunks` of them; one without a pipeline): the layout's own
/// cut when it has one, otherwise cut as the training job's `pp_split = "cost"` cuts them.
fn virtual_stage_blocks(model: &ModelSpec, work: &Workload, layout: &Layout) -> Vec<usize> {
    if let Some(counts) = &layout.stage_blocks {
        return counts.clone();
    }
    type Key = (usize, usize, u64, u64);
    thread_local! {
        // The cut is a dynamic programme over stages x blocks^2, asked for thousands of
        // layouts that share a few (pp, chunks) pairs: remember it.
        static CUTS: std::cell::RefCell<std::collections::HashMap<Key, Vec<usize>>> =
            Default::default();
    }
    let (block, head) = block_and_head_flops(model, work);
    let stages = layout.pp.max(1) * layout.chunks();
    let key = (model.layers, stages, block.to_bits(), head.to_bits());
    CUTS.with(|cuts| {
        cuts.borrow_mut()
            .entry(key)
            .or_insert_with(|| {
                balanced_stages(model.layers, stages, block, head)
                    .map(|(counts, _)| counts)
                    // Fewer blocks than stages is refused by `Layout::problems`; spread what
                    // there is.
                    .unwrap_or_else(|| vec![model.layers.div_ceil(stages); stages])
            })
            .clone()
    })
}

/// Blocks each pipeline rank holds (one entry without a pipeline): the layout's own cut when
/// it has one, otherwise cut as the training job's `pp_split = "cost"` cuts them.
pub fn stage_blocks(model: &ModelSpec, work: &Workload, layout: &Layout) -> Vec<usize> {
    per_rank(&virtual_stage_blocks(model, work, layout), layout.pp.max(1))
}

/// Parameters on the busiest device: its stage's blocks (split over tp, experts over ep) and
/// the embedding or LM head its stage holds.
pub fn params_per_device(model: &ModelSpec, work: &Workload, layout: &Layout) -> f64 {
    let block = block_params_per_device(model, layout);
    let blocks = stage_blocks(model, work, layout);
    let last = blocks.len() - 1;
    blocks
        .iter()
        .enumerate()
        .map(|(rank, &n)| n as f64 * block + edge_params_per_device(model, layout, rank, last))
        .fold(0.0, f64::max)
}

/// One block's parameters on a device.
pub fn block_params_per_device(model: &ModelSpec, layout: &Layout) -> f64 {
    let (h, t) = (model.hidden as f64, layout.tp as f64);
    let ffn = if model.experts > 0 {
        // Experts are split over ep and, as in Flashover, whole on every tp rank.
        (model.experts / layout.ep.max(1)) as f64 * model.mlp_params() + h * model.experts as f64
    } else {
        model.mlp_params() / t
    };
    model.attention_params() / t + ffn + 2.0 * h
}

/// The embedding and LM head pipeline rank `rank` of `0..=last` holds (both on one rank
/// without a pipeline).
fn edge_params_per_device(model: &ModelSpec, layout: &Layout, rank: usize, last: usize) -> f64 {
    let table = (model.vocab * model.hidden) as f64 / layout.tp as f64;
    let norm = model.hidden as f64;
    if last == 0 {
        table * if model.tied_embeddings { 1.0 } else { 2.0 } + norm
    } else if rank == 0 {
        table
    } else if rank == last {
        // The head and final norm (a tied table is copied there).
        table + norm
    } else {
        0.0
    }
}

/// What the training job recomputes under `layout`: its own choice, and under ZeRO-3 at least
/// selectively (its units reshard after forward on a device with Burn's balanced
/// checkpointing, which also recomputes the memory-bound ops, as selective recomputation
/// does).
pub fn recomputed(layout: &Layout) -> Recompute {
    match (layout.zero, layout.recompute) {
        (3, Recompute::None) => Recompute::Selective,
        (_, recompute) => recompute,
    }
}

/// Per-device memory of `layout`.
pub fn memory(
    model: &ModelSpec,
    work: &Workload,
    layout: &Layout,
    precision: Precision,
) -> MemoryEstimate {
    let p = params_per_device(model, work, layout);
    let (w, g, _) = precision.state_bytes();
    // Pipeline stages reduce-scatter gradients once per step, after the last micro-batch: the
    // whole gradient is held until then, so ZeRO-2 holds what ZeRO-1 does.
    let zero = match (layout.zero, layout.pp) {
        (2, pp) if pp > 1 => 1,
        (zero, _) => zero,
    };
    let (params, grads, optimizer) = model_state(p, precision, zero, layout.shard_ranks());
    let gathered = match (layout.zero, layout.pp) {
        // Pipeline stages are gathered for the whole step, with their whole gradient.
        (3, pp) if pp > 1 => p * (w + g),
        (3, _) => 2.0 * block_params_per_device(model, layout) * w,
        _ => 0.0,
    };
    MemoryEstimate {
        params,
        grads,
        optimizer,
        gathered,
        activations: activation_bytes(model, work, layout, precision),
    }
}

/// Bytes of parameters, gradients and optimizer state per device for `params` parameters
/// under ZeRO stage `zero` over `n` ranks (ZeRO paper, section 5; stage 0 is DDP).
pub fn model_state(params: f64, precision: Precision, zero: u8, n: usize) -> (f64, f64, f64) {
    let (p, n) = (params, n.max(1) as f64);
    let (w, g, o) = precision.state_bytes();
    match zero {
        0 => (p * w, p * g, p * o),
        1 => (p * w, p * g, p * o / n),
        2 => (p * w, p * g / n, p * o / n),
        _ => (p * w / n, p * g / n, p * o / n),
    }
}

/// Activations of one block and one micro-batch, bytes, under `recompute`.
fn block_activations(
    model: &ModelSpec,
    work: &Workload,
    layout: &Layout,
    precision: Precision,
    recompute: Recompute,
) -> f64 {
    let (h, a, t) = (model.hidden as f64, model.heads as f64, layout.tp as f64);
    let s_all = work.seq_len as f64;
    let s = s_all / layout.cp as f64;
    let b = layout.micro_batch as f64;
    let scale = precision.activation_bytes() / 2.0;
    let sbh = s * b * h;
    let linear = if layout.sequence_parallel {
        sbh * 34.0 / t
    } else {
        sbh * (10.0 + 24.0 / t)
    };
    let scores = 5.0 * a * s * s_all * b / t;
    scale
        * match recompute {
            Recompute::None => linear + scores,
            // Burn's balanced checkpointing keeps the outputs of matrix products, the scores
            // `q k^T` among them (2 of the 5 bytes); softmax and dropout are recomputed.
            Recompute::Selective => linear + scores * 2.0 / 5.0,
            Recompute::Full => 2.0 * sbh / if layout.sequence_parallel { t } else { 1.0 },
        }
}

/// Micro-batches whose activations pipeline rank `stage` holds at once (the first stage holds
/// the most).
pub fn in_flight(layout: &Layout, micro_batches: usize, stage: usize) -> f64 {
    let (pp, m) = (layout.pp, micro_batches.max(1));
    if pp == 1 {
        return 1.0;
    }
    // 1F1B's warm-up: stage i runs pp - i forwards before its first backward.
    let warm_up = m.min(pp - stage.min(pp - 1)) as f64;
    match layout.schedule {
        PipelineSchedule::Gpipe => m as f64,
        PipelineSchedule::OneFOneB | PipelineSchedule::ZbH1 => warm_up,
        PipelineSchedule::Interleaved { chunks } => {
            warm_up * (1.0 + (pp as f64 - 1.0) / (pp * chunks) as f64)
        }
    }
}

fn activation_bytes(
    model: &ModelSpec,
    work: &Workload,
    layout: &Layout,
    precision: Precision,
) -> f64 {
    let per_block = block_activations(model, work, layout, precision, recomputed(layout));
    let m = layout.micro_batches(work);
    // Full recomputation brings one block's activations back during its backward.
    let live_again = if recomputed(layout) == Recompute::Full {
        block_activations(model, work, layout, precision, Recompute::None)
    } else {
        0.0
    };
    let tokens = (work.seq_len / layout.cp * layout.micro_batch) as f64;
    let logits = 2.0 * 4.0 * tokens * model.vocab as f64 / layout.tp as f64;
    let blocks = stage_blocks(model, work, layout);
    let last = blocks.len() - 1;
    blocks
        .iter()
        .enumerate()
        .map(|(stage, &n)| {
            n as f64 * per_block * in_flight(layout, m, stage)
                + live_again
                + if stage == last { logits } else { 0.0 }
        })
        .fold(0.0, f64::max)
}

/// Time of one ring collective over `n` ranks moving `bytes` per rank with nccl-tests'
/// bus-bandwidth factor `factor`.
fn collective(n: usize, bytes: f64, factor: f64, bandwidth: f64, latency: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    latency * (n - 1) as f64 + bytes * factor / bandwidth
}

fn link(layout: &Layout, axes: &[Axis], hw: &Hardware) -> (f64, f64) {
    if layout.within_node(axes, hw) {
        (hw.intra_node_bandwidth, hw.intra_node_latency)
    } else {
        (hw.inter_node_bandwidth, hw.inter_node_latency)
    }
}

/// Per-step time of `layout` on `world` devices of `hw`.
pub fn step_time(
    model: &ModelSpec,
    work: &Workload,
    layout: &Layout,
    hw: &Hardware,
    precision: Precision,
) -> TimeEstimate {
    let world = layout.world() as f64;
    let rate = hw.peak_flops * hw.efficiency;
    let tokens = work.tokens();
    let compute = model.step_flops(tokens, work.seq_len) / world / rate;
    let (l, h, s_all) = (
        model.layers as f64,
        model.hidden as f64,
        work.seq_len as f64,
    );
    let recompute = match recomputed(layout) {
        Recompute::None => 0.0,
        // One more forward: 2 N + 4 L h S of the 6 N + 12 L h S per token.
        Recompute::Full => compute / 3.0,
        Recompute::Selective => 4.0 * l * h * s_all * tokens / world / rate,
    };
    let m = layout.micro_batches(work).max(1) as f64;
    let pp = layout.pp as f64;
    let bubble_fraction = if layout.pp == 1 {
        0.0
    } else {
        match layout.schedule {
            PipelineSchedule::Gpipe | PipelineSchedule::OneFOneB => (pp - 1.0) / m,
            PipelineSchedule::Interleaved { chunks } => (pp - 1.0) / (chunks as f64 * m),
            PipelineSchedule::ZbH1 => (pp - 1.0) / (3.0 * m),
        }
    };
    let bubble = (compute + recompute) * bubble_fraction;
    // Stages cut as the layout (or the training job's cost split) cuts them.
    let (block_flops, head_flops) = block_and_head_flops(model, work);
    let imbalance = cut_imbalance(
        &virtual_stage_blocks(model, work, layout),
        block_flops,
        head_flops,
    );
    let stage_imbalance = (compute + recompute) * (imbalance - 1.0);
    let act = precision.activation_bytes();
    let s = s_all / layout.cp as f64;
    let b = layout.micro_batch as f64;
    // The busiest pipeline rank sets the pace.
    let blocks = stage_blocks(model, work, layout)
        .into_iter()
        .max()
        .unwrap_or(0) as f64;
    let t = layout.tp;
    // Tensor parallelism: all-reduces of the block's activations (or their all-gather /
    // reduce-scatter halves with sequence parallelism: the same bytes).
    let (bw, lat) = link(layout, &[Axis::Tp], hw);
    let per_block = if recomputed(layout) == Recompute::Full {
        6.0
    } else {
        4.0
    };
    let all_reduce = collective(
        t,
        s * b * h * act,
        2.0 * (t as f64 - 1.0) / t as f64,
        bw,
        lat,
    );
    // The input gradient's collective at each column-parallel entry (an all-reduce; with
    // sequence parallelism a reduce-scatter, half of one) runs while the entry's weight
    // gradients are computed (2 x tokens x their parameters on this rank): q, k, v, and the
    // MLP's gate and up (two of its three).
    let overlapped = if t == 1 {
        0.0
    } else {
        let tokens = s * b;
        let entry = match layout.sequence_parallel {
            true => all_reduce / 2.0,
            false => all_reduce,
        };
        let qkv = (h * h + 2.0 * h * model.kv_width()) / t as f64;
        let gate_up = model.mlp_params() * 2.0 / 3.0 / t as f64;
        let hidden_by = |params: f64| entry.min(2.0 * tokens * params / rate);
        hidden_by(qkv) + hidden_by(gate_up)
    };
    let tensor_parallel = m * blocks * (per_block * all_reduce - overlapped);
    // Context parallelism: cp - 1 passes of the key/value block per block in forward, hidden
    // behind the forward's attention compute when shorter (Flashover overlaps them), and as
    // many passes of their gradients in backward, exposed (autodiff runs them in turn).
    let context_parallel = if layout.cp > 1 {
        let (bw, lat) = link(layout, &[Axis::Cp], hw);
        let kv = 2.0 * s * b * model.kv_width() / t as f64 * act;
        let passes = (layout.cp - 1) as f64 * (lat + kv / bw);
        let forward_attention = 4.0 * h * s * s_all * b / t as f64 / rate;
        m * blocks * ((passes - forward_attention).max(0.0) + passes)
    } else {
        0.0
    };
    // Pipeline: one activation forward and one gradient back per micro-batch and boundary.
    let pipeline_comm = if layout.pp > 1 {
        let (bw, lat) = link(layout, &[Axis::Pp], hw);
        let sp = if layout.sequence_parallel {
            t as f64
        } else {
            1.0
        };
        2.0 * m * layout.chunks() as f64 * (lat + s * b * h / sp * act / bw)
    } else {
        0.0
    };
    let p = params_per_device(model, work, layout);
    let (w, g, _) = precision.state_bytes();
    let data_parallel = if layout.zero == 3 {
        let n = layout.fsdp;
        let (bw, lat) = link(layout, &[Axis::Fsdp], hw);
        let factor = (n as f64 - 1.0) / n as f64;
        let units = blocks.max(1.0);
        let block = block_params_per_device(model, layout);
        let edges = (p - units * block).max(0.0);
        // As the units overlap them (see ASSUMPTIONS): the blocks' gathers and reduce-scatters
        // on one stream, exposed where it takes longer than the blocks' compute (forward and
        // backward: three forwards, four with the rerun of full recomputation), and the step's
        // last reduce-scatter; the parameters outside the blocks gathered and reduce-scattered
        // once a micro-batch, exposed.
        let forward = compute / (3.0 * m * units);
        let forwards = match recomputed(layout) {
            Recompute::Full => 4.0,
            _ => 3.0,
        };
        let gather = collective(n, block * w, factor, bw, lat);
        let scatter = collective(n, block * g, factor, bw, lat);
        let stream = units * (2.0 * gather + scatter);
        let per_micro = (stream - forwards * units * forward).max(0.0)
            + collective(n, edges * w, factor, bw, lat)
            + collective(n, edges * g, factor, bw, lat);
        let replicas = if layout.dp > 1 {
            let (bw, lat) = link(layout, &[Axis::Dp], hw);
            let dp = layout.dp as f64;
            collective(layout.dp, p * g / n as f64, 2.0 * (dp - 1.0) / dp, bw, lat)
        } else {
            0.0
        };
        m * per_micro + scatter + replicas
    } else {
        let n = layout.dp * layout.cp * layout.ep;
        let (bw, lat) = link(layout, &[Axis::Dp, Axis::Ep, Axis::Cp], hw);
        let reduce = collective(n, p * g, 2.0 * (n as f64 - 1.0) / n as f64, bw, lat);
        // Hidden behind the last micro-batch's backward.
        (reduce - 2.0 / 3.0 * compute / m).max(0.0)
    };
    let expert_parallel = if layout.ep > 1 && model.experts > 0 {
        let (bw, lat) = link(layout, &[Axis::Ep], hw);
        let e = layout.ep as f64;
        let rows = s * b * model.top_k as f64;
        m * blocks * 4.0 * collective(layout.ep, rows * h * act, (e - 1.0) / e, bw, lat)
    } else {
        0.0
    };
    TimeEstimate {
        compute,
        recompute,
        bubble,
        stage_imbalance,
        tensor_parallel,
        context_parallel,
        pipeline_comm,
        data_parallel,
        expert_parallel,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_memory_matches_the_papers_table() {
        // ZeRO (Rajbhandari et al. 2020), Table 1: 7.5B parameters, N = 64, mixed precision.
        let gb = |(a, b, c): (f64, f64, f64)| ((a + b + c) / 1e9 * 10.0).round() / 10.0;
        let state = |zero| gb(model_state(7.5e9, Precision::Mixed, zero, 64));
        assert_eq!(state(0), 120.0);
        assert_eq!(state(1), 31.4);
        assert_eq!(state(2), 16.6);
        assert_eq!(state(3), 1.9);
    }

    fn layout() -> Layout {
        Layout::single()
    }

    #[test]
    fn zero3_is_charged_selective_recomputation_and_what_its_stream_does_not_hide() {
        let model = ModelSpec::preset("llama-8b").unwrap();
        let work = Workload {
            seq_len: 4096,
            global_batch: 64,
        };
        let hw = Hardware::preset("h100").unwrap();
        let mut sharded = layout();
        (sharded.fsdp, sharded.zero) = (8, 3);
        let time = step_time(&model, &work, &sharded, &hw, Precision::Mixed);
        // Selective recomputation (Burn's balanced checkpointing) when it asks for none.
        let mut selective = sharded.clone();
        selective.recompute = Recompute::Selective;
        let selective = step_time(&model, &work, &selective, &hw, Precision::Mixed);
        assert!(time.recompute > 0.0 && time.recompute < time.compute / 3.0);
        assert_eq!(time, selective);
        // Inside a node the blocks' collectives hide behind their compute (a 4k-token
        // micro-batch of an 8B block on 8 GPUs): what is exposed is the step's last
        // reduce-scatter and, every micro-batch, the embedding's and head's collectives.
        let (bw, lat) = link(&sharded, &[Axis::Fsdp], &hw);
        let block = block_params_per_device(&model, &sharded);
        let scatter = collective(8, block * 2.0, 7.0 / 8.0, bw, lat);
        let edges = params_per_device(&model, &work, &sharded) - model.layers as f64 * block;
        let edge = collective(8, edges * 2.0, 7.0 / 8.0, bw, lat);
        let m = sharded.micro_batches(&work) as f64;
        let expected = scatter + m * 2.0 * edge;
        assert!((time.data_parallel - expected).abs() < 1e-9, "{time:?}");
        // Across nodes (one GPU per node) the stream outlasts the compute: exposed.
        let mut hw_slow = hw.clone();
        hw_slow.devices_per_node = 1;
        let slow = step_time(&model, &work, &sharded, &hw_slow, Precision::Mixed);
        assert!(slow.data_parallel > 10.0 * time.data_parallel, "{slow:?}");
        // Full recomputation costs a forward of the blocks more.
        sharded.recompute = Recompute::Full;
        let full = step_time(&model, &work, &sharded, &hw, Precision::Mixed);
        assert_eq!(full.recompute, full.compute / 3.0);
    }

    #[test]
    fn in_flight_micro_batches_follow_the_schedule() {
        let mut layout = layout();
        layout.pp = 4;
        assert_eq!(in_flight(&layout, 8, 0), 4.0);
        assert_eq!(in_flight(&layout, 8, 3), 1.0);
        assert_eq!(in_flight(&layout, 2, 0), 2.0);
        layout.schedule = PipelineSchedule::Gpipe;
        assert_eq!(in_flight(&layout, 8, 3), 8.0);
        layout.schedule = PipelineSchedule::Interleaved { chunks: 2 };
        assert_eq!(in_flight(&layout, 8, 0), 4.0 * (1.0 + 3.0 / 8.0));
    }
}
