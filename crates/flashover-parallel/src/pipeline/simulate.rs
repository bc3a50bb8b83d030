//! Checking and timing schedules without running a model.
//!
//! [`validate`] plays a schedule with buffered point-to-point channels (as the collective layer
//! has) and reports, before anything runs, a backward before its forward, a receive that can
//! never be matched, messages that arrive in another order than they are received, deadlock, or
//! work left undone; [`unbuffered_deadlock`] plays it again with sends that wait for their
//! receives (NCCL's). [`simulate`] times a valid schedule with given costs: the bubble of each
//! rank and the peak number of micro-batches whose activations a rank holds.

use super::schedule::{Action, ActionKind, Schedule, steps_of};
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;

/// Why a schedule cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid pipeline schedule: {0}")]
pub struct ScheduleError(pub String);

/// A message between virtual stages: an activation (forward) or a gradient (backward).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Message {
    grad: bool,
    micro: usize,
    /// The receiving virtual stage.
    stage: usize,
}

impl fmt::Display for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = if self.grad { "gradient" } else { "activation" };
        write!(
            f,
            "{what} of micro-batch {} for stage {}",
            self.micro, self.stage
        )
    }
}

/// Per-(micro, virtual stage) progress while playing a schedule.
#[derive(Default)]
struct Progress {
    inputs: HashSet<(usize, usize)>,
    forwarded: HashSet<(usize, usize)>,
    grads: HashSet<(usize, usize)>,
    input_grad_done: HashSet<(usize, usize)>,
    weight_grad_done: HashSet<(usize, usize)>,
}

/// The action's message, the rank it goes to or comes from, for communication actions.
fn message_of(s: &Schedule, rank: usize, a: &Action) -> Option<(Message, usize, bool)> {
    let stage = s.stage_of(rank, a.chunk);
    let (grad, to_stage, send) = match a.kind {
        ActionKind::SendActivation => (false, stage + 1, true),
        ActionKind::RecvActivation => (false, stage, false),
        ActionKind::SendGrad => (true, stage.checked_sub(1)?, true),
        ActionKind::RecvGrad => (true, stage, false),
        _ => return None,
    };
    let peer_stage = match (a.kind, send) {
        (ActionKind::SendActivation, _) | (ActionKind::SendGrad, _) => to_stage,
        (ActionKind::RecvActivation, _) => stage.checked_sub(1)?,
        _ => stage + 1,
    };
    if peer_stage >= s.stages() {
        return None;
    }
    let msg = Message {
        grad,
        micro: a.micro,
        stage: to_stage,
    };
    Some((msg, s.place(peer_stage).0, send))
}

/// One step of playing `a` on `rank`: `Ok(true)` done, `Ok(false)` blocked on a message.
fn play(
    s: &Schedule,
    rank: usize,
    a: &Action,
    p: &mut Progress,
    channels: &mut HashMap<(usize, usize), VecDeque<Message>>,
) -> Result<bool, ScheduleError> {
    let stage = s.stage_of(rank, a.chunk);
    let key = (a.micro, stage);
    let last = s.stages() - 1;
    let err = |why: String| Err(ScheduleError(format!("rank {rank}, action {a}: {why}")));
    if a.chunk >= s.chunks || a.micro >= s.micro_batches {
        return err(format!(
            "no such chunk or micro-batch ({} chunks, {} micro-batches)",
            s.chunks, s.micro_batches
        ));
    }
    match a.kind {
        ActionKind::Forward => {
            if stage > 0 && !p.inputs.contains(&key) {
                return err("forward before its input activation was received".into());
            }
            if !p.forwarded.insert(key) {
                return err("second forward of the same micro-batch".into());
            }
        }
        ActionKind::Backward | ActionKind::BackwardInput => {
            if !p.forwarded.contains(&key) {
                return err("backward before its forward".into());
            }
            if stage < last && !p.grads.contains(&key) {
                return err("backward before its output gradient was received".into());
            }
            if !p.input_grad_done.insert(key) {
                return err("second backward of the same micro-batch".into());
            }
            if a.kind == ActionKind::Backward {
                p.weight_grad_done.insert(key);
            }
        }
        ActionKind::BackwardWeight => {
            if !p.input_grad_done.contains(&key) {
                return err("weight gradient before the input gradient".into());
            }
            if !p.weight_grad_done.insert(key) {
                return err("second weight gradient of the same micro-batch".into());
            }
        }
        _ => {
            let Some((msg, peer, send)) = message_of(s, rank, a) else {
                return err("no neighbouring stage in that direction".into());
            };
            if send {
                let ready = if msg.grad {
                    p.input_grad_done.contains(&key)
                } else {
                    p.forwarded.contains(&key)
                };
                if !ready {
                    return err("sends what has not been computed yet".into());
                }
                channels.entry((rank, peer)).or_default().push_back(msg);
            } else {
                let queue = channels.entry((peer, rank)).or_default();
                match queue.front() {
                    None => return Ok(false),
                    Some(m) if *m != msg => {
                        return err(format!(
                            "expects the {msg} but the next message from rank {peer} is the {m}"
                        ));
                    }
                    Some(_) => {
                        queue.pop_front();
                        if msg.grad {
                            p.grads.insert(key);
                        } else {
                            p.inputs.insert(key);
                        }
                    }
                }
            }
        }
    }
    Ok(true)
}

/// Plays a valid `schedule` (see [`validate`]) on an engine whose sends wait for their
/// receives (NCCL), each rank's consecutive transfers run as one batch as the executor runs
/// them: `None` when every rank gets to its end, else where the ranks stop, e.g. `rank 0 at
/// [sa3 rg1], rank 1 at [sg1 ra4]`.
pub fn unbuffered_deadlock(schedule: &Schedule) -> Option<String> {
    let steps: Vec<Vec<&[Action]>> = (schedule.ranks.iter())
        .map(|actions| steps_of(actions).collect())
        .collect();
    let p = schedule.pp;
    let mut at = vec![0usize; p];
    // Per rank, the transfers of its current step that met their other end.
    let mut met: Vec<HashSet<usize>> = vec![HashSet::new(); p];
    loop {
        let mut progress = false;
        for r in 0..p {
            let Some(step) = steps[r].get(at[r]) else {
                continue;
            };
            for (i, a) in step.iter().enumerate() {
                if a.is_compute() || met[r].contains(&i) {
                    continue;
                }
                let Some((msg, peer, send)) = message_of(schedule, r, a) else {
                    continue;
                };
                let Some(other) = steps[peer].get(at[peer]) else {
                    continue;
                };
                // The other end must be in the peer's current step: a send waits for it.
                let other_end = other.iter().enumerate().position(|(j, b)| {
                    (peer, j) != (r, i)
                        && !met[peer].contains(&j)
                        && message_of(schedule, peer, b)
                            .is_some_and(|(m, q, s)| m == msg && q == r && s != send)
                });
                if let Some(j) = other_end {
                    met[r].insert(i);
                    met[peer].insert(j);
                    progress = true;
                }
            }
        }
        for r in 0..p {
            let Some(step) = steps[r].get(at[r]) else {
                continue;
            };
            if (step.iter().enumerate()).all(|(i, a)| a.is_compute() || met[r].contains(&i)) {
                at[r] += 1;
                met[r].clear();
                progress = true;
            }
        }
        if (0..p).all(|r| at[r] == steps[r].len()) {
            return None;
        }
        if !progress {
            let stuck: Vec<String> = (0..p)
                .filter(|&r| at[r] < steps[r].len())
                .map(|r| {
                    let step: Vec<String> = steps[r][at[r]].iter().map(|a| a.to_string()).collect();
                    format!("rank {r} at [{}]", step.join(" "))
                })
                .collect();
            return Some(stuck.join(", "));
        }
    }
}

/// Plays `schedule` and reports the first problem; see the module docs.
pub fn validate(schedule: &Schedule) -> Result<(), ScheduleError> {
    let s = schedule;
    if s.ranks.len() != s.pp {
        return Err(ScheduleError(format!(
            "{} action lists for {} pipeline ranks",
            s.ranks.len(),
            s.pp
        )));
    }
    let mut next = vec![0; s.pp];
    let mut progress = Progress::default();
    let mut channels = HashMap::new();
    loop {
        let mut moved = false;
        for (rank, actions) in s.ranks.iter().enumerate() {
            while let Some(a) = actions.get(next[rank]) {
                if !play(s, rank, a, &mut progress, &mut channels)? {
                    break;
                }
                next[rank] += 1;
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    let stuck: Vec<String> = (0..s.pp)
        .filter_map(|r| {
            s.ranks[r]
                .get(next[r])
                .map(|a| format!("rank {r} waits at {a} (action {})", next[r]))
        })
        .collect();
    if !stuck.is_empty() {
        return Err(ScheduleError(format!(
            "deadlock, no message can arrive: {}",
            stuck.join("; ")
        )));
    }
    for stage in 0..s.stages() {
        for micro in 0..s.micro_batches {
            let key = (micro, stage);
            if !progress.weight_grad_done.contains(&key) {
                let (rank, chunk) = s.place(stage);
                return Err(ScheduleError(format!(
                    "micro-batch {micro} never finishes its backward on rank {rank}, chunk {chunk}"
                )));
            }
        }
    }
    if let Some(((from, to), q)) = channels.iter().find(|(_, q)| !q.is_empty()) {
        return Err(ScheduleError(format!(
            "rank {from} sends the {} to rank {to}, which never receives it",
            q[0]
        )));
    }
    Ok(())
}

/// Durations of compute actions (communication is free in the simulation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Costs {
    /// Forward of one micro-batch through one chunk.
    pub forward: f64,
    /// Whole backward.
    pub backward: f64,
    /// Input-gradient part of the backward.
    pub backward_input: f64,
    /// Weight-gradient part of the backward.
    pub backward_weight: f64,
}

impl Default for Costs {
    /// Backward twice a forward, split evenly between input and weight gradients.
    fn default() -> Self {
        Costs {
            forward: 1.0,
            backward: 2.0,
            backward_input: 1.0,
            backward_weight: 1.0,
        }
    }
}

impl Costs {
    fn of(&self, kind: ActionKind) -> f64 {
        match kind {
            ActionKind::Forward => self.forward,
            ActionKind::Backward => self.backward,
            ActionKind::BackwardInput => self.backward_input,
            ActionKind::BackwardWeight => self.backward_weight,
            _ => 0.0,
        }
    }
}

/// A compute action placed in time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slot {
    /// The action.
    pub action: Action,
    /// Start and end time.
    pub start: f64,
    /// End time.
    pub end: f64,
}

/// A schedule played with [`Costs`].
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// Per rank, its compute actions in time.
    pub ranks: Vec<Vec<Slot>>,
    /// End of the last action.
    pub makespan: f64,
    /// Per rank, the most micro-batches whose activations it held at once (forwarded, weight
    /// gradient not yet done), summed over its chunks.
    pub peak_in_flight: Vec<usize>,
}

impl Timeline {
    /// Per rank, the idle fraction of the makespan.
    pub fn bubbles(&self) -> Vec<f64> {
        self.ranks
            .iter()
            .map(|slots| {
                let busy: f64 = slots.iter().map(|s| s.end - s.start).sum();
                1.0 - busy / self.makespan
            })
            .collect()
    }
}

/// Times a schedule (validate it first: an invalid one is reported as an error here too).
pub fn simulate(schedule: &Schedule, costs: &Costs) -> Result<Timeline, ScheduleError> {
    validate(schedule)?;
    let s = schedule;
    let mut next = vec![0; s.pp];
    let mut clock = vec![0.0f64; s.pp];
    // When each message is sent (its producing compute finished).
    let mut sent: HashMap<(usize, usize, Message), VecDeque<f64>> = HashMap::new();
    let mut done_at: HashMap<(ActionKind, usize, usize), f64> = HashMap::new();
    let mut ranks: Vec<Vec<Slot>> = vec![vec![]; s.pp];
    let mut in_flight = vec![0usize; s.pp];
    let mut peak = vec![0usize; s.pp];
    loop {
        let mut moved = false;
        for rank in 0..s.pp {
            while let Some(a) = s.ranks[rank].get(next[rank]) {
                let stage = s.stage_of(rank, a.chunk);
                if a.is_compute() {
                    let start = clock[rank];
                    let end = start + costs.of(a.kind);
                    clock[rank] = end;
                    done_at.insert((a.kind, a.micro, stage), end);
                    ranks[rank].push(Slot {
                        action: *a,
                        start,
                        end,
                    });
                    match a.kind {
                        ActionKind::Forward => {
                            in_flight[rank] += 1;
                            peak[rank] = peak[rank].max(in_flight[rank]);
                        }
                        ActionKind::Backward | ActionKind::BackwardWeight => in_flight[rank] -= 1,
                        _ => {}
                    }
                } else {
                    let (msg, peer, send) = message_of(s, rank, a).expect("validated");
                    if send {
                        sent.entry((rank, peer, msg))
                            .or_default()
                            .push_back(clock[rank]);
                    } else {
                        match sent.get_mut(&(peer, rank, msg)).and_then(|q| q.pop_front()) {
                            Some(t) => clock[rank] = clock[rank].max(t),
                            None => break,
                        }
                    }
                }
                next[rank] += 1;
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    let makespan = clock.iter().copied().fold(0.0, f64::max);
    Ok(Timeline {
        ranks,
        makespan,
        peak_in_flight: peak,
    })
}

/// Zero-bubble H1 compute orders, by simulating unit-cost forward, input-gradient and
/// weight-gradient work: whenever a rank is free it runs an input gradient that is ready (the
/// critical path), else a forward if it holds fewer than `p - r` micro-batches (1F1B's memory),
/// else a deferred weight gradient, which is what fills 1F1B's bubbles.
pub(crate) fn zero_bubble_h1(p: usize, m: usize) -> Vec<Vec<Action>> {
    const NEVER: usize = usize::MAX;
    // Finish times (in unit steps) per (rank, micro).
    let mut forward_end = vec![vec![NEVER; m]; p];
    let mut input_end = vec![vec![NEVER; m]; p];
    let mut weight_done = vec![vec![false; m]; p];
    let mut orders: Vec<Vec<Action>> = vec![vec![]; p];
    let mut next_forward = vec![0; p];
    let mut next_input = vec![0; p];
    let mut next_weight = vec![0; p];
    let mut t = 0;
    while (0..p).any(|r| next_weight[r] < m) {
        // Every unit step some rank can work: 3 m p steps bound any correct run.
        assert!(
            t <= 3 * m * p + 3 * p,
            "zero-bubble generator made no progress"
        );
        for r in 0..p {
            let in_flight = next_forward[r] - next_weight[r];
            let i = next_input[r];
            let input_ready = i < next_forward[r]
                && forward_end[r][i] <= t
                && (r + 1 == p || input_end[r + 1][i] <= t);
            let f = next_forward[r];
            let forward_ready =
                f < m && in_flight < p - r && (r == 0 || forward_end[r - 1][f] <= t);
            if input_ready {
                input_end[r][i] = t + 1;
                next_input[r] += 1;
                orders[r].push(Action::new(ActionKind::BackwardInput, i, 0));
            } else if forward_ready {
                forward_end[r][f] = t + 1;
                next_forward[r] += 1;
                orders[r].push(Action::new(ActionKind::Forward, f, 0));
            } else if next_weight[r] < next_input[r] {
                let w = next_weight[r];
                weight_done[r][w] = true;
                next_weight[r] += 1;
                orders[r].push(Action::new(ActionKind::BackwardWeight, w, 0));
            }
        }
        t += 1;
    }
    orders
}

/// The seed's time x stage table of a timeline: one row per time unit of `unit`, one column
/// per rank; `F3` forward of micro-batch 3, `B3` backward, `I3`/`W3` its input/weight parts,
/// `.3` on chunk suffixes for interleaved schedules, `-` idle.
pub fn render_table(timeline: &Timeline, unit: f64) -> String {
    let steps = (timeline.makespan / unit).round() as usize;
    let p = timeline.ranks.len();
    let mut grid = vec![vec!["-".to_string(); p]; steps];
    for (r, slots) in timeline.ranks.iter().enumerate() {
        for slot in slots {
            let a = (slot.start / unit).round() as usize;
            let b = (slot.end / unit).round() as usize;
            for row in grid.iter_mut().take(b).skip(a) {
                row[r] = slot.action.to_string();
            }
        }
    }
    let mut out = String::from("time");
    for r in 0..p {
        out += &format!(" {:>6}", format!("rank{r}"));
    }
    out.push('\n');
    for (t, row) in grid.iter().enumerate() {
        out += &format!("{t:>4}");
        for cell in row {
            out += &format!(" {cell:>6}");
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
#[path = "simulate_tests.rs"]
mod tests;
