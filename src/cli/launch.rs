//! `flashover launch -n N [--engine mpi|nccl] -- ARGS`: N local processes of this program, one
//! rank each.
//!
//! - `mpi`: through `mpirun --tag-output` (needs the `mpi` feature and Open MPI).
//! - `nccl`: this launcher starts the processes itself with torchrun-style variables (`RANK`,
//!   `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR=127.0.0.1`, a free `MASTER_PORT`) and a fresh
//!   job token (`FLASHOVER_RDZV_TOKEN`) for the TCP rendezvous, prefixes every output line
//!   with its rank, and stops all processes as soon as one fails.
//! - `threads`: the ranks as threads of this process (`train` only); with `--elastic` a failed
//!   rank's job continues on the survivors (`flashover::train::train_elastic`).
//!
//! `--elastic` with `mpi` starts `mpirun` again on the survivors when it fails.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

/// Runs the launch; `engine` defaults to `threads` with `elastic`, else to `mpi` when built
/// with it, else `nccl`.
pub fn run(n: usize, engine: Option<&str>, elastic: bool, args: &[String]) -> Result<(), String> {
    if n == 0 {
        return Err("-n must be at least 1".into());
    }
    let default = match (elastic, cfg!(feature = "mpi")) {
        (true, _) => "threads",
        (false, true) => "mpi",
        (false, false) => "nccl",
    };
    let engine = engine.unwrap_or(default);
    if elastic && engine == "nccl" {
        return Err(
            "--elastic --engine nccl: use --engine mpi (processes restarted through \
                    mpirun) or threads"
                .into(),
        );
    }
    let exe = std::env::current_exe().map_err(|e| format!("finding this program: {e}"))?;
    match engine {
        "mpi" if elastic => elastic_mpirun(n, &exe, args),
        "mpi" => through_mpirun(n, &exe, args),
        "nccl" => spawn_ranks(n, &exe, args),
        "threads" => in_threads(n, elastic, args),
        other => Err(format!("--engine `{other}`: expected mpi, nccl or threads")),
    }
}

/// `train ARGS` with its ranks as threads here, checked to use `n` ranks.
fn in_threads(n: usize, elastic: bool, args: &[String]) -> Result<(), String> {
    let (job, mut outputs) = parse_train(args, "--engine threads")?;
    let world = job.build()?.mesh()?.world_size();
    if world != n {
        return Err(format!(
            "-n {n}, but the job's mesh has {world} ranks: give a mesh of {n} ranks (--mesh)"
        ));
    }
    outputs.elastic |= elastic;
    super::job::train(&job, *outputs)
}

/// `args` as the `train` command line (`what` needs one).
fn parse_train(
    args: &[String],
    what: &str,
) -> Result<(super::job::JobArgs, Box<super::job::TrainOutputs>), String> {
    use clap::Parser;
    let argv = std::iter::once("flashover").chain(args.iter().map(String::as_str));
    match super::Cli::try_parse_from(argv)
        .map_err(|e| e.to_string())?
        .command
    {
        super::Command::Train { job, outputs } => Ok((job, outputs)),
        _ => Err(format!(
            "{what} runs `train` (flashover launch -n N -- train ...)"
        )),
    }
}

fn through_mpirun(n: usize, exe: &std::path::Path, args: &[String]) -> Result<(), String> {
    if !cfg!(feature = "mpi") {
        return Err("--engine mpi: this build has no MPI engine: build with --features mpi".into());
    }
    // --oversubscribe: a laptop may have fewer cores than ranks.
    let mut child = Command::new("mpirun")
        .args(["--oversubscribe", "--tag-output", "-np", &n.to_string()])
        .arg(exe)
        .args(args)
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting mpirun (is Open MPI installed?): {e}"))?;
    // Passed through as it comes; the first rank to fail says so on it (the MPI engine's
    // abandon), which names the job's failure.
    let stderr = child.stderr.take().expect("piped");
    let cause = std::thread::spawn(move || {
        let mut cause = None;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("{line}");
            if cause.is_none()
                && let Some(at) = line.find("flashover: rank ")
                && line.contains(" failed (")
            {
                cause = Some(line[at + "flashover: ".len()..].to_string());
            }
        }
        cause
    });
    let status = child
        .wait()
        .map_err(|e| format!("waiting for mpirun: {e}"))?;
    let cause = cause.join().ok().flatten();
    if status.success() {
        Ok(())
    } else {
        Err(cause.unwrap_or_else(|| format!("the job failed ({status})")))
    }
}

/// `mpirun` of `train ARGS` on `n` processes; when it fails (a process died, so mpirun
/// stopped the others), again on the survivors: a mesh chosen for them
/// (`flashover::train::survivor_mesh`), resumed from the newest committed checkpoint, without
/// the `--kill` drills (they fired), each restart printed.
fn elastic_mpirun(n: usize, exe: &std::path::Path, args: &[String]) -> Result<(), String> {
    let (job, outputs) = parse_train(args, "--elastic")?;
    let config = job.build()?;
    let mut args = args.to_vec();
    let dir = match outputs.checkpoint_dir(&config) {
        Some(dir) => dir,
        None if outputs.saves(&config) => {
            // Every process must write to the same place: the launcher chooses it.
            let dir = super::job::elastic_checkpoint_dir();
            println!(
                "elastic: checkpoints in {} (--ckpt-dir to choose)",
                dir.display()
            );
            args.extend(["--ckpt-dir".to_string(), dir.display().to_string()]);
            dir
        }
        None => {
            return Err("--elastic resumes from checkpoints: give train --save-every".into());
        }
    };
    let (mut world, mut config) = (n, config);
    for restart in 0.. {
        match through_mpirun(world, exe, &args) {
            Ok(()) => return Ok(()),
            Err(e) => {
                let options = flashover::train::ElasticOptions {
                    min_ranks: outputs.min_ranks(),
                    max_restarts: outputs.max_restarts(),
                };
                let next = flashover::train::next_attempt(&config, options, restart, &e, &dir)?;
                let (mesh, reason) = (next.mesh, next.reason);
                let resumed = next.checkpoint.map(|(step, _)| step);
                println!(
                    "elastic restart: {e}; {} -> {mesh}; resuming from step {}{}",
                    config.parallel.mesh,
                    resumed.unwrap_or(0),
                    reason.map_or(String::new(), |r| format!("; {r}"))
                );
                world = mesh
                    .parse::<flashover::DeviceMesh>()
                    .map_err(|e| e.to_string())?
                    .world_size();
                args = relaunch_args(&args, &mesh, resumed.map(|_| dir.as_path()));
                config.parallel.mesh = mesh;
            }
        }
    }
    unreachable!("the loop returns")
}

/// `args` with `--mesh mesh`, `--resume dir` (when given) and no `--kill` or `--stall` drills
/// or `--resume` of their own.
fn relaunch_args(args: &[String], mesh: &str, resume: Option<&std::path::Path>) -> Vec<String> {
    let mut out = vec![];
    let mut skip_value = false;
    for arg in args {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        let flag = arg.split('=').next().unwrap_or("");
        if ["--mesh", "--kill", "--stall", "--resume"].contains(&flag) {
            skip_value = !arg.contains('=');
            continue;
        }
        out.push(arg.clone());
    }
    out.extend(["--mesh".to_string(), mesh.to_string()]);
    if let Some(dir) = resume {
        out.extend(["--resume".to_string(), dir.display().to_string()]);
    }
    out
}

/// A secret for this job's rendezvous: 16 random bytes, hex.
fn job_token() -> Result<String, String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| format!("reading /dev/urandom for the job token: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// A port free right now on the loopback interface.
fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("finding a free port: {e}"))
}

/// Copies `from` to our stdout or stderr, each line prefixed with the rank.
fn forward(rank: usize, from: impl Read + Send + 'static, to_stderr: bool) {
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines().map_while(Result::ok) {
            if to_stderr {
                eprintln!("[rank {rank}] {line}");
            } else {
                println!("[rank {rank}] {line}");
            }
        }
    });
}

fn spawn_ranks(n: usize, exe: &std::path::Path, args: &[String]) -> Result<(), String> {
    let (token, port) = (job_token()?, free_port()?);
    let mut children: Vec<Child> = Vec::with_capacity(n);
    for rank in 0..n {
        let mut child = Command::new(exe)
            .args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("FLASHOVER_RDZV_TOKEN", &token)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting rank {rank}: {e}"))?;
        forward(rank, child.stdout.take().expect("piped"), false);
        forward(rank, child.stderr.take().expect("piped"), true);
        children.push(child);
    }
    // Wait for all; the first failure stops the rest.
    let mut done: Vec<Option<ExitStatus>> = vec![None; n];
    loop {
        for (rank, child) in children.iter_mut().enumerate() {
            if done[rank].is_none()
                && let Some(status) = child.try_wait().map_err(|e| e.to_string())?
            {
                done[rank] = Some(status);
                if !status.success() {
                    for other in children.iter_mut() {
                        let _ = other.kill();
                        let _ = other.wait();
                    }
                    // Let the forwarders flush what the ranks printed.
                    std::thread::sleep(Duration::from_millis(200));
                    return Err(format!(
                        "rank {rank} failed ({status}); stopped the other {} rank(s)",
                        n - 1
                    ));
                }
            }
        }
        if done.iter().all(Option::is_some) {
            std::thread::sleep(Duration::from_millis(100));
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
