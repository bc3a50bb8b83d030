//! `flashover ckpt`: inspect, reshard and export training checkpoints.

use clap::Subcommand;
use flashover_checkpoint::Checkpoint;
use std::path::PathBuf;

/// `flashover ckpt ...`.
#[derive(Debug, Subcommand)]
pub enum CkptCommand {
    /// Tensors, shapes, shards, mesh, step, sizes and checksum status of a checkpoint.
    Inspect {
        /// A `step-*` directory, or a directory of them (the newest).
        dir: PathBuf,
    },
    /// Rewrite a checkpoint as saved by another mesh (and ZeRO stage), offline.
    Reshard {
        /// The checkpoint to read.
        dir: PathBuf,
        /// The new mesh, e.g. `fsdp=2` or `dp=2,tp=2`.
        #[arg(long)]
        mesh: String,
        /// The new ZeRO stage (default: the saved one).
        #[arg(long)]
        zero: Option<u8>,
        /// Where the new checkpoint goes (a checkpoint root directory).
        out: PathBuf,
    },
    /// The model's parameters, whole, as one safetensors file ordinary Burn code can load.
    Export {
        /// The checkpoint to read.
        dir: PathBuf,
        /// The file to write.
        out: PathBuf,
    },
}

/// Runs a `ckpt` subcommand.
pub fn run(cmd: CkptCommand) -> Result<(), String> {
    match cmd {
        CkptCommand::Inspect { dir } => inspect(&dir),
        CkptCommand::Reshard {
            dir,
            mesh,
            zero,
            out,
        } => {
            let path = flashover::train::checkpoint::reshard(&dir, &mesh, zero, &out)?;
            println!("wrote {}", path.display());
            Ok(())
        }
        CkptCommand::Export { dir, out } => {
            let ckpt = Checkpoint::open(&dir).map_err(|e| e.to_string())?;
            let n = flashover::train::checkpoint::export(&ckpt, &out)?;
            println!(
                "wrote {n} tensors of step {} to {}",
                ckpt.step(),
                out.display()
            );
            Ok(())
        }
    }
}

fn inspect(dir: &std::path::Path) -> Result<(), String> {
    let ckpt = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    let index = ckpt.index();
    let run = &index.run;
    println!("checkpoint {}", ckpt.dir().display());
    println!(
        "step {}; mesh {}; zero {}; seed {}",
        index.step,
        run.get("mesh").and_then(|v| v.as_str()).unwrap_or("?"),
        run.get("zero").map_or("?".into(), |v| v.to_string()),
        run.get("seed").map_or("?".into(), |v| v.to_string()),
    );
    println!("\n| file | bytes | checksum |\n|---|---:|---|");
    let mut bad = 0;
    let mut total = 0;
    for (name, bytes, ok) in ckpt.verify() {
        total += bytes;
        bad += (!ok) as usize;
        println!(
            "| {name} | {bytes} | {} |",
            if ok { "ok" } else { "MISMATCH" }
        );
    }
    println!("\n| tensor | shape | pieces |\n|---|---|---:|");
    for (name, t) in &index.tensors {
        println!("| {name} | {:?} | {} |", t.shape, t.pieces.len());
    }
    println!(
        "\n{} tensors in {} files, {total} bytes; checksums: {}",
        index.tensors.len(),
        index.files.len(),
        if bad == 0 {
            "all ok".to_string()
        } else {
            format!("{bad} file(s) corrupt")
        }
    );
    if bad > 0 {
        return Err(format!("{bad} corrupt file(s) in {}", ckpt.dir().display()));
    }
    Ok(())
}
