//! The plan's vocabulary: the choices a plan names, as data (what each means is the
//! mechanism's business, above the plan).

use crate::error::ParallelError;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Which activations to recompute.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum CheckpointPolicy {
    /// Keep everything.
    #[default]
    None,
    /// Recompute every block.
    Full,
    /// Recompute memory-bound operations everywhere, keep matrix products (Burn's balanced
    /// checkpointing).
    Selective,
    /// Recompute blocks `0, k, 2k, ...`.
    Every(usize),
    /// Recompute the listed blocks.
    Blocks(Vec<usize>),
}

impl FromStr for CheckpointPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let bad = || format!("`{s}`: expected none, full, selective, every:K or blocks:I,J,...");
        Ok(match s {
            "none" => CheckpointPolicy::None,
            "full" => CheckpointPolicy::Full,
            "selective" => CheckpointPolicy::Selective,
            _ => {
                if let Some(k) = s.strip_prefix("every:") {
                    match k.trim().parse::<usize>() {
                        Ok(k) if k > 0 => CheckpointPolicy::Every(k),
                        _ => return Err(bad()),
                    }
                } else if let Some(list) = s.strip_prefix("blocks:") {
                    let blocks = list
                        .split(',')
                        .map(|b| b.trim().parse::<usize>())
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|_| bad())?;
                    CheckpointPolicy::Blocks(blocks)
                } else {
                    return Err(bad());
                }
            }
        })
    }
}

impl fmt::Display for CheckpointPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckpointPolicy::None => f.write_str("none"),
            CheckpointPolicy::Full => f.write_str("full"),
            CheckpointPolicy::Selective => f.write_str("selective"),
            CheckpointPolicy::Every(k) => write!(f, "every:{k}"),
            CheckpointPolicy::Blocks(b) => {
                let list: Vec<String> = b.iter().map(|i| i.to_string()).collect();
                write!(f, "blocks:{}", list.join(","))
            }
        }
    }
}

impl CheckpointPolicy {
    /// Whether block `layer` is recomputed as a whole.
    pub fn recomputes_block(&self, layer: usize) -> bool {
        match self {
            CheckpointPolicy::Full => true,
            CheckpointPolicy::Every(k) => layer.is_multiple_of(*k),
            CheckpointPolicy::Blocks(blocks) => blocks.contains(&layer),
            CheckpointPolicy::None | CheckpointPolicy::Selective => false,
        }
    }

    /// Whether the policy recomputes whole blocks (needs [`CheckpointPolicy::block_recompute`]).
    pub fn is_block_level(&self) -> bool {
        matches!(
            self,
            CheckpointPolicy::Full | CheckpointPolicy::Every(_) | CheckpointPolicy::Blocks(_)
        )
    }

    /// Whether the policy is Burn's balanced checkpointing (a property of the device:
    /// `Device::gradient_checkpointing`).
    pub fn is_selective(&self) -> bool {
        *self == CheckpointPolicy::Selective
    }
}

/// How attention reaches the keys and values of other ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpAttention {
    /// Ring attention (any head count).
    Ring,
    /// Ulysses all-to-all attention (heads must divide by `cp`).
    AllToAll,
}

impl fmt::Display for CpAttention {
    /// The name [`CpAttention::from_str`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CpAttention::Ring => "ring",
            CpAttention::AllToAll => "all-to-all",
        })
    }
}

impl FromStr for CpAttention {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ring" => Ok(CpAttention::Ring),
            "all-to-all" | "ulysses" => Ok(CpAttention::AllToAll),
            other => Err(format!("`{other}`: expected ring or all-to-all")),
        }
    }
}

/// How a plan's gradients travel between ranks: in buckets of about `bucket_mb` MiB (f32
/// elements; a larger parameter gets a bucket of its own), reduced during backward where the
/// executor lets gradient hooks report them (`overlap`), else right after backward.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GradientBuckets {
    /// Target size of one bucket, in MiB of f32 gradient.
    pub bucket_mb: f64,
    /// Reduce buckets while backward runs (gradient hooks), where the executor and the device
    /// allow; the step's report says whether it did.
    pub overlap: bool,
    /// Keep only this rank's rows of each reduced gradient (ZeRO-1/2 of parameters held
    /// whole; see the module docs). `None`: every rank keeps whole gradients.
    pub rows: Option<GradientRows>,
}

/// How a rank comes to hold only its rows of each reduced gradient, the parameters cut along
/// their first dimension over `fsdp` (or `dp` on a mesh without it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GradientRows {
    /// Every rank gets the whole sum (all-reduce) and keeps its rows: ZeRO-1.
    AllReduce,
    /// Each rank gets only the sum of its rows (reduce-scatter): ZeRO-2.
    ReduceScatter,
}

impl Default for GradientBuckets {
    fn default() -> Self {
        GradientBuckets {
            bucket_mb: 4.0,
            overlap: true,
            rows: None,
        }
    }
}

impl GradientBuckets {
    /// Buckets of `bucket_mb` MiB.
    pub fn bucket_mb(mut self, bucket_mb: f64) -> Self {
        self.bucket_mb = bucket_mb;
        self
    }

    /// Whether buckets are reduced while backward runs.
    pub fn overlap(mut self, overlap: bool) -> Self {
        self.overlap = overlap;
        self
    }

    /// Each rank keeps only its rows of the reduced gradients, as `rows` says.
    pub fn rows(mut self, rows: GradientRows) -> Self {
        self.rows = Some(rows);
        self
    }

    /// Elements per bucket; fails when the size holds no f32.
    pub(crate) fn bucket_elems(&self) -> Result<usize, ParallelError> {
        let elems = (self.bucket_mb * (1 << 20) as f64 / 4.0) as usize;
        if self.bucket_mb.is_nan() || elems == 0 {
            return Err(ParallelError::Invalid(format!(
                "gradient buckets of {} MiB hold no f32: use a positive bucket_mb",
                self.bucket_mb
            )));
        }
        Ok(elems)
    }
}

/// The built-in schedules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ScheduleKind {
    /// Fill-drain: every forward, then every backward.
    GPipe,
    /// One forward, one backward in the steady state: at most `p - r` micro-batches in flight.
    OneFOneB,
    /// 1F1B over `v` chunks per rank (Megatron's interleaved schedule); needs `m % p == 0`.
    Interleaved1F1B,
    /// Zero-bubble H1: backward split into input and weight gradients; weight gradients fill
    /// the bubbles, with 1F1B's activation memory.
    ZeroBubbleH1,
}

impl FromStr for ScheduleKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "gpipe" => ScheduleKind::GPipe,
            "1f1b" => ScheduleKind::OneFOneB,
            "interleaved" | "interleaved-1f1b" => ScheduleKind::Interleaved1F1B,
            "zb" | "zbh1" | "zb-h1" | "zero-bubble" => ScheduleKind::ZeroBubbleH1,
            other => {
                return Err(format!(
                    "unknown schedule `{other}`: expected gpipe, 1f1b, interleaved or zb-h1"
                ));
            }
        })
    }
}

impl fmt::Display for ScheduleKind {
    /// The name [`ScheduleKind::from_str`](std::str::FromStr) reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved1F1B => "interleaved",
            ScheduleKind::ZeroBubbleH1 => "zb-h1",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_and_print_back() {
        for s in ["none", "full", "selective", "every:2", "blocks:0,3"] {
            assert_eq!(s.parse::<CheckpointPolicy>().unwrap().to_string(), s);
        }
        for bad in ["every:0", "blocks:a", "all", "every:"] {
            let e = bad.parse::<CheckpointPolicy>().unwrap_err();
            assert!(e.contains("every:K"), "{e}");
        }
        let every = CheckpointPolicy::Every(2);
        assert_eq!(
            (0..5)
                .map(|l| every.recomputes_block(l))
                .collect::<Vec<_>>(),
            vec![true, false, true, false, true]
        );
    }
}
