//! Pipeline schedules as data: for every rank, the list of actions it performs, in order.
//!
//! A rank holds `v` model chunks (virtual stages; `v = 1` except for interleaved schedules).
//! Chunk `c` on rank `r` is virtual stage `c * p + r`, so activations flow
//! `rank 0 -> 1 -> ... -> p-1 -> rank 0 (next chunk) -> ...` and gradients flow back. Every
//! generator produces compute actions; [`Schedule::with_communication`] inserts the sends and
//! receives each compute action implies, so a user can also write the compute order alone.

use crate::plan::ScheduleKind;
use serde::Serialize;
use std::collections::HashMap;
use std::fmt;

/// What an action does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum ActionKind {
    /// Forward of a micro-batch through a chunk.
    Forward,
    /// Whole backward (input and weight gradients).
    Backward,
    /// Backward for the input gradient only (zero-bubble schedules).
    BackwardInput,
    /// Backward for the weight gradient only, after [`ActionKind::BackwardInput`].
    BackwardWeight,
    /// Send a chunk's output activation to the next virtual stage.
    SendActivation,
    /// Receive a chunk's input activation from the previous virtual stage.
    RecvActivation,
    /// Send the gradient of a chunk's input to the previous virtual stage.
    SendGrad,
    /// Receive the gradient of a chunk's output from the next virtual stage.
    RecvGrad,
}

/// One step of a rank's schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Action {
    /// What to do.
    pub kind: ActionKind,
    /// Micro-batch.
    pub micro: usize,
    /// Model chunk on this rank (0 unless interleaved).
    pub chunk: usize,
}

impl Action {
    /// A new action.
    pub fn new(kind: ActionKind, micro: usize, chunk: usize) -> Self {
        Action { kind, micro, chunk }
    }

    /// Whether it computes (rather than communicates).
    pub fn is_compute(&self) -> bool {
        matches!(
            self.kind,
            ActionKind::Forward
                | ActionKind::Backward
                | ActionKind::BackwardInput
                | ActionKind::BackwardWeight
        )
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tag = match self.kind {
            ActionKind::Forward => "F",
            ActionKind::Backward => "B",
            ActionKind::BackwardInput => "I",
            ActionKind::BackwardWeight => "W",
            ActionKind::SendActivation => "sa",
            ActionKind::RecvActivation => "ra",
            ActionKind::SendGrad => "sg",
            ActionKind::RecvGrad => "rg",
        };
        write!(f, "{tag}{}", self.micro)?;
        if self.chunk > 0 {
            write!(f, ".{}", self.chunk)?;
        }
        Ok(())
    }
}

/// `actions` as the steps a rank takes: each compute action alone, and each run of consecutive
/// sends and receives together (one batch: see [`super::unbuffered_deadlock`]).
pub(crate) fn steps_of(actions: &[Action]) -> impl Iterator<Item = &[Action]> {
    actions.chunk_by(|a, b| !a.is_compute() && !b.is_compute())
}

/// A schedule: per rank, its actions in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Schedule {
    /// Pipeline ranks.
    pub pp: usize,
    /// Model chunks per rank.
    pub chunks: usize,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Per rank, the actions in order.
    pub ranks: Vec<Vec<Action>>,
}

impl Schedule {
    /// Virtual stage of `chunk` on `rank`.
    pub fn stage_of(&self, rank: usize, chunk: usize) -> usize {
        chunk * self.pp + rank
    }

    /// Number of virtual stages.
    pub fn stages(&self) -> usize {
        self.pp * self.chunks
    }

    /// `(rank, chunk)` of virtual stage `stage`.
    pub fn place(&self, stage: usize) -> (usize, usize) {
        (stage % self.pp, stage / self.pp)
    }

    /// The same compute order with the sends and receives it implies: a receive of the input
    /// before each forward (except on the first virtual stage) and a send of the output after
    /// it (except on the last); a receive of the output gradient before each backward (input
    /// part) except on the last stage, and a send of the input gradient after it except on the
    /// first. Communication actions already present are dropped first.
    pub fn with_communication(mut self) -> Self {
        let last = self.stages() - 1;
        for rank in 0..self.pp {
            let compute: Vec<Action> = self.ranks[rank]
                .iter()
                .copied()
                .filter(Action::is_compute)
                .collect();
            let mut out = vec![];
            for a in compute {
                let stage = self.stage_of(rank, a.chunk);
                let at = |kind| Action::new(kind, a.micro, a.chunk);
                match a.kind {
                    ActionKind::Forward => {
                        if stage > 0 {
                            out.push(at(ActionKind::RecvActivation));
                        }
                        out.push(a);
                        if stage < last {
                            out.push(at(ActionKind::SendActivation));
                        }
                    }
                    ActionKind::Backward | ActionKind::BackwardInput => {
                        if stage < last {
                            out.push(at(ActionKind::RecvGrad));
                        }
                        out.push(a);
                        if stage > 0 {
                            out.push(at(ActionKind::SendGrad));
                        }
                    }
                    _ => out.push(a),
                }
            }
            self.ranks[rank] = out;
        }
        self
    }

    /// The same actions with Megatron's placement in the steady state: no transfers between a
    /// forward and the backward right after it. The backward's output gradient is received
    /// before the forward instead, and the forward's output sent after the backward, so the
    /// pair's transfers meet the neighbours' in fewer, larger batches. On an engine whose sends
    /// wait for their receives this is what interleaved 1F1B needs to run with more
    /// micro-batches than stages; the pipeline executor uses it there when the schedule as
    /// built would deadlock ([`super::unbuffered_deadlock`]).
    pub fn with_steady_pairs(mut self) -> Self {
        for actions in &mut self.ranks {
            let computes: Vec<usize> = (0..actions.len())
                .filter(|&i| actions[i].is_compute())
                .collect();
            // Per compute action, the transfers moved to just before or just after it.
            let mut before: HashMap<usize, Vec<Action>> = HashMap::new();
            let mut after: HashMap<usize, Vec<Action>> = HashMap::new();
            let mut moved = vec![false; actions.len()];
            for pair in computes.windows(2) {
                let (f, b) = (pair[0], pair[1]);
                if actions[f].kind != ActionKind::Forward || actions[b].kind != ActionKind::Backward
                {
                    continue;
                }
                for i in f + 1..b {
                    let to = match actions[i].kind {
                        ActionKind::RecvGrad => before.entry(f).or_default(),
                        ActionKind::SendActivation => after.entry(b).or_default(),
                        _ => continue,
                    };
                    to.push(actions[i]);
                    moved[i] = true;
                }
            }
            let mut placed = Vec::with_capacity(actions.len());
            for (i, a) in actions.iter().enumerate() {
                if moved[i] {
                    continue;
                }
                placed.extend(before.remove(&i).unwrap_or_default());
                placed.push(*a);
                placed.extend(after.remove(&i).unwrap_or_default());
            }
            *actions = placed;
        }
        self
    }

    /// A built-in schedule (with communication) for `pp` ranks, `micro_batches` micro-batches
    /// and `chunks` model chunks per rank (interleaved only; 1 otherwise).
    pub fn build(
        kind: ScheduleKind,
        pp: usize,
        micro_batches: usize,
        chunks: usize,
    ) -> Result<Self, String> {
        if pp == 0 || micro_batches == 0 {
            return Err(format!(
                "a pipeline needs at least one stage and one micro-batch (pp = {pp}, micro-batches = {micro_batches})"
            ));
        }
        let chunks = if kind == ScheduleKind::Interleaved1F1B {
            chunks.max(1)
        } else {
            1
        };
        let ranks = match kind {
            ScheduleKind::GPipe => (0..pp).map(|_| gpipe(micro_batches)).collect(),
            ScheduleKind::OneFOneB => (0..pp).map(|r| one_f_one_b(pp, r, micro_batches)).collect(),
            ScheduleKind::Interleaved1F1B => {
                if !micro_batches.is_multiple_of(pp) {
                    return Err(format!(
                        "the interleaved schedule needs micro-batches ({micro_batches}) to be a multiple of pp ({pp})"
                    ));
                }
                (0..pp)
                    .map(|r| interleaved(pp, r, micro_batches, chunks))
                    .collect()
            }
            ScheduleKind::ZeroBubbleH1 => super::simulate::zero_bubble_h1(pp, micro_batches),
        };
        Ok(Schedule {
            pp,
            chunks,
            micro_batches,
            ranks,
        }
        .with_communication())
    }
}

fn gpipe(m: usize) -> Vec<Action> {
    (0..m)
        .map(|i| Action::new(ActionKind::Forward, i, 0))
        .chain((0..m).map(|i| Action::new(ActionKind::Backward, i, 0)))
        .collect()
}

fn one_f_one_b(p: usize, r: usize, m: usize) -> Vec<Action> {
    let warmup = (p - r - 1).min(m);
    let mut out: Vec<Action> = (0..warmup)
        .map(|i| Action::new(ActionKind::Forward, i, 0))
        .collect();
    for i in 0..m - warmup {
        out.push(Action::new(ActionKind::Forward, warmup + i, 0));
        out.push(Action::new(ActionKind::Backward, i, 0));
    }
    out.extend((m - warmup..m).map(|i| Action::new(ActionKind::Backward, i, 0)));
    out
}

/// Megatron's interleaved 1F1B: forwards walk micro-batches in groups of `p` through chunks
/// `0..v`; backwards walk the chunks in reverse.
fn interleaved(p: usize, r: usize, m: usize, v: usize) -> Vec<Action> {
    let total = m * v;
    let forward = |k: usize| {
        let chunk = (k / p) % v;
        let micro = (k / (p * v)) * p + k % p;
        Action::new(ActionKind::Forward, micro, chunk)
    };
    let backward = |k: usize| {
        let chunk = v - 1 - (k / p) % v;
        let micro = (k / (p * v)) * p + k % p;
        Action::new(ActionKind::Backward, micro, chunk)
    };
    let warmup = ((p - r - 1) * 2 + (v - 1) * p).min(total);
    let mut out: Vec<Action> = (0..warmup).map(forward).collect();
    for k in 0..total - warmup {
        out.push(forward(warmup + k));
        out.push(backward(k));
    }
    out.extend((total - warmup..total).map(backward));
    out
}
