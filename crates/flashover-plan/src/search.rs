//! Enumerate the layouts of a world, keep those that are valid and fit, rank them by
//! estimated throughput.

use crate::cost::{MemoryEstimate, TimeEstimate, memory, step_time};
use crate::hardware::Hardware;
use crate::layout::{Layout, PipelineSchedule, Precision, Recompute};
use crate::model::{ModelSpec, Workload};
use serde::Serialize;

/// Axes or options the user fixed (`None`: search over them).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Fixed {
    /// Tensor parallel degree.
    pub tp: Option<usize>,
    /// Pipeline degree.
    pub pp: Option<usize>,
    /// Context parallel degree.
    pub cp: Option<usize>,
    /// Expert parallel degree.
    pub ep: Option<usize>,
    /// Replicas.
    pub dp: Option<usize>,
    /// ZeRO-3 shard group.
    pub fsdp: Option<usize>,
    /// ZeRO stage.
    pub zero: Option<u8>,
    /// Recomputation.
    pub recompute: Option<Recompute>,
}

/// What to plan for.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    /// Devices.
    pub world: usize,
    /// The devices and links.
    pub hardware: Hardware,
    /// The model.
    pub model: ModelSpec,
    /// The batch.
    pub workload: Workload,
    /// Bytes per parameter and activation.
    pub precision: Precision,
    /// User constraints.
    pub fixed: Fixed,
    /// Also list layouts Flashover's training job cannot run yet.
    pub include_unsupported: bool,
}

/// One ranked layout.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// The layout.
    pub layout: Layout,
    /// `flashover train --mesh` value.
    pub mesh: String,
    /// Estimated per-device memory (bytes).
    pub memory: MemoryEstimate,
    /// Estimated step time by cause (seconds).
    pub time: TimeEstimate,
    /// Tokens per second over the whole job.
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation (model FLOPs / (step x devices x peak)).
    pub mfu: f64,
    /// What Flashover cannot run yet about this layout (empty: it can).
    pub unsupported: Vec<String>,
    /// One line on why it ranks where it does.
    pub why: String,
}

/// The search's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct PlanResult {
    /// Layouts that are valid and fit, best first.
    pub plans: Vec<Plan>,
    /// Layouts considered (valid for the model and constraints).
    pub considered: usize,
    /// Of those, how many did not fit in memory.
    pub too_big: usize,
    /// Of those, how many Flashover cannot run yet (left out unless asked for).
    pub unsupported: usize,
    /// The smallest per-device memory any valid layout needs (bytes), to say by how much
    /// nothing fits.
    pub smallest_memory: f64,
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

fn pick(fixed: Option<usize>, n: usize) -> Vec<usize> {
    match fixed {
        Some(v) if v > 0 && n.is_multiple_of(v) => vec![v],
        Some(_) => vec![],
        None => divisors(n),
    }
}

/// Every layout of `req.world` devices the constraints allow (not yet checked for validity).
pub fn enumerate(req: &PlanRequest) -> Vec<Layout> {
    let f = &req.fixed;
    let moe = req.model.experts > 0;
    let mut out = vec![];
    for tp in pick(f.tp, req.world) {
        let rest = req.world / tp;
        for pp in pick(f.pp, rest) {
            let rest = rest / pp;
            for cp in pick(f.cp, rest) {
                let rest = rest / cp;
                let eps = if moe { pick(f.ep, rest) } else { vec![1] };
                for ep in eps {
                    let d = rest / ep;
                    let mut shardings: Vec<(u8, usize)> = vec![(0, 1), (1, 1), (2, 1)];
                    shardings.extend(divisors(d).into_iter().filter(|&n| n > 1).map(|n| (3, n)));
                    for (zero, fsdp) in shardings {
                        let dp = d / fsdp;
                        if f.zero.is_some_and(|z| z != zero)
                            || f.fsdp.is_some_and(|v| v != fsdp)
                            || f.dp.is_some_and(|v| v != dp)
                        {
                            continue;
                        }
                        let schedules = if pp > 1 {
                            vec![
                                PipelineSchedule::OneFOneB,
                                PipelineSchedule::Interleaved { chunks: 2 },
                                PipelineSchedule::ZbH1,
                                PipelineSchedule::Gpipe,
                            ]
                        } else {
                            vec![PipelineSchedule::OneFOneB]
                        };
                        let recomputes = match f.recompute {
                            Some(r) => vec![r],
                            None => vec![Recompute::None, Recompute::Selective, Recompute::Full],
                        };
                        for schedule in schedules {
                            for &recompute in &recomputes {
                                out.push(Layout {
                                    pp,
                                    dp,
                                    fsdp,
                                    ep,
                                    cp,
                                    tp,
                                    zero,
                                    // Sequence parallelism only saves memory with tp (Flashover
                                    // does not combine it with cp).
                                    sequence_parallel: tp > 1 && cp == 1,
                                    schedule,
                                    recompute,
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Plans: the valid layouts that fit, ranked by estimated throughput (ties: fewer parallel
/// dimensions, then less memory), each with a line on why.
pub fn plan(req: &PlanRequest) -> Result<PlanResult, String> {
    let mut errors = req.hardware.validate();
    errors.extend(req.model.validate());
    if req.world == 0 {
        errors.push("world must be at least 1".into());
    }
    if req.workload.seq_len == 0 || req.workload.global_batch == 0 || req.workload.micro_batch == 0
    {
        errors.push("sequence length, global batch and micro-batch size must be at least 1".into());
    }
    if !errors.is_empty() {
        return Err(errors.join("; "));
    }
    let (mut considered, mut too_big, mut unsupported) = (0, 0, 0);
    let mut smallest = f64::INFINITY;
    let mut plans = vec![];
    let limit = req.hardware.usable_bytes();
    for layout in enumerate(req) {
        if !layout
            .problems(&req.model, &req.workload, &req.hardware, req.world)
            .is_empty()
        {
            continue;
        }
        considered += 1;
        let mem = memory(&req.model, &req.workload, &layout, req.precision);
        smallest = smallest.min(mem.total());
        let missing = layout.unsupported(&req.model);
        if !missing.is_empty() {
            unsupported += 1;
            if !req.include_unsupported {
                continue;
            }
        }
        if mem.total() > limit {
            too_big += 1;
            continue;
        }
        let time = step_time(
            &req.model,
            &req.workload,
            &layout,
            &req.hardware,
            req.precision,
        );
        let step = time.step();
        let flops = req
            .model
            .step_flops(req.workload.tokens(), req.workload.seq_len);
        plans.push(Plan {
            mesh: layout.mesh_spec(),
            tokens_per_s: req.workload.tokens() / step,
            mfu: flops / (step * req.world as f64 * req.hardware.peak_flops),
            memory: mem,
            time,
            unsupported: missing,
            why: String::new(),
            layout,
        });
    }
    plans.sort_by(|a, b| {
        b.tokens_per_s
            .total_cmp(&a.tokens_per_s)
            .then(a.layout.dimensions().cmp(&b.layout.dimensions()))
            .then(a.memory.total().total_cmp(&b.memory.total()))
    });
    explain_ranking(&mut plans, limit);
    Ok(PlanResult {
        plans,
        considered,
        too_big,
        unsupported,
        smallest_memory: smallest,
    })
}

fn explain_ranking(plans: &mut [Plan], limit: f64) {
    let Some(best) = plans.first().cloned() else {
        return;
    };
    for (i, plan) in plans.iter_mut().enumerate() {
        let step = plan.time.step();
        let (name, secs) = plan.time.overheads()[0];
        let largest = if secs > 0.0 {
            format!("largest overhead {name} {:.0}%", 100.0 * secs / step)
        } else {
            "no overhead besides compute".into()
        };
        let headroom = 100.0 * (1.0 - plan.memory.total() / limit);
        plan.why = if i == 0 {
            format!(
                "fastest that fits ({headroom:.0}% memory headroom); compute {:.0}% of the step, {largest}",
                100.0 * plan.time.compute / step
            )
        } else {
            let slower = 100.0 * (best.tokens_per_s / plan.tokens_per_s - 1.0);
            let slower = if slower < 1.0 {
                "within 1% of #1".to_string()
            } else {
                format!("{slower:.0}% slower than #1")
            };
            // What this layout pays that the best does not.
            let worse = plan
                .time
                .overheads()
                .into_iter()
                .zip(std::iter::repeat(best.time))
                .map(|((name, s), b)| {
                    let theirs = b
                        .overheads()
                        .into_iter()
                        .find(|(n, _)| *n == name)
                        .map_or(0.0, |(_, v)| v);
                    (name, s - theirs)
                })
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .filter(|(_, d)| *d > 0.0);
            match worse {
                Some((name, _)) => format!("{slower}: more {name}; {largest}"),
                None => format!("{slower}; {largest}"),
            }
        };
    }
}
