//! Enumerate the layouts of a world, keep those that are valid and fit, rank them by
//! estimated throughput.

use crate::cost::{MemoryEstimate, TimeEstimate, memory, step_time};
use crate::hardware::Hardware;
use crate::layout::{Layout, PipelineSchedule, Precision, Recompute};
use crate::model::{ModelSpec, Workload};
use serde::Serialize;
use std::collections::HashMap;

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
    /// Sequences per micro-batch.
    pub micro_batch: Option<usize>,
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
    /// Why the best plan's every choice (each mesh axis, the ZeRO stage, recomputation, the
    /// micro-batch size) is what it is: the best plan with each other value of that choice.
    pub choices: Vec<Choice>,
}

/// One choice of the best plan set against its alternatives.
#[derive(Debug, Clone, Serialize)]
pub struct Choice {
    /// What was chosen: `tp`, `zero`, `recompute`, `micro-batch`, ...
    pub knob: &'static str,
    /// The best plan's value.
    pub chosen: String,
    /// Every other value the search met, best first: what the best layout with it costs.
    pub alternatives: Vec<Alternative>,
}

/// The best layout with another value of a [`Choice`].
#[derive(Debug, Clone, Serialize)]
pub struct Alternative {
    /// The value.
    pub value: String,
    /// Its best layout, when one fits.
    pub mesh: Option<String>,
    /// Throughput relative to the best plan (1.0: as fast), when one fits.
    pub relative_throughput: Option<f64>,
    /// Why: the overhead it pays beyond the best plan, or that it does not fit.
    pub why: String,
    /// The per-device memory its smallest layout needs (bytes).
    pub smallest_memory: f64,
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Micro-batch sizes for a rank's share of `share` sequences: the fixed one, or every power of
/// two that divides the share.
fn micro_batch_sizes(fixed: Option<usize>, share: usize) -> Vec<usize> {
    match fixed {
        Some(size) => vec![size],
        None => std::iter::successors(Some(1usize), |s| s.checked_mul(2))
            .take_while(|s| *s <= share)
            .filter(|s| share.is_multiple_of(*s))
            .collect(),
    }
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
                        // ZeRO-3 recomputes at least selectively (its units reshard after
                        // forward under Burn's balanced checkpointing): asking for none is
                        // the selective job.
                        let recomputes = match (f.recompute, zero) {
                            (Some(Recompute::None), 3) => vec![],
                            (None, 3) => vec![Recompute::Selective, Recompute::Full],
                            (Some(r), _) => vec![r],
                            (None, _) => {
                                vec![Recompute::None, Recompute::Selective, Recompute::Full]
                            }
                        };
                        let share = req.workload.global_batch / (dp * fsdp * ep).max(1);
                        let sizes = micro_batch_sizes(f.micro_batch, share);
                        for schedule in schedules {
                            for &recompute in &recomputes {
                                for &micro_batch in &sizes {
                                    out.push(Layout {
                                        pp,
                                        dp,
                                        fsdp,
                                        ep,
                                        cp,
                                        tp,
                                        zero,
                                        // Sequence parallelism only saves memory with tp
                                        // (Flashover does not combine it with cp).
                                        sequence_parallel: tp > 1 && cp == 1,
                                        schedule,
                                        recompute,
                                        micro_batch,
                                        stage_blocks: None,
                                    });
                                }
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
    if req.workload.seq_len == 0
        || req.workload.global_batch == 0
        || req.fixed.micro_batch == Some(0)
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
    // The smallest memory any layout with each value of each choice needs, for saying why a
    // value no plan has is out.
    let mut smallest_by_choice: HashMap<(&'static str, String), f64> = HashMap::new();
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
        for (knob, value) in choices_of(&layout) {
            let need = smallest_by_choice
                .entry((knob, value))
                .or_insert(f64::INFINITY);
            *need = need.min(mem.total());
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
    let choices = explain_choices(&plans, &smallest_by_choice);
    Ok(PlanResult {
        plans,
        considered,
        too_big,
        unsupported,
        smallest_memory: smallest,
        choices,
    })
}

/// Every choice a layout makes, as `(knob, value)`: the degree of each mesh axis, the ZeRO
/// stage, recomputation, the micro-batch size and, with a pipeline, its schedule.
fn choices_of(layout: &Layout) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, String)> = layout
        .degrees()
        .iter()
        .map(|(axis, degree)| (axis.name(), degree.to_string()))
        .collect();
    out.push(("zero", layout.zero.to_string()));
    out.push((
        "recompute",
        match layout.recompute {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
        .to_string(),
    ));
    out.push(("micro-batch", layout.micro_batch.to_string()));
    if layout.pp > 1 {
        out.push((
            "schedule",
            match layout.schedule {
                PipelineSchedule::Gpipe => "gpipe".to_string(),
                PipelineSchedule::OneFOneB => "1f1b".to_string(),
                PipelineSchedule::Interleaved { chunks } => format!("interleaved x{chunks}"),
                PipelineSchedule::ZbH1 => "zb-h1".to_string(),
            },
        ));
    }
    out
}

/// For each of the best plan's choices, the best plan with each other value (`plans` ranked
/// best first), or, when no layout with that value fits, the memory its smallest one needs.
fn explain_choices(
    plans: &[Plan],
    smallest_by_choice: &HashMap<(&'static str, String), f64>,
) -> Vec<Choice> {
    let Some(best) = plans.first() else {
        return vec![];
    };
    // The best plan with each value of each choice: the first met, plans being ranked.
    let mut best_with: HashMap<(&'static str, String), &Plan> = HashMap::new();
    for plan in plans {
        for key in choices_of(&plan.layout) {
            best_with.entry(key).or_insert(plan);
        }
    }
    let mut choices = vec![];
    for (knob, chosen) in choices_of(&best.layout) {
        let mut values: Vec<&String> = smallest_by_choice
            .keys()
            .filter(|(k, v)| *k == knob && *v != chosen)
            .map(|(_, v)| v)
            .collect();
        values.sort();
        let mut alternatives: Vec<Alternative> = values
            .into_iter()
            .map(|value| {
                let key = (knob, value.clone());
                let smallest_memory = smallest_by_choice[&key];
                match best_with.get(&key) {
                    Some(p) => Alternative {
                        value: value.clone(),
                        mesh: Some(format!("{} micro-batch {}", p.layout, p.layout.micro_batch)),
                        relative_throughput: Some(p.tokens_per_s / best.tokens_per_s),
                        why: match extra_overhead(&p.time, &best.time) {
                            Some(name) => format!("more {name}"),
                            None => "no overhead larger than #1's".into(),
                        },
                        smallest_memory,
                    },
                    None => Alternative {
                        value: value.clone(),
                        mesh: None,
                        relative_throughput: None,
                        why: format!(
                            "does not fit: its smallest layout needs {:.1} GB per device",
                            smallest_memory / 1e9
                        ),
                        smallest_memory,
                    },
                }
            })
            .collect();
        // Those that fit, fastest first; then those that do not, smallest first.
        alternatives.sort_by(|a, b| {
            let rate = |x: &Alternative| x.relative_throughput.unwrap_or(-1.0);
            rate(b)
                .total_cmp(&rate(a))
                .then(a.smallest_memory.total_cmp(&b.smallest_memory))
        });
        if !alternatives.is_empty() {
            choices.push(Choice {
                knob,
                chosen,
                alternatives,
            });
        }
    }
    choices
}

/// How much slower than the best plan one at `relative` of its throughput is, in percent
/// (below 1 reads "within 1%").
fn percent_slower(relative: f64) -> f64 {
    100.0 * (1.0 / relative - 1.0)
}

impl Alternative {
    /// One line: the value, how it compares with the best plan and why.
    pub fn summary(&self) -> String {
        match self.relative_throughput.map(percent_slower) {
            Some(slower) if slower < 1.0 => format!("{} within 1% ({})", self.value, self.why),
            Some(slower) => format!("{} {slower:.0}% slower ({})", self.value, self.why),
            None => format!("{} {}", self.value, self.why),
        }
    }
}

/// The overhead `plan` pays most beyond `best`, if any.
fn extra_overhead(plan: &TimeEstimate, best: &TimeEstimate) -> Option<&'static str> {
    let theirs = best.overheads();
    plan.overheads()
        .into_iter()
        .map(|(name, secs)| {
            let base = theirs
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(0.0, |(_, v)| *v);
            (name, secs - base)
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .filter(|(_, extra)| *extra > 0.0)
        .map(|(name, _)| name)
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
            let slower = percent_slower(plan.tokens_per_s / best.tokens_per_s);
            let slower = if slower < 1.0 {
                "within 1% of #1".to_string()
            } else {
                format!("{slower:.0}% slower than #1")
            };
            // What this layout pays that the best does not.
            match extra_overhead(&plan.time, &best.time) {
                Some(name) => format!("{slower}: more {name}; {largest}"),
                None => format!("{slower}; {largest}"),
            }
        };
    }
}
