//! # flashover-data: tokens with a known answer, and who reads which
//!
//! - [`MarkovSource`]: sequences from a seeded first-order Markov chain. Its entropy rate is
//!   computed exactly, so the best achievable next-token loss (the *floor*) is known before
//!   training, and needs no download.
//! - [`TextSource`]: byte-level tokens from a text file (vocabulary 256), random windows.
//! - [`BatchPlan`]: which samples each data-parallel rank and micro-batch reads at each step,
//!   deterministically from the step alone, so every layout sees the same global batch.
#![warn(missing_docs)]

mod markov;
mod rng;
mod sampler;
mod text;

pub use markov::MarkovSource;
pub use rng::SplitMix64;
pub use sampler::{BatchPlan, SamplerError};
pub use text::{TextError, TextSource};

/// A source of token sequences addressed by a global sample index.
pub trait TokenSource: Send + Sync {
    /// Number of distinct tokens.
    fn vocab_size(&self) -> usize;
    /// Sample `index`: `len` tokens, the same every time it is asked for.
    fn sample(&self, index: u64, len: usize) -> Vec<u32>;
    /// The lowest expected next-token cross-entropy (nats), when known.
    fn loss_floor(&self) -> Option<f64>;
    /// A one-line description for logs.
    fn describe(&self) -> String;
}
