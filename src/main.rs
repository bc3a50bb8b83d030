//! The `flashover` binary.

mod cli;

use clap::Parser;

fn main() {
    let cli = cli::Cli::parse();
    if let Err(message) = cli::run(cli) {
        eprintln!("error: {message}");
        std::process::exit(2);
    }
}
