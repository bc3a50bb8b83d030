//! The named parallelism axes.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A parallelism axis of the mesh. The declaration order is the rank order, outermost first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Axis {
    /// Pipeline parallel: stages of layers; outermost (point-to-point traffic only).
    Pp,
    /// Data parallel: full replicas (or, with `fsdp`, replicas of the shard groups: HSDP).
    Dp,
    /// Fully sharded data parallel / ZeRO: parameters, gradients and optimizer state sharded.
    Fsdp,
    /// Expert parallel: mixture-of-experts experts spread across ranks.
    Ep,
    /// Context parallel: sequence positions spread across ranks.
    Cp,
    /// Tensor parallel: matrices split across ranks; innermost (most frequent collectives).
    Tp,
}

impl Axis {
    /// Every axis in rank order, outermost first.
    pub const ALL: [Axis; 6] = [Axis::Pp, Axis::Dp, Axis::Fsdp, Axis::Ep, Axis::Cp, Axis::Tp];

    /// The axis name as written in mesh strings (`dp`, `tp`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Axis::Pp => "pp",
            Axis::Dp => "dp",
            Axis::Fsdp => "fsdp",
            Axis::Ep => "ep",
            Axis::Cp => "cp",
            Axis::Tp => "tp",
        }
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Axis {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Axis::ALL
            .into_iter()
            .find(|a| a.name() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| s.trim().to_string())
    }
}
