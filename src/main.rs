//! The `flashover` binary.

mod bench;
mod cli;

use clap::Parser;

// Memory benchmarks read the heap's peak.
#[global_allocator]
static HEAP: flashover::heap::Allocator = flashover::heap::Allocator;

fn main() {
    let cli = cli::Cli::parse();
    if let Err(message) = cli::run(cli) {
        eprintln!("error: {message}");
        std::process::exit(2);
    }
}
