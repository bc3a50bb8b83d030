//! The plan's vocabulary: the choices a plan names, as data (what each means is the
//! mechanism's business, above the plan).

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
