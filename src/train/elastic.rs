//! Elastic training: when a rank dies or stalls, keep training on the survivors.
//!
//! The job runs; when a rank fails (a panic, an error, or a collective that timed out waiting
//! for it), every rank stops (the collectives fail fast, naming the missing rank), and the
//! driver chooses a mesh for the surviving world ([`survivor_mesh`]), resumes from the newest
//! committed checkpoint on it and continues. Checkpoints reshard onto any mesh, and batches
//! and random streams are pure functions of `(seed, step)`, so from the resumed step on the
//! run sees exactly what an uninterrupted run on the new mesh resumed from that checkpoint
//! sees. What is redone: the steps since that checkpoint.
//!
//! Here ranks are threads of one process (the threads engine): a restart is a new launch of
//! the survivors' world in the same process. A process launcher plugs into the same path by
//! relaunching with the mesh and `--resume` this module chooses.

use super::config::TrainConfig;
use super::report::{StepRecord, TrainReport};
use super::run::{JobFailure, run_job};
use flashover_runtime::{Axis, DeviceMesh};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// How far an elastic run may shrink and how often it may restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElasticOptions {
    /// Give up when fewer ranks than this survive.
    pub min_ranks: usize,
    /// Give up after this many restarts.
    pub max_restarts: usize,
}

impl Default for ElasticOptions {
    fn default() -> Self {
        ElasticOptions {
            min_ranks: 1,
            max_restarts: 3,
        }
    }
}

/// One restart: why, from which mesh to which, and what was redone.
#[derive(Debug, Clone, PartialEq)]
pub struct Restart {
    /// The rank that failed first (numbered in the old mesh).
    pub failed_rank: usize,
    /// How it failed (and how many ranks failed with it).
    pub cause: String,
    /// The mesh it failed on.
    pub old_mesh: String,
    /// The mesh training continues on.
    pub new_mesh: String,
    /// Why the new mesh leaves survivors idle or changes a model-parallel degree, if it does.
    pub reason: Option<String>,
    /// Steps completed when it failed (the last reported step + 1).
    pub completed: usize,
    /// The step training resumes from (the newest committed checkpoint's; 0 without one).
    pub resumed_from: usize,
}

impl fmt::Display for Restart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "restart: {}; {} -> {}; resuming from step {} ({} step(s) redone)",
            self.cause,
            self.old_mesh,
            self.new_mesh,
            self.resumed_from,
            self.completed.saturating_sub(self.resumed_from)
        )?;
        if let Some(reason) = &self.reason {
            write!(f, "; {reason}")?;
        }
        Ok(())
    }
}

/// The report of the attempt that finished, and every restart before it.
#[derive(Debug, Clone)]
pub struct ElasticReport {
    /// The final attempt's report (its steps are those from its resumed step on).
    pub report: TrainReport,
    /// The restarts, in order.
    pub restarts: Vec<Restart>,
}

/// Trains `config` elastically (threads engine): on a rank failure, continues on the
/// survivors from the newest committed checkpoint, telling `on_restart` each time. Needs
/// checkpoints (`checkpoint.dir` and `save_every`). Fails when fewer than `min_ranks`
/// survive, restarts run out, no layout fits the survivors, or the job fails otherwise.
pub fn train_elastic(
    config: &TrainConfig,
    options: ElasticOptions,
    on_step: &(dyn Fn(&StepRecord) + Sync),
    on_restart: &dyn Fn(&Restart),
) -> Result<ElasticReport, String> {
    let dir = match (&config.checkpoint.dir, config.checkpoint.save_every) {
        (Some(dir), every) if every > 0 => dir.clone(),
        _ => {
            return Err(
                "elastic training resumes from checkpoints: set checkpoint.dir and \
                        checkpoint.save_every (--ckpt-dir, --save-every)"
                    .into(),
            );
        }
    };
    let mut config = config.clone();
    let mut restarts = vec![];
    loop {
        let completed = AtomicUsize::new(0);
        let seen = |record: &StepRecord| {
            completed.fetch_max(record.step + 1, Ordering::SeqCst);
            on_step(record);
        };
        let (rank, cause) = match run_job(&config, &seen, None) {
            Ok(Some(report)) => return Ok(ElasticReport { report, restarts }),
            Ok(None) => return Err("rank 0 gave no report".into()),
            Err(JobFailure::Other(message)) => return Err(message),
            Err(JobFailure::Rank { rank, message }) => (rank, message),
        };
        let next = next_attempt(&config, options, restarts.len(), &cause, &dir)?;
        let latest = next.checkpoint;
        let restart = Restart {
            failed_rank: rank,
            cause,
            old_mesh: config.parallel.mesh.clone(),
            new_mesh: next.mesh.clone(),
            reason: next.reason,
            completed: completed.load(Ordering::SeqCst),
            resumed_from: latest.as_ref().map_or(0, |(step, _)| *step as usize),
        };
        on_restart(&restart);
        restarts.push(restart);
        config.parallel.mesh = next.mesh;
        // The save drill (tests) fires in the first attempt only, as the kill drills do.
        config.checkpoint.fail_after_write = None;
        if let Some((_, step_dir)) = latest {
            config.checkpoint.resume = Some(step_dir);
            config.checkpoint.init_from = None;
        }
    }
}

/// Where a run continues after its job failed: the survivors' mesh and the newest committed
/// checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct NextAttempt {
    /// The mesh of the survivors ([`survivor_mesh`]).
    pub mesh: String,
    /// Why it idles survivors or changes a model-parallel degree, if it does.
    pub reason: Option<String>,
    /// The newest committed checkpoint under the run's directory (step and directory), if any.
    pub checkpoint: Option<(u64, PathBuf)>,
}

/// What follows a failure (`cause`) of `config`'s job after `restarts` restarts, one rank
/// lost: the next attempt, or why there is none (no restarts left, too few survivors, no
/// layout fits them). `dir` holds the run's checkpoints. The in-process driver
/// ([`train_elastic`]) and a process launcher decide it here alike.
pub fn next_attempt(
    config: &TrainConfig,
    options: ElasticOptions,
    restarts: usize,
    cause: &str,
    dir: &Path,
) -> Result<NextAttempt, String> {
    if restarts >= options.max_restarts {
        return Err(format!(
            "{cause}; not restarting: {restarts} restart(s) already (max_restarts)"
        ));
    }
    let survivors = config.mesh()?.world_size() - 1;
    if survivors < options.min_ranks {
        return Err(format!(
            "{cause}; not restarting: {survivors} rank(s) survive, fewer than min_ranks = {}",
            options.min_ranks
        ));
    }
    let (mesh, reason) = survivor_mesh(config, survivors, options.min_ranks)
        .map_err(|why| format!("{cause}; not restarting: {why}"))?;
    let checkpoint = flashover_checkpoint::committed(dir)
        .map_err(|e| e.to_string())?
        .into_iter()
        .max_by_key(|(step, _)| *step);
    Ok(NextAttempt {
        mesh,
        reason,
        checkpoint,
    })
}

/// The mesh training continues on with `survivors` ranks: every survivor if a layout fits
/// them, keeping the model-parallel degrees (`tp`, `pp`, `cp`, `ep`) where the survivors
/// divide by them and otherwise the largest divisors of them that do, the data-parallel axes
/// taking the rest; else the most survivors (down to `min_ranks`) that some layout fits. A
/// layout fits when the job's own checks accept it (the global batch splits, the model's
/// widths divide, ...). Returns the mesh and, when it idles survivors or changes a
/// model-parallel degree, why.
pub fn survivor_mesh(
    config: &TrainConfig,
    survivors: usize,
    min_ranks: usize,
) -> Result<(String, Option<String>), String> {
    let old = config.mesh()?;
    let mut first_refusal = None;
    for world in (min_ranks.max(1)..=survivors).rev() {
        for model in model_degrees(&old) {
            let product: usize = model.iter().map(|(_, d)| d).product();
            if !world.is_multiple_of(product) {
                continue;
            }
            let mesh = layout(&old, &model, world / product);
            let mut candidate = config.clone();
            candidate.parallel.mesh = mesh.clone();
            let errors = candidate.validate();
            if let Some(error) = errors.first() {
                first_refusal.get_or_insert_with(|| format!("{mesh}: {error}"));
                continue;
            }
            let changed: Vec<String> = model
                .iter()
                .filter(|(axis, d)| old.degree(*axis) != *d)
                .map(|(axis, d)| format!("{}={} -> {d}", axis.name(), old.degree(*axis)))
                .collect();
            let mut why = vec![];
            if world < survivors {
                why.push(format!(
                    "{} of {survivors} survivors idle: no layout of {survivors} ranks fits \
                     ({})",
                    survivors - world,
                    first_refusal
                        .as_deref()
                        .unwrap_or("the model-parallel degrees")
                ));
            }
            if !changed.is_empty() {
                why.push(format!("{} to fit the survivors", changed.join(", ")));
            }
            let reason = (!why.is_empty()).then(|| why.join("; "));
            return Ok((mesh, reason));
        }
    }
    Err(format!(
        "no layout fits {min_ranks}..={survivors} ranks ({})",
        first_refusal.unwrap_or_else(|| "no degrees divide them".into())
    ))
}

/// The model-parallel axes with their degrees to try, the old ones first, then with `tp`,
/// `cp`, `pp` and `ep` (in that order of preference to keep) reduced to smaller divisors.
fn model_degrees(old: &DeviceMesh) -> Vec<Vec<(Axis, usize)>> {
    // Most preferred to keep first: the sort below then changes the last ones first.
    let axes = [Axis::Tp, Axis::Cp, Axis::Pp, Axis::Ep];
    let divisors =
        |n: usize| -> Vec<usize> { (1..=n).rev().filter(|d| n.is_multiple_of(*d)).collect() };
    let mut all: Vec<Vec<(Axis, usize)>> = vec![vec![]];
    for axis in axes {
        all = all
            .into_iter()
            .flat_map(|prefix| {
                divisors(old.degree(axis)).into_iter().map(move |d| {
                    let mut next = prefix.clone();
                    next.push((axis, d));
                    next
                })
            })
            .collect();
    }
    // Fewest changed axes first, then the least-preferred axes changed first, then the
    // largest degrees.
    let changed = |m: &Vec<(Axis, usize)>| {
        let flags: Vec<bool> = m.iter().map(|(a, d)| old.degree(*a) != *d).collect();
        (flags.iter().filter(|f| **f).count(), flags)
    };
    all.sort_by_key(|m| {
        let (count, flags) = changed(m);
        let size: usize = m.iter().map(|(_, d)| d).product();
        (count, flags, std::cmp::Reverse(size))
    });
    all
}

/// A mesh with the model-parallel `model` degrees and `data` ranks over the data axes: as the
/// old mesh split them (fully sharded ranks kept when `data` divides by them), the rest `dp`.
fn layout(old: &DeviceMesh, model: &[(Axis, usize)], data: usize) -> String {
    let old_fsdp = old.degree(Axis::Fsdp);
    let fsdp = if old.degree(Axis::Dp) == 1 && old_fsdp > 1 {
        data
    } else if old_fsdp > 1 && data.is_multiple_of(old_fsdp) {
        old_fsdp
    } else {
        1
    };
    let degree = |axis: Axis| match axis {
        Axis::Dp => data / fsdp,
        Axis::Fsdp => fsdp,
        other => model
            .iter()
            .find(|(a, _)| *a == other)
            .map_or(1, |(_, d)| *d),
    };
    let parts: Vec<String> = Axis::ALL
        .iter()
        .filter(|&&a| degree(a) > 1)
        .map(|&a| format!("{}={}", a.name(), degree(a)))
        .collect();
    if parts.is_empty() {
        "dp=1".into()
    } else {
        parts.join(",")
    }
}
