//! The `flashover` command line: argument definitions (clap) and their handlers.

mod bench;
mod ckpt;
mod job;
mod launch;
mod plan;

use clap::{Parser, Subcommand};

/// Train one Burn model on many accelerators.
#[derive(Debug, Parser)]
#[command(name = "flashover", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Measure the collective layer and the machine.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Train the reference transformer on simulated ranks (threads), data parallel over `dp`.
    Train {
        /// Job options.
        #[command(flatten)]
        job: job::JobArgs,
        /// Logs, traces and checkpoints.
        #[command(flatten)]
        outputs: Box<job::TrainOutputs>,
    },
    /// Start N local processes of this program, one rank each:
    /// `flashover launch -n 4 -- train --mesh dp=2,tp=2`. Output lines carry the rank; if one
    /// process fails, all are stopped and the exit code is non-zero.
    Launch {
        /// Number of processes.
        #[arg(short = 'n', long)]
        n: usize,
        /// `mpi` (through mpirun; the default when built with the `mpi` feature), `nccl`
        /// (torchrun-style variables and the TCP rendezvous) or `threads` (the ranks as
        /// threads of this process; the default with --elastic).
        #[arg(long)]
        engine: Option<String>,
        /// Keep training when a rank fails: continue on the survivors, on a mesh chosen for
        /// them, from the newest committed checkpoint (`train` with --save-every). With
        /// `--engine mpi`, mpirun is started again on the survivors.
        #[arg(long)]
        elastic: bool,
        /// Elastic: give up when fewer ranks than this survive (passed to `train`).
        #[arg(long, requires = "elastic")]
        min_ranks: Option<usize>,
        /// Elastic: give up after this many restarts (passed to `train`).
        #[arg(long, requires = "elastic")]
        max_restarts: Option<usize>,
        /// The command line for every process (after `--`).
        #[arg(last = true, required = true)]
        args: Vec<String>,
    },
    /// Inspect, reshard and export training checkpoints.
    #[command(subcommand)]
    Ckpt(ckpt::CkptCommand),
    /// Train on one rank and on the given mesh; compare losses, gradient norms and parameters.
    Verify {
        /// Job options.
        #[command(flatten)]
        job: job::JobArgs,
        /// Largest relative difference accepted (default 1e-5 in f32; 5e-3 in f32 on a device
        /// whose f32 matmuls measure as TF32, as CUDA's do; 5e-2 under a reduced-precision
        /// policy, whose rounding differs between layouts).
        #[arg(long)]
        tolerance: Option<f64>,
    },
    /// Device meshes.
    #[command(subcommand)]
    Mesh(MeshCommand),
    /// Propose meshes for a model on a cluster: valid layouts that fit, ranked by estimated
    /// throughput, with memory and time breakdowns (`--explain` draws the placement).
    Plan(Box<plan::PlanArgs>),
    /// Job files.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Read what a failed job left behind.
    #[command(subcommand)]
    Debug(DebugCommand),
    /// Print a pipeline schedule as a time x stage table, with its bubbles.
    PpSchedule {
        /// Pipeline ranks.
        #[arg(long)]
        pp: usize,
        /// Micro-batches per step.
        #[arg(long)]
        microbatches: usize,
        /// gpipe, 1f1b, interleaved or zb-h1.
        #[arg(long, default_value = "1f1b")]
        schedule: String,
        /// Model chunks per rank (interleaved only).
        #[arg(long, default_value_t = 2)]
        chunks: usize,
    },
}

/// `flashover config ...`.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Report every invalid or inconsistent field of a job file at once, with its path.
    Check {
        /// The TOML job file (`train --config` takes the same).
        file: std::path::PathBuf,
    },
}

/// `flashover debug ...`.
#[derive(Debug, Subcommand)]
pub enum DebugCommand {
    /// Which rank stopped at which collective, and which ranks were waiting for it, from the
    /// flight records failing ranks wrote (`FLASHOVER_FLIGHT_DIR`).
    Flight {
        /// The directory holding the `flight-rank*.json` files.
        dir: std::path::PathBuf,
    },
}

/// `flashover mesh ...`.
#[derive(Debug, Subcommand)]
pub enum MeshCommand {
    /// Draw a mesh: every rank's coordinates and the groups along each axis.
    Show {
        /// The mesh, e.g. `dp=2,tp=2` (axes pp, dp, fsdp, ep, cp, tp).
        #[arg(long)]
        mesh: String,
        /// Check that the mesh uses exactly this many ranks.
        #[arg(long)]
        world: Option<usize>,
    },
}

/// Runs the parsed command.
pub fn run(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Bench(b) => bench::run(b),
        Command::Train { job, outputs } => job::train(&job, *outputs),
        Command::Ckpt(c) => ckpt::run(c),
        Command::Debug(DebugCommand::Flight { dir }) => {
            let dumps =
                flashover_comm::read_dumps(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            if dumps.is_empty() {
                return Err(format!("{}: no flight-rank*.json files", dir.display()));
            }
            let ranks: Vec<String> = dumps.iter().map(|d| d.rank.to_string()).collect();
            println!("flight records of ranks {}", ranks.join(", "));
            let findings = flashover_comm::diagnose(&dumps);
            if findings.is_empty() {
                println!("every recorded call completed");
            }
            for line in findings {
                println!("{line}");
            }
            Ok(())
        }
        Command::Launch {
            n,
            engine,
            elastic,
            min_ranks,
            max_restarts,
            mut args,
        } => {
            for (flag, value) in [("--min-ranks", min_ranks), ("--max-restarts", max_restarts)] {
                if let Some(value) = value {
                    args.extend([flag.to_string(), value.to_string()]);
                }
            }
            launch::run(n, engine.as_deref(), elastic, &args)
        }
        Command::Verify { job, tolerance } => {
            if !job::verify(&job, tolerance)? {
                // The last line printed is the verdict; the exit code says it too.
                std::process::exit(1);
            }
            Ok(())
        }
        Command::PpSchedule {
            pp,
            microbatches,
            schedule,
            chunks,
        } => {
            use flashover_parallel::pipeline::{Costs, Schedule, render_table, simulate};
            let kind = schedule.parse().map_err(|e| format!("--schedule: {e}"))?;
            let schedule = Schedule::build(kind, pp, microbatches, chunks)?;
            let timeline = simulate(&schedule, &Costs::default()).map_err(|e| e.to_string())?;
            println!(
                "{kind:?}: pp={pp}, {microbatches} micro-batches, {} chunk(s) per rank; forward 1, backward 2 (input 1 + weight 1) time units",
                schedule.chunks
            );
            print!("{}", render_table(&timeline, 1.0));
            for (rank, (bubble, peak)) in timeline
                .bubbles()
                .iter()
                .zip(&timeline.peak_in_flight)
                .enumerate()
            {
                println!(
                    "rank {rank}: idle {:.1}% of {} units; at most {peak} micro-batch(es) in flight",
                    bubble * 100.0,
                    timeline.makespan
                );
            }
            Ok(())
        }
        Command::Plan(args) => plan::run(&args),
        Command::Config(ConfigCommand::Check { file }) => {
            if !plan::check(&file)? {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Mesh(MeshCommand::Show { mesh, world }) => {
            let mesh: flashover::DeviceMesh = mesh.parse().map_err(|e| format!("--mesh: {e}"))?;
            if let Some(w) = world {
                mesh.check_world(w).map_err(|e| format!("--mesh: {e}"))?;
            }
            print!("{mesh}");
            Ok(())
        }
    }
}

/// Parses a byte size such as `4096`, `4K`, `64M` or `1G` (powers of 1024).
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (digits, mult) = match s.char_indices().last() {
        Some((i, 'K' | 'k')) => (&s[..i], 1 << 10),
        Some((i, 'M' | 'm')) => (&s[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    digits.parse::<usize>().map(|d| d * mult).map_err(|_| {
        format!("`{s}` is not a byte size: use a number with an optional K, M or G suffix")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn byte_sizes_parse_with_suffixes() {
        assert_eq!(parse_bytes("4K"), Ok(4096));
        assert_eq!(parse_bytes("256M"), Ok(256 << 20));
        assert_eq!(parse_bytes("12"), Ok(12));
        assert!(parse_bytes("4X").unwrap_err().contains("not a byte size"));
    }

    #[test]
    fn the_cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
