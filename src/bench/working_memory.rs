//! The heap a training step works in: its peak above what was live when the previous step
//! ended (activations, gradients, attention blocks; parameters and optimizer state are the
//! baseline), counted by [`flashover::heap::Allocator`] while a job runs.

use flashover::heap;
use flashover::train::{StepRecord, TrainConfig, TrainReport, train};
use std::sync::Mutex;

/// A job's report with its steps' working memory.
pub struct Measured {
    /// The job's report.
    pub report: TrainReport,
    /// Largest working heap of steps 1.. (step 0 also counts building the model), bytes, for
    /// the whole process (every rank thread).
    pub working_bytes: usize,
    /// Median step time of steps 1.. (seconds).
    pub step_s: f64,
}

/// Runs `config` (at least 2 steps: the first warms up) and measures its steps.
pub fn measure(config: &TrainConfig) -> Result<Measured, String> {
    if !heap::counting() {
        return Err("this benchmark measures the heap: run it from the flashover binary, which installs the counting allocator".into());
    }
    let mut c = config.clone();
    c.run.steps = c.run.steps.max(2);
    c.run.log_jsonl = None;
    // Entry i: step i's peak above what was live when step i - 1 ended (read on rank 0 once
    // the step's statistics are gathered, so every rank has finished it).
    let peaks = Mutex::new(vec![]);
    let on_step = |_: &StepRecord| {
        let mut peaks = peaks.lock().expect("peaks");
        let peak = heap::peak_bytes();
        let base = heap::reset_peak();
        peaks.push(peak.saturating_sub(base));
    };
    heap::reset_peak();
    let report = train(&c, &on_step)?;
    let peaks = peaks.into_inner().expect("peaks");
    let mut times: Vec<f64> = report.steps[1..].iter().map(|s| s.step_time_s).collect();
    times.sort_by(f64::total_cmp);
    Ok(Measured {
        working_bytes: peaks[1..].iter().copied().max().unwrap_or(0),
        step_s: times[times.len() / 2],
        report,
    })
}
