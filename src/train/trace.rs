//! `train --trace PATH`: every rank's steps, and with a pipeline every forward, backward and
//! receive wait, as Chrome trace JSON (one track per rank; open it in Perfetto).

use flashover_parallel::pipeline::{Action, ActionKind};
use flashover_runtime::{CommunicatorExt, RankContext, RankError, control};
use std::path::Path;
use std::time::Instant;

/// Events of one rank, as `[kind, micro, chunk, step, start_us, end_us]` (kind: 0 step,
/// 1 forward, 2 backward, 3 input gradient, 4 weight gradient, 5 receive wait).
pub struct Trace {
    origin: Instant,
    events: Vec<[f64; 6]>,
}

fn code(kind: ActionKind) -> f64 {
    match kind {
        ActionKind::Forward => 1.0,
        ActionKind::Backward => 2.0,
        ActionKind::BackwardInput => 3.0,
        ActionKind::BackwardWeight => 4.0,
        _ => 5.0,
    }
}

fn name(code: f64, micro: f64, chunk: f64, step: f64) -> String {
    let tag = match code as u8 {
        0 => return format!("step {step}"),
        1 => "F",
        2 => "B",
        3 => "I",
        4 => "W",
        _ => "wait",
    };
    if chunk > 0.0 {
        format!("{tag}{micro}.{chunk}")
    } else {
        format!("{tag}{micro}")
    }
}

impl Trace {
    /// Times are measured from `origin` (shared by every rank thread).
    pub fn new(origin: Instant) -> Self {
        Trace {
            origin,
            events: vec![],
        }
    }

    fn us(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.origin).as_secs_f64() * 1e6
    }

    /// Step `step` ran from `start` to `end`, with these pipeline events.
    pub fn record_step(
        &mut self,
        step: usize,
        start: Instant,
        end: Instant,
        actions: Vec<(Action, Instant, Instant)>,
    ) {
        let s = step as f64;
        self.events
            .push([0.0, 0.0, 0.0, s, self.us(start), self.us(end)]);
        for (a, t0, t1) in actions {
            self.events.push([
                code(a.kind),
                a.micro as f64,
                a.chunk as f64,
                s,
                self.us(t0),
                self.us(t1),
            ]);
        }
    }

    /// Gathers every rank's events (collective) and writes the file on rank 0.
    pub fn write(&self, ctx: &RankContext, path: &Path) -> Result<(), RankError> {
        let world = ctx.world();
        let mut longest = [self.events.len() as u64];
        control(|| world.all_reduce(&mut longest, flashover_runtime::ReduceOp::Max))?;
        let width = longest[0] as usize * 6;
        let mut mine: Vec<f64> = self.events.iter().flatten().copied().collect();
        // Padding rows have kind -1.
        while mine.len() < width {
            mine.extend([-1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        }
        let all = control(|| world.all_gather_vec(&mine))?;
        if ctx.rank() != 0 {
            return Ok(());
        }
        let mut events = vec![];
        for (rank, rows) in all.chunks(width.max(1)).enumerate() {
            for e in rows.chunks(6).filter(|e| e[0] >= 0.0) {
                events.push(serde_json::json!({
                    "name": name(e[0], e[1], e[2], e[3]),
                    "cat": if e[0] == 0.0 { "step" } else { "pipeline" },
                    "ph": "X",
                    "ts": e[4],
                    "dur": e[5] - e[4],
                    "pid": 0,
                    "tid": rank,
                }));
            }
        }
        let json = serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" });
        std::fs::write(path, json.to_string())
            .map_err(|e| format!("run.trace {}: {e}", path.display()))?;
        Ok(())
    }
}
