//! `flashover launch` without MPI: it starts the ranks with torchrun-style variables and a job
//! token, prefixes their output with the rank, and when ranks fail (here: no GPU for NCCL, or
//! no engine in this build) it stops them all and exits non-zero quickly, with the reason.

use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn failing_ranks_end_the_launch_fast_with_their_reason() {
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_flashover"))
        .args([
            "launch", "-n", "2", "--engine", "nccl", "--", "train", "--mesh", "dp=2",
        ])
        .args(["--steps", "2"])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(started.elapsed() < Duration::from_secs(30), "{text}");
    assert!(
        text.contains("failed") && text.contains("stopped the other 1 rank(s)"),
        "{text}"
    );
    // The ranks saw the variables the launcher set, and said why they could not start.
    assert!(
        text.contains("[rank "),
        "output is prefixed by rank: {text}"
    );
    assert!(
        text.contains("cannot be loaded") || text.contains("no engine for one rank per process"),
        "{text}"
    );
}
