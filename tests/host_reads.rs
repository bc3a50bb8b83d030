//! Every read of a tensor's values to the host in the step's code goes through
//! `flashover_runtime::transfers::read` or `read_scalar`, which count it by cause: on a GPU a
//! read waits for the device's queue, so an uncounted one would be a stall nobody sees. This
//! test reads the sources of the code a step runs (flashover-parallel, flashover-models, the
//! trainer and the Learner) and fails on a read written any other way, outside tests and
//! comments. The collective layer (flashover-runtime) counts its staging itself.

use std::path::{Path, PathBuf};

/// The ways Burn reads a tensor's values to the host.
const READS: [&str; 5] = [
    ".into_scalar",
    ".into_data(",
    ".to_data(",
    "into_data_async",
    "to_data_async",
];

/// The sources a training step runs, relative to the workspace root.
const STEP_CODE: [&str; 4] = [
    "crates/flashover-parallel/src",
    "crates/flashover-models/src",
    "src/train",
    "src/learner",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a source directory") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The lines of `source` outside items compiled for tests only (`#[cfg(test)]`,
/// `#[cfg(all(test, ..))]`), numbered from 1.
fn non_test_lines(source: &str) -> Vec<(usize, &str)> {
    let lines: Vec<&str> = source.lines().collect();
    let mut kept = vec![];
    let mut i = 0;
    while i < lines.len() {
        let attribute = lines[i].trim();
        if attribute.starts_with("#[cfg(") && attribute.contains("test") {
            // Skip the item it marks: one line ending in `;`, or up to its closing brace.
            let mut depth = 0i64;
            let mut opened = false;
            i += 1;
            while i < lines.len() {
                let line = lines[i];
                depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
                opened |= line.contains('{');
                i += 1;
                if (!opened && line.trim_end().ends_with(';')) || (opened && depth <= 0) {
                    break;
                }
            }
            continue;
        }
        kept.push((i + 1, lines[i]));
        i += 1;
    }
    kept
}

/// The uncounted reads in `source`: its non-test, non-comment lines that read a tensor.
fn uncounted_reads(source: &str) -> Vec<(usize, String)> {
    non_test_lines(source)
        .into_iter()
        .filter(|(_, line)| !line.trim_start().starts_with("//"))
        .filter(|(_, line)| READS.iter().any(|read| line.contains(read)))
        .map(|(n, line)| (n, line.trim().to_string()))
        .collect()
}

#[test]
fn every_host_read_of_the_step_is_counted() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![];
    for dir in STEP_CODE {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(files.len() > 50, "found only {} source files", files.len());
    let mut found = vec![];
    for file in files
        .iter()
        .filter(|f| !f.to_string_lossy().ends_with("_tests.rs"))
    {
        let source = std::fs::read_to_string(file).expect("a readable source");
        for (line, text) in uncounted_reads(&source) {
            let path = file.strip_prefix(root).unwrap_or(file).display();
            found.push(format!("{path}:{line}: {text}"));
        }
    }
    assert!(
        found.is_empty(),
        "reads of tensor values not counted: read them with \
         flashover_runtime::transfers::read or read_scalar, naming the cause:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_check_finds_a_read_and_skips_tests_and_comments() {
    let source = "fn a(t: Tensor<1>) -> f32 {\n    t.into_scalar()\n}\n\
                  // t.into_data() in a comment\n\
                  #[cfg(test)]\nmod tests {\n    fn b() { x.into_data(); }\n}\n\
                  fn c(t: Tensor<1>) { let _ = t.to_data(); }\n\
                  #[cfg(all(test, feature = \"wgpu\"))]\nfn d() {\n    y.into_scalar();\n}\n";
    let found = uncounted_reads(source);
    let lines: Vec<usize> = found.iter().map(|(n, _)| *n).collect();
    assert_eq!(lines, [2, 9], "{found:?}");
}
