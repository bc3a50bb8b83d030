//! Byte-level tokens from a text file.

use crate::TokenSource;
use crate::rng::SplitMix64;
use std::path::{Path, PathBuf};

/// Why a text file cannot serve as a token source.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// The file cannot be read.
    #[error("cannot read text data {path}: {source}")]
    Read {
        /// The path given.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is shorter than one sample.
    #[error(
        "text data {path} has {len} bytes but one sample needs {needed}: use a longer file or a shorter --seq-len"
    )]
    TooShort {
        /// The path given.
        path: PathBuf,
        /// Its length.
        len: usize,
        /// Bytes one sample needs.
        needed: usize,
    },
}

/// Windows of a byte string: sample `i` starts at an offset drawn from `(seed, i)`.
#[derive(Debug, Clone)]
pub struct TextSource {
    bytes: Vec<u8>,
    seed: u64,
    name: String,
}

impl TextSource {
    /// Reads `path`; checks that it holds at least `sample_len` bytes.
    pub fn open(path: &Path, sample_len: usize, seed: u64) -> Result<Self, TextError> {
        let bytes = std::fs::read(path).map_err(|source| TextError::Read {
            path: path.into(),
            source,
        })?;
        if bytes.len() < sample_len {
            return Err(TextError::TooShort {
                path: path.into(),
                len: bytes.len(),
                needed: sample_len,
            });
        }
        Ok(TextSource {
            bytes,
            seed,
            name: path.display().to_string(),
        })
    }
}

impl TokenSource for TextSource {
    fn vocab_size(&self) -> usize {
        256
    }

    fn sample(&self, index: u64, len: usize) -> Vec<u32> {
        let span = (self.bytes.len() - len.min(self.bytes.len())) as u64 + 1;
        let start = SplitMix64::stream(self.seed, index).below(span) as usize;
        self.bytes[start..start + len]
            .iter()
            .map(|&b| b as u32)
            .collect()
    }

    fn loss_floor(&self) -> Option<f64> {
        None
    }

    fn describe(&self) -> String {
        format!(
            "text file {} ({} bytes, byte tokens)",
            self.name,
            self.bytes.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_come_from_the_file_and_short_files_are_refused() {
        let dir = std::env::temp_dir().join(format!("flashover-text-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.txt");
        std::fs::write(&path, b"hello world, hello flashover").unwrap();
        let src = TextSource::open(&path, 8, 1).unwrap();
        let s = src.sample(5, 8);
        let text: Vec<u8> = s.iter().map(|&t| t as u8).collect();
        assert!(
            b"hello world, hello flashover"
                .windows(8)
                .any(|w| w == text.as_slice())
        );
        let err = TextSource::open(&path, 100, 1).unwrap_err().to_string();
        assert!(
            err.contains("has 28 bytes but one sample needs 100"),
            "{err}"
        );
        std::fs::remove_dir_all(dir).ok();
    }
}
