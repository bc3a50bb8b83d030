//! The one rule table: which compositions of strategies Flashover trains, and for each one it
//! refuses, why.
//!
//! `flashover config check`, `train`, `verify` and `plan` all ask [`refusals`]; nothing else
//! decides whether a layout composes. Sizes that do not divide (heads by tp, a sequence by cp)
//! are checked where the sizes are known; this table is about which strategies go together.
//! Each refusal says why the composition cannot work, or what it is waiting for.
//! `docs/composition.md` is generated from this table ([`matrix_markdown`]) by a test, so the
//! documented matrix cannot drift from what `train` does.
//!
//! ```
//! use flashover_plan::rules::refusals;
//! use flashover_plan::Layout;
//!
//! let mut layout = Layout::single();
//! (layout.dp, layout.tp) = (2, 2);
//! assert!(refusals(&layout, false).is_empty(), "dp x tp trains");
//! layout.ep = 2;
//! assert_eq!(refusals(&layout, false)[0].rule, "ep-needs-experts");
//! ```

use crate::layout::{Layout, PipelineSchedule, Recompute};
use std::fmt::Write;

/// A composition the table refuses: which rule, and the reason a user reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// Short, stable name of the rule (`pp-zero`).
    pub rule: &'static str,
    /// Why it cannot work, or what it waits for, and what to do instead.
    pub reason: &'static str,
}

/// One row of the table: when it applies and why.
struct Rule {
    name: &'static str,
    applies: fn(&Layout, bool) -> bool,
    reason: &'static str,
}

/// The table. `applies(layout, experts)`: `experts` says the model has mixture-of-experts
/// blocks.
const RULES: &[Rule] = &[
    Rule {
        name: "sp-needs-tp",
        applies: |l, _| l.sequence_parallel && l.tp == 1,
        reason: "sequence parallelism splits the activations between the tensor-parallel \
                 regions over tp, so it needs a tp axis (e.g. dp=2,tp=2)",
    },
    Rule {
        name: "fsdp-needs-zero",
        applies: |l, _| l.fsdp > 1 && l.zero == 0,
        reason: "an fsdp axis shards over fsdp, but parallel.zero = 0 (DDP) shards nothing: \
                 choose --zero 1, 2 or 3 (3 shards the parameters over fsdp)",
    },
    Rule {
        name: "zero3-needs-fsdp",
        applies: |l, _| l.zero == 3 && l.fsdp == 1 && l.world() > 1,
        reason: "ZeRO-3 shards parameters over the fsdp axis and the mesh has none: write \
                 fsdp=N (or dp=R,fsdp=N for HSDP)",
    },
    Rule {
        name: "ep-needs-experts",
        applies: |l, experts| l.ep > 1 && !experts,
        reason: "an ep axis splits experts, but the model has none: set moe.experts \
                 (--moe --experts N)",
    },
];

/// Every rule of the table that refuses `layout` (empty: it trains). `experts`: the model has
/// mixture-of-experts blocks.
pub fn refusals(layout: &Layout, experts: bool) -> Vec<Refusal> {
    RULES
        .iter()
        .filter(|r| (r.applies)(layout, experts))
        .map(|r| Refusal {
            rule: r.name,
            reason: r.reason,
        })
        .collect()
}

/// One strategy as a column of the composition matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    /// Replicas over `dp` (DDP).
    Dp,
    /// ZeRO-1/2 over the data-parallel ranks.
    Zero12,
    /// ZeRO-3 / FSDP over `fsdp`.
    Fsdp,
    /// Tensor parallelism over `tp`.
    Tp,
    /// Sequence parallelism (with tp).
    Sp,
    /// Pipeline stages over `pp` (1F1B).
    Pp,
    /// The zero-bubble schedule ZB-H1 (with pp).
    ZeroBubble,
    /// The interleaved 1F1B schedule, two virtual stages per rank (with pp).
    Interleaved,
    /// The GPipe schedule (with pp).
    Gpipe,
    /// Context parallelism over `cp`.
    Cp,
    /// A mixture-of-experts model, experts whole on every rank.
    Moe,
    /// Experts split over `ep`.
    Ep,
    /// Whole-block activation recomputation (full, every:K, blocks:I,J).
    Recompute,
}

impl Feature {
    /// Every column, in the matrix's order.
    pub const ALL: [Feature; 13] = [
        Feature::Dp,
        Feature::Zero12,
        Feature::Fsdp,
        Feature::Tp,
        Feature::Sp,
        Feature::Pp,
        Feature::ZeroBubble,
        Feature::Interleaved,
        Feature::Gpipe,
        Feature::Cp,
        Feature::Moe,
        Feature::Ep,
        Feature::Recompute,
    ];

    /// The column's heading.
    pub fn label(self) -> &'static str {
        match self {
            Feature::Dp => "dp",
            Feature::Zero12 => "ZeRO-1/2",
            Feature::Fsdp => "fsdp (ZeRO-3)",
            Feature::Tp => "tp",
            Feature::Sp => "sp",
            Feature::Pp => "pp",
            Feature::ZeroBubble => "zb-h1",
            Feature::Interleaved => "interleaved",
            Feature::Gpipe => "gpipe",
            Feature::Cp => "cp",
            Feature::Moe => "MoE",
            Feature::Ep => "ep",
            Feature::Recompute => "full recompute",
        }
    }

    /// Turns this strategy on in `layout` at degree 2 (and what it needs with it: sp a tp
    /// axis, zb-h1 a pp axis, ep experts). Returns whether the model has experts.
    fn enable(self, layout: &mut Layout) -> bool {
        match self {
            Feature::Dp => layout.dp = 2,
            Feature::Zero12 => {
                layout.zero = 1;
                layout.dp = layout.dp.max(2);
            }
            Feature::Fsdp => {
                layout.zero = 3;
                layout.fsdp = 2;
            }
            Feature::Tp => layout.tp = 2,
            Feature::Sp => {
                layout.tp = 2;
                layout.sequence_parallel = true;
            }
            Feature::Pp => layout.pp = 2,
            Feature::ZeroBubble => {
                layout.pp = 2;
                layout.schedule = PipelineSchedule::ZbH1;
            }
            Feature::Interleaved => {
                layout.pp = 2;
                layout.schedule = PipelineSchedule::Interleaved { chunks: 2 };
            }
            Feature::Gpipe => {
                layout.pp = 2;
                layout.schedule = PipelineSchedule::Gpipe;
            }
            Feature::Cp => layout.cp = 2,
            Feature::Moe => return true,
            Feature::Ep => {
                layout.ep = 2;
                return true;
            }
            Feature::Recompute => layout.recompute = Recompute::Full,
        }
        false
    }

    /// Whether `self` and `other` are two choices of one setting (ZeRO-1/2 or 3; one pipeline
    /// schedule or another), not a composition.
    pub fn exclusive(self, other: Feature) -> bool {
        use Feature::{Fsdp, Gpipe, Interleaved, Zero12, ZeroBubble};
        let schedule = |f| matches!(f, ZeroBubble | Interleaved | Gpipe);
        matches!((self, other), (Zero12, Fsdp) | (Fsdp, Zero12))
            || (self != other && schedule(self) && schedule(other))
    }
}

/// The smallest layout with `features` on, and whether its model has experts.
pub fn layout_with(features: &[Feature]) -> (Layout, bool) {
    let mut layout = Layout::single();
    let mut experts = false;
    for f in features {
        experts |= f.enable(&mut layout);
    }
    (layout, experts)
}

/// The composition matrix as Markdown: every pair of [`Feature`]s, `yes` or the rules that
/// refuse it (numbered, with their reasons below the table).
pub fn matrix_markdown() -> String {
    let mut out = String::new();
    let mut cited: Vec<&'static str> = vec![];
    let header: Vec<&str> = Feature::ALL.iter().map(|f| f.label()).collect();
    let _ = writeln!(out, "| | {} |", header.join(" | "));
    let _ = writeln!(out, "|---|{}", "---|".repeat(header.len()));
    for (i, row) in Feature::ALL.iter().enumerate() {
        let mut cells = vec![];
        for (j, column) in Feature::ALL.iter().enumerate() {
            let cell = if j < i {
                String::new()
            } else if row.exclusive(*column) {
                "-".to_string()
            } else {
                let (layout, experts) = layout_with(&[*row, *column]);
                let refused = refusals(&layout, experts);
                if refused.is_empty() {
                    "yes".to_string()
                } else {
                    let notes: Vec<String> = refused
                        .iter()
                        .map(|r| {
                            let n = match cited.iter().position(|c| *c == r.rule) {
                                Some(n) => n,
                                None => {
                                    cited.push(r.rule);
                                    cited.len() - 1
                                }
                            };
                            format!("no ({})", n + 1)
                        })
                        .collect();
                    notes.join(", ")
                }
            };
            cells.push(cell);
        }
        let _ = writeln!(out, "| **{}** | {} |", row.label(), cells.join(" | "));
    }
    out.push('\n');
    for (n, rule) in cited.iter().enumerate() {
        let reason = RULES
            .iter()
            .find(|r| r.name == *rule)
            .map_or("", |r| r.reason);
        let _ = writeln!(out, "{}. `{rule}`: {reason}.", n + 1);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_single_strategy_trains_on_its_own() {
        for f in Feature::ALL {
            let needs = match f {
                // A feature that needs another to mean anything is checked with it.
                Feature::Sp => vec![Feature::Sp, Feature::Tp],
                other => vec![other],
            };
            let (layout, experts) = layout_with(&needs);
            assert_eq!(refusals(&layout, experts), vec![], "{f:?}");
        }
    }

    #[test]
    fn rule_names_are_unique() {
        let mut names: Vec<_> = RULES.iter().map(|r| r.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), RULES.len());
    }

    #[test]
    fn every_pair_of_strategies_composes() {
        let text = matrix_markdown();
        assert!(!text.contains("no ("), "{text}");
    }

    #[test]
    fn a_setting_without_what_it_needs_is_refused_naming_its_rule() {
        let mut layout = Layout::single();
        layout.sequence_parallel = true;
        let refused = refusals(&layout, false);
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].rule, "sp-needs-tp");
        layout.tp = 2;
        layout.ep = 2;
        assert_eq!(refusals(&layout, false)[0].rule, "ep-needs-experts");
        assert_eq!(refusals(&layout, true), vec![]);
    }
}
