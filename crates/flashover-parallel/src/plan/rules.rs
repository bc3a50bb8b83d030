//! The rules a plan is made of, one per strategy, each naming modules by path: tensor
//! parallel (`TensorParallelRule`, `TpStyle`), pipeline (`PipelineRule`), context parallel
//! (`ContextParallelRule`), and how they read from and write to TOML.

use super::CpAttention;
use super::ScheduleKind;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A dotted module path (`blocks.3.attn.wq`) naming a module and everything inside it. A `*`
/// segment matches any one segment (`blocks.*.mlp`); the empty path names the whole model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ModulePath(String);

impl ModulePath {
    /// The path `path` (see the type's docs).
    pub fn new(path: &str) -> Self {
        ModulePath(path.to_string())
    }

    /// The path as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Segments in the path (0 for the whole model).
    pub(crate) fn depth(&self) -> usize {
        if self.0.is_empty() {
            0
        } else {
            self.0.split('.').count()
        }
    }

    /// Whether the parameter at `param_path` lies inside the module this path names.
    pub fn contains(&self, param_path: &str) -> bool {
        if self.0.is_empty() {
            return true;
        }
        let mut param = param_path.split('.');
        self.0
            .split('.')
            .all(|want| param.next().is_some_and(|got| want == "*" || want == got))
    }
}

/// How a tensor-parallel rule splits a linear layer (`y = x W + b`, `W: [d_in, d_out]`) over
/// `tp`, as Megatron's column- and row-parallel layers do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TpStyle {
    /// Split by output features: each rank holds `d_out / tp` columns of `W` and entries of
    /// `b`, reads the whole input and returns its part of the output (the gradient of the
    /// input is summed over `tp` in backward).
    Colwise,
    /// Split by input features: each rank holds `d_in / tp` rows of `W`, reads its part of the
    /// input (a column-wise layer's output), and the partial products are summed over `tp`
    /// before the whole bias is added.
    Rowwise,
    /// An embedding table `[vocab, d]` split by rows (the vocabulary, padded to a multiple of
    /// `tp`): each rank looks up the tokens it holds and the lookups are summed over `tp`; as
    /// a tied head it computes its rows' logits, and its loss reduces over `tp` without
    /// gathering them ([`crate::nn::Embedding`]).
    Vocab,
}

/// One tensor-parallel rule: the linear layers (or, `vocab`, embedding tables) at `paths`
/// split `style`-wise.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorParallelRule {
    /// How the layers are split.
    pub style: TpStyle,
    /// The layers (each path must name a linear layer: one `[d_in, d_out]` weight and at most
    /// one `[d_out]` bias).
    pub paths: Vec<ModulePath>,
    /// Features that must stay on one rank together (an attention head's width): the split
    /// width must divide into `tp` parts of whole units. 1 by default.
    #[serde(default = "one")]
    pub unit: usize,
    /// Column-wise only: pad the output features to a multiple of `tp` (zero columns), as
    /// Megatron pads a vocabulary, so any width splits. For an output head whose logits go
    /// only to its vocabulary-parallel loss ([`crate::nn::Linear::cross_entropy`]), which
    /// leaves the padding out. Off by default.
    #[serde(default)]
    pub padded: bool,
}

fn one() -> usize {
    1
}

impl TensorParallelRule {
    /// The linear layers at `paths` split by output features.
    pub fn colwise(paths: &[&str]) -> Self {
        Self::new(TpStyle::Colwise, paths)
    }

    /// The linear layers at `paths` split by input features.
    pub fn rowwise(paths: &[&str]) -> Self {
        Self::new(TpStyle::Rowwise, paths)
    }

    /// The embedding tables at `paths` split by vocabulary rows.
    pub fn vocab(paths: &[&str]) -> Self {
        Self::new(TpStyle::Vocab, paths)
    }

    fn new(style: TpStyle, paths: &[&str]) -> Self {
        TensorParallelRule {
            style,
            paths: paths.iter().map(|p| ModulePath::new(p)).collect(),
            unit: 1,
            padded: false,
        }
    }

    /// Pad a column-wise split's output features to a multiple of `tp` (see the field).
    pub fn padded(mut self) -> Self {
        self.padded = true;
        self
    }

    /// Keep the split features in whole units of `unit` (an attention head's width, so each
    /// rank holds whole heads).
    pub fn in_units(mut self, unit: usize) -> Self {
        self.unit = unit;
        self
    }
}

/// How a pipeline plan cuts a model into stages over `pp`: the repeated `layers` split into
/// consecutive runs, one per stage, the `first` modules on the first stage and the `last` on
/// the last (a module in both, a tied embedding and head, is held by both and kept in step).
/// The model runs its stage through [`crate::parallelize::PipelineModel`].
///
/// `layers` may name several lists, run one after another and numbered on through them: an
/// encoder-decoder model's `["encoder.blocks", "decoder.blocks"]` with two blocks each has
/// layers 0-1 (the encoder's) and 2-3 (the decoder's), so `layers_per_stage = [2, 2]` cuts it
/// between encoder and decoder and `[3, 1]` inside the decoder, with no change to the model
/// or its parameter paths. A module that runs with one layer (the encoder's final norm) is
/// `attach`ed to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineRule {
    /// The repeated layers, a `Vec` of modules (`blocks`: `blocks.0`, `blocks.1`, ...), or
    /// several such lists in the order the model runs them (in TOML a string or a list).
    #[serde(with = "layer_lists")]
    pub layers: Vec<ModulePath>,
    /// Modules that run with one of the layers (an encoder's final norm, after its last
    /// block): held by that layer's stage, recomputed and fully sharded with it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attach: Vec<AttachedModule>,
    /// What the first stage runs before the layers (embeddings): module paths, or the paths
    /// of single parameters held outside a module (a learned class token).
    #[serde(default)]
    pub first: Vec<ModulePath>,
    /// What the last stage runs after the layers (final norm, head): module or parameter
    /// paths, as `first`.
    #[serde(default)]
    pub last: Vec<ModulePath>,
    /// The schedule: `gpipe`, `1f1b`, `interleaved` or `zb-h1` (zero-bubble: the weight
    /// gradients of [`crate::nn::Linear`] layers wait for the schedule's weight actions; on
    /// Flex and the CubeCL backend, and not with `fully_shard`).
    #[serde(with = "schedule_name")]
    pub schedule: ScheduleKind,
    /// Micro-batches per step (each data rank's share of the batch is cut into this many).
    pub micro_batches: usize,
    /// Stages per pipeline rank (`interleaved` only: rank `r` runs stages `r`, `r + pp`, ...).
    #[serde(default = "one")]
    pub chunks: usize,
    /// How many layers each stage runs, in stage order (`pp x chunks` counts summing to the
    /// number of layers, each at least 1): a stage that also runs a heavy head or embedding
    /// can take fewer layers. Without it, the layers are spread evenly, the first stages
    /// taking the remainder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers_per_stage: Option<Vec<usize>>,
}

impl PipelineRule {
    /// `layers` cut into stages, `schedule` over `micro_batches` micro-batches, one stage per
    /// rank; nothing before or after the layers until [`Self::first`] and [`Self::last`] say.
    pub fn new(layers: &str, schedule: ScheduleKind, micro_batches: usize) -> Self {
        PipelineRule {
            layers: vec![ModulePath::new(layers)],
            attach: vec![],
            first: vec![],
            last: vec![],
            schedule,
            micro_batches,
            chunks: 1,
            layers_per_stage: None,
        }
    }

    /// One more list of layers, run after those named so far (a decoder's blocks after the
    /// encoder's): its layers are numbered on from theirs.
    pub fn then_layers(mut self, layers: &str) -> Self {
        self.layers.push(ModulePath::new(layers));
        self
    }

    /// Module `module` runs with layer `layer` (a path to one layer of the lists, such as
    /// `encoder.blocks.5`), on its stage.
    pub fn attach(mut self, module: &str, layer: &str) -> Self {
        self.attach.push(AttachedModule {
            module: ModulePath::new(module),
            layer: ModulePath::new(layer),
        });
        self
    }

    /// The layer lists as written, joined for messages.
    pub(crate) fn layers_named(&self) -> String {
        let names: Vec<&str> = self.layers.iter().map(ModulePath::as_str).collect();
        names.join("` then `")
    }

    /// The modules the first stage runs before the layers.
    pub fn first(mut self, paths: &[&str]) -> Self {
        self.first = paths.iter().map(|p| ModulePath::new(p)).collect();
        self
    }

    /// The modules the last stage runs after the layers.
    pub fn last(mut self, paths: &[&str]) -> Self {
        self.last = paths.iter().map(|p| ModulePath::new(p)).collect();
        self
    }

    /// `chunks` stages per rank (the interleaved schedule).
    pub fn chunks(mut self, chunks: usize) -> Self {
        self.chunks = chunks;
        self
    }

    /// Stage `s` runs `counts[s]` consecutive layers (instead of an even split).
    pub fn layers_per_stage(mut self, counts: &[usize]) -> Self {
        self.layers_per_stage = Some(counts.to_vec());
        self
    }
}

/// How a plan splits sequences over `cp` (context parallelism): every rank holds some
/// positions of every sequence for the whole model, and the causal attention cores at
/// `attention` ([`crate::nn::CausalAttention`]) reach the other ranks' keys and values.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextParallelRule {
    /// The attention cores, each a [`crate::nn::CausalAttention`] (`blocks.*.attn.core`).
    pub attention: Vec<ModulePath>,
    /// `ring` (key/value blocks passed around the ring, any head count) or `all-to-all`
    /// (Ulysses: heads swapped for positions, heads per rank divisible by `cp`).
    #[serde(with = "attention_name")]
    pub algorithm: CpAttention,
    /// Give each rank a chunk from the start and one from the end of every sequence, so each
    /// does the same causal work (otherwise one contiguous chunk each). On by default.
    #[serde(default = "yes")]
    pub load_balance: bool,
}

fn yes() -> bool {
    true
}

impl ContextParallelRule {
    /// Ring attention at the cores `attention`, load-balanced.
    pub fn ring(attention: &[&str]) -> Self {
        Self::new(CpAttention::Ring, attention)
    }

    /// All-to-all (Ulysses) attention at the cores `attention`, load-balanced.
    pub fn all_to_all(attention: &[&str]) -> Self {
        Self::new(CpAttention::AllToAll, attention)
    }

    fn new(algorithm: CpAttention, attention: &[&str]) -> Self {
        ContextParallelRule {
            attention: attention.iter().map(|p| ModulePath::new(p)).collect(),
            algorithm,
            load_balance: true,
        }
    }

    /// One contiguous chunk of every sequence per rank instead of the balanced two.
    pub fn contiguous(mut self) -> Self {
        self.load_balance = false;
        self
    }
}

/// A context-parallel attention by the name `CpAttention`'s `FromStr` reads (`ring`).
mod attention_name {
    use super::*;

    pub fn serialize<S: Serializer>(kind: &CpAttention, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&kind.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<CpAttention, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// A schedule by the name `ScheduleKind`'s `FromStr` reads (`1f1b`).
/// A module of a pipeline's model that runs with one of its layers (see
/// [`PipelineRule::attach`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttachedModule {
    /// The module (`encoder.norm`).
    pub module: ModulePath,
    /// The layer it runs with (`encoder.blocks.5`).
    pub layer: ModulePath,
}

/// A pipeline's layer lists: one path as a string, several as a list.
mod layer_lists {
    use super::*;

    #[derive(Serialize, Deserialize)]
    #[serde(untagged)]
    enum Lists {
        One(ModulePath),
        Several(Vec<ModulePath>),
    }

    pub fn serialize<S: Serializer>(lists: &[ModulePath], s: S) -> Result<S::Ok, S::Error> {
        match lists {
            [one] => one.serialize(s),
            several => several.serialize(s),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<ModulePath>, D::Error> {
        match Lists::deserialize(d)? {
            Lists::One(one) => Ok(vec![one]),
            Lists::Several(several) if several.is_empty() => Err(serde::de::Error::custom(
                "pipeline layers: name at least one list of layers",
            )),
            Lists::Several(several) => Ok(several),
        }
    }
}

mod schedule_name {
    use super::*;

    pub fn serialize<S: Serializer>(kind: &ScheduleKind, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&kind.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ScheduleKind, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}
