//! A plan checked against a model's parameters before anything moves: every path names
//! something, every tensor-parallel path names a linear layer, and every split width divides.
//! Each refusal names the path and the reason.

use super::{CheckpointPolicy, ModulePath, ParallelizePlan, TensorParallelRule, TpStyle};
use crate::error::ParallelError;
use crate::params::ParamSlot;

/// Checks `plan` against the parameters `slots` of a model to be split over `tp` ranks (its
/// paths and styles only, not the widths, with `None`).
pub(crate) fn check_plan(
    plan: &ParallelizePlan,
    slots: &[ParamSlot],
    tp: Option<usize>,
) -> Result<(), ParallelError> {
    let names: Vec<&str> = slots.iter().map(|s| s.name.as_str()).collect();
    for path in &plan.fully_shard {
        names_a_module(path, "fully_shard", &names)?;
    }
    for path in &plan.keep_whole {
        names_a_module(path, "keep_whole", &names)?;
        if !names
            .iter()
            .any(|n| path.contains(n) && plan.shard_path(n).is_some())
        {
            return Err(refuse(
                path,
                "keep_whole",
                "is inside no fully_shard path, so its parameters are whole already: drop the \
                 rule, or name a module that a fully_shard path holds"
                    .into(),
            ));
        }
    }
    for path in &plan.sequence_parallel {
        names_a_module(path, "sequence_parallel", &names)?;
        if let Some(split) = names
            .iter()
            .find(|n| path.contains(n) && plan.tp_rule(n).is_some())
        {
            return Err(refuse(
                path,
                "sequence_parallel",
                format!(
                    "holds `{split}`, which a tensor_parallel rule splits: sequence-parallel \
                     modules are the whole ones between the split layers (norms)"
                ),
            ));
        }
    }
    let vocab = plan
        .tensor_parallel
        .iter()
        .any(|r| r.style == TpStyle::Vocab);
    for path in &plan.sequence_split_stacks {
        names_a_module(path, "sequence_split_stacks", &names)?;
        let why = match (plan.sequence_parallel.is_empty(), &plan.context_parallel) {
            (true, None) => Some(
                "splits its input by position, but the plan splits sequences over neither tp \
                 (name the modules between the split layers, norms, in sequence_parallel) nor \
                 cp (add a context_parallel rule)",
            ),
            (false, Some(_)) => Some(
                "would split its input over both tp (sequence_parallel) and cp \
                 (context_parallel), which a stack does not do yet: choose one",
            ),
            (true, Some(rule)) if !rule.attention.is_empty() => Some(
                "splits whole sequences itself, while the context_parallel rule names attention \
                 cores, whose models split sequences before their blocks: use one or the other",
            ),
            _ => None,
        };
        if let Some(why) = why {
            return Err(refuse(path, "sequence_split_stacks", why.into()));
        }
    }
    let stacks = !plan.sequence_split_stacks.is_empty();
    if tp.is_some_and(|tp| tp > 1) && !plan.sequence_parallel.is_empty() && !vocab && !stacks {
        return Err(ParallelError::Invalid(
            "sequence_parallel: activations must reach the blocks split by sequence, which a \
             vocabulary-parallel token embedding does (its lookups are reduce-scattered along \
             the sequence), or a stack that splits its whole input itself \
             (flashover::nn::transformer's encoder and decoder): add a `vocab` rule for the \
             token embedding, or name the stack in sequence_split_stacks"
                .into(),
        ));
    }
    match &plan.activation_checkpointing {
        CheckpointPolicy::None => {}
        CheckpointPolicy::Selective => {
            return Err(ParallelError::Invalid(
                "activation_checkpointing = \"selective\" is Burn's balanced checkpointing, a \
                 property of the autodiff device, not of layers: build the model on \
                 `device.autodiff().gradient_checkpointing()` instead"
                    .into(),
            ));
        }
        policy if plan.pipeline.is_none() => {
            return Err(ParallelError::Invalid(format!(
                "activation_checkpointing = \"{policy}\" recomputes the layers a pipeline rule \
                 names, and the plan has none: add one (on a mesh without pp it runs every \
                 layer on each rank) or call flashover::parallel::activation_checkpointing::\
                 checkpoint in your forward"
            )));
        }
        _ => {}
    }
    if let Some(rule) = &plan.pipeline {
        // Checked like every rule's paths, before the stages are cut: a mistyped path is
        // named as such, not as the parameters it left without a stage.
        for path in &rule.layers {
            names_a_module(path, "pipeline layers", &names)?;
        }
        for attached in &rule.attach {
            names_a_module(&attached.module, "pipeline attach", &names)?;
            names_a_module(&attached.layer, "pipeline attach's layer", &names)?;
        }
        for path in &rule.first {
            names_a_module(path, "pipeline first", &names)?;
        }
        for path in &rule.last {
            names_a_module(path, "pipeline last", &names)?;
        }
    }
    if let Some(rule) = &plan.context_parallel {
        for path in &rule.attention {
            check_attention_core(path, slots, &names)?;
        }
    }
    let mut claimed: Vec<(&ModulePath, &str)> = vec![];
    for rule in &plan.tensor_parallel {
        let style = style_name(rule.style);
        for path in &rule.paths {
            if rule.unit == 0 {
                return Err(refuse(path, style, "has unit = 0; use 1 or more".into()));
            }
            if rule.padded && (rule.style != TpStyle::Colwise || rule.unit > 1) {
                return Err(refuse(
                    path,
                    style,
                    "is padded: padding applies to column-wise rules without a unit (an output \
                     head over a vocabulary)"
                        .into(),
                ));
            }
            for layer in linear_layers(path, style, slots, &names)? {
                if rule.style == TpStyle::Vocab && layer.has_bias {
                    return Err(refuse(
                        path,
                        style,
                        format!(
                            "names `{}`, which is not an embedding table (one [vocab, d] \
                             weight): it has a bias",
                            layer.path
                        ),
                    ));
                }
                if let Some((other, _)) = claimed.iter().find(|(_, l)| *l == layer.path) {
                    return Err(refuse(
                        path,
                        style,
                        format!(
                            "names `{}`, which `{}` already splits: give each layer one style",
                            layer.path,
                            other.as_str()
                        ),
                    ));
                }
                claimed.push((path, layer.path));
                if let Some(tp) = tp {
                    check_width(rule, path, &layer, tp)?;
                }
            }
        }
    }
    if tp.is_none_or(|tp| tp > 1) {
        check_split_alike(plan, slots)?;
    }
    Ok(())
}

/// Megatron's pairing, checked: a column-wise layer has a row-wise layer that reads its output
/// features (see [`check_row_partner`]), and where that one is beside it, the module's other
/// linear layers of the same shape are split column-wise too. A query split by heads beside a
/// whole key and value would otherwise meet them with `tp` times the width, and fail in the
/// first step as a shape mismatch deep in the model's forward, with no word of the plan.
fn check_split_alike(plan: &ParallelizePlan, slots: &[ParamSlot]) -> Result<(), ParallelError> {
    let layers = linear_like(slots);
    let style_of = |layer: &LinearLayer| plan.tp_rule(layer.weight);
    // Whether some row-wise layer of the plan reads `width` input features: a column-wise
    // layer's partner need not be its sibling (a pipeline's input layer and its first block).
    let row_wise_reader = |width: usize| {
        (layers.iter()).any(|l| {
            l.d_in == width && style_of(l).is_some_and(|(r, _)| r.style == TpStyle::Rowwise)
        })
    };
    let mut modules: std::collections::BTreeMap<&str, Vec<&LinearLayer>> = Default::default();
    for layer in &layers {
        let module = layer.path.rsplit_once('.').map_or("", |(m, _)| m);
        modules.entry(module).or_default().push(layer);
    }
    for siblings in modules.values() {
        for layer in siblings {
            let Some((rule, path)) = style_of(layer) else {
                continue;
            };
            if rule.style != TpStyle::Colwise || rule.padded {
                continue;
            }
            let Some(consumer) = siblings.iter().find(|l| {
                l.d_in == layer.d_out
                    && style_of(l).is_some_and(|(rule, _)| rule.style == TpStyle::Rowwise)
            }) else {
                if !row_wise_reader(layer.d_out) {
                    check_row_partner(layer, path, siblings, &style_of)?;
                }
                continue;
            };
            let whole: Vec<&str> = siblings
                .iter()
                .filter(|l| (l.d_in, l.d_out) == (layer.d_in, layer.d_out) && style_of(l).is_none())
                .map(|l| l.path)
                .collect();
            if whole.is_empty() {
                continue;
            }
            return Err(refuse(
                path,
                "colwise",
                format!(
                    "splits `{}` by output features, which `{}` (rowwise) takes split, but \
                     `{}` of the same shape [{}, {}] in the same module stay whole: their \
                     outputs would meet `{}`'s with tp times its width (a shape mismatch in \
                     the first step). Split them column-wise too, as Megatron splits query, \
                     key and value alike, or leave `{}` whole",
                    layer.path,
                    consumer.path,
                    whole.join("`, `"),
                    layer.d_in,
                    layer.d_out,
                    layer.path,
                    layer.path,
                ),
            ));
        }
    }
    Ok(())
}

/// A column-wise `layer` (split by `path`) that no row-wise layer of the plan reads (none takes
/// its output features): refused when a whole sibling takes that many input features, since
/// it would read the split output (`tp` times too narrow) and fail in the first step as a
/// matmul of mismatched widths naming no layer. A column-wise layer with no such sibling (an
/// output head read by its loss) passes.
fn check_row_partner<'a>(
    layer: &LinearLayer<'a>,
    path: &ModulePath,
    siblings: &[&LinearLayer<'a>],
    style_of: &dyn Fn(&LinearLayer<'a>) -> Option<(&'a TensorParallelRule, &'a ModulePath)>,
) -> Result<(), ParallelError> {
    let whole_reader = siblings
        .iter()
        .find(|l| l.path != layer.path && l.d_in == layer.d_out && style_of(l).is_none());
    match whole_reader {
        None => Ok(()),
        Some(reader) => Err(refuse(
            path,
            "colwise",
            format!(
                "splits `{}` by output features, but `{}` beside it, which takes as many input \
                 features ({}), stays whole: it would read tp times too few of them (a matmul \
                 of mismatched widths in the first step). Split `{}` row-wise, as Megatron \
                 pairs a column-wise layer with the row-wise one that reads it, or leave `{}` \
                 whole",
                layer.path, reader.path, layer.d_out, reader.path, layer.path,
            ),
        )),
    }
}

/// Every module of the model that holds, directly, one `[d_in, d_out]` weight and at most one
/// `[d_out]` bias, and nothing else.
fn linear_like(slots: &[ParamSlot]) -> Vec<LinearLayer<'_>> {
    by_module(slots.iter())
        .into_iter()
        .filter_map(|(module, params)| as_linear(module, &params))
        .collect()
}

/// `slots` grouped by the module that holds them directly, in order.
fn by_module<'a>(slots: impl Iterator<Item = &'a ParamSlot>) -> Vec<(&'a str, Vec<&'a ParamSlot>)> {
    let mut modules: Vec<(&str, Vec<&ParamSlot>)> = vec![];
    for slot in slots {
        let module = slot.name.rsplit_once('.').map_or("", |(m, _)| m);
        match modules.iter_mut().find(|(m, _)| *m == module) {
            Some((_, params)) => params.push(slot),
            None => modules.push((module, vec![slot])),
        }
    }
    modules
}

/// The module at `module` as a linear layer, when `params` (what it holds directly) are one
/// `[d_in, d_out]` weight and at most one `[d_out]` bias.
fn as_linear<'a>(module: &'a str, params: &[&'a ParamSlot]) -> Option<LinearLayer<'a>> {
    let [weight] = params
        .iter()
        .filter(|p| p.shape.len() == 2)
        .collect::<Vec<_>>()[..]
    else {
        return None;
    };
    let (d_in, d_out) = (weight.shape[0], weight.shape[1]);
    let one_bias = params.len() <= 2
        && params
            .iter()
            .filter(|p| p.shape.len() != 2)
            .all(|p| p.shape == [d_out]);
    one_bias.then_some(LinearLayer {
        path: module,
        weight: &weight.name,
        d_in,
        d_out,
        has_bias: params.len() == 2,
    })
}

/// `path` names attention cores: modules whose one parameter, held directly, has no elements
/// ([`crate::nn::CausalAttention`]'s, which carries the sequence split to its forward).
fn check_attention_core(
    path: &ModulePath,
    slots: &[ParamSlot],
    names: &[&str],
) -> Result<(), ParallelError> {
    names_a_module(path, "context_parallel", names)?;
    let not_a_core = slots.iter().find(|s| {
        path.contains(&s.name) && (s.numel > 0 || s.name.split('.').count() != path.depth() + 1)
    });
    match not_a_core {
        None => Ok(()),
        Some(slot) => Err(refuse(
            path,
            "context_parallel",
            format!(
                "names a module that is not a flashover::nn::CausalAttention (it holds `{}`, \
                 {:?}): name the attention cores, whose forward attends across the ranks",
                slot.name, slot.shape
            ),
        )),
    }
}

/// A linear layer (or embedding table) a tensor-parallel path names: its path, `[d_in,
/// d_out]` (`[vocab, d]`), whether it has a bias.
struct LinearLayer<'a> {
    path: &'a str,
    /// Its weight's path.
    weight: &'a str,
    d_in: usize,
    d_out: usize,
    has_bias: bool,
}

/// The linear layers `path` names: modules whose parameters are one `[d_in, d_out]` weight
/// and at most one `[d_out]` bias, held directly.
fn linear_layers<'a>(
    path: &ModulePath,
    style: &str,
    slots: &'a [ParamSlot],
    names: &[&str],
) -> Result<Vec<LinearLayer<'a>>, ParallelError> {
    names_a_module(path, style, names)?;
    let inside: Vec<&ParamSlot> = slots.iter().filter(|s| path.contains(&s.name)).collect();
    if let Some(deep) = inside
        .iter()
        .find(|s| s.name.split('.').count() != path.depth() + 1)
    {
        return Err(refuse(
            path,
            style,
            format!(
                "names a module that is not a linear layer (it holds `{}`): name the linear \
                 layers inside it",
                deep.name
            ),
        ));
    }
    by_module(inside.into_iter())
        .into_iter()
        .map(|(module, params)| {
            as_linear(module, &params).ok_or_else(|| not_linear(path, style, module, &params))
        })
        .collect()
}

fn not_linear(
    path: &ModulePath,
    style: &str,
    module: &str,
    params: &[&ParamSlot],
) -> ParallelError {
    let shapes: Vec<String> = params
        .iter()
        .map(|p| format!("{} {:?}", p.name, p.shape))
        .collect();
    refuse(
        path,
        style,
        format!(
            "names `{module}`, which is not a linear layer (one [d_in, d_out] weight and at \
             most a [d_out] bias); it holds {}",
            shapes.join(", ")
        ),
    )
}

/// The split width divides into `tp` parts of whole units.
fn check_width(
    rule: &TensorParallelRule,
    path: &ModulePath,
    layer: &LinearLayer,
    tp: usize,
) -> Result<(), ParallelError> {
    let (what, width) = match rule.style {
        // Padded to a multiple of tp, as a vocabulary.
        TpStyle::Colwise if rule.padded && rule.unit == 1 => return Ok(()),
        TpStyle::Colwise => ("output features", layer.d_out),
        TpStyle::Rowwise => ("input features", layer.d_in),
        // Padded to a multiple of tp: any vocabulary splits.
        TpStyle::Vocab => return Ok(()),
    };
    let parts = tp * rule.unit;
    if width.is_multiple_of(parts) {
        return Ok(());
    }
    let units = if rule.unit > 1 {
        format!(" units of {} (unit = {})", rule.unit, rule.unit)
    } else {
        String::new()
    };
    Err(refuse(
        path,
        style_name(rule.style),
        format!(
            "splits `{}` over tp={tp}, but its {width} {what} do not divide into {tp} parts of \
             whole{units}: use a tp that divides {}",
            layer.path,
            width / rule.unit.max(1)
        ),
    ))
}

fn style_name(style: TpStyle) -> &'static str {
    match style {
        TpStyle::Colwise => "colwise",
        TpStyle::Rowwise => "rowwise",
        TpStyle::Vocab => "vocab",
    }
}

/// Fails, listing the model's parameters, when `path` (of a `kind` entry) names none of them.
fn names_a_module(path: &ModulePath, kind: &str, names: &[&str]) -> Result<(), ParallelError> {
    if names.iter().any(|n| path.contains(n)) {
        return Ok(());
    }
    Err(refuse(
        path,
        kind,
        format!(
            "names no module of the model; its parameters are: {}",
            preview(names)
        ),
    ))
}

fn refuse(path: &ModulePath, style: &str, why: String) -> ParallelError {
    ParallelError::Invalid(format!("plan path `{}` ({style}) {why}", path.as_str()))
}

/// The first few names of `names`, for an error message.
fn preview(names: &[&str]) -> String {
    let mut shown: Vec<&str> = names.iter().take(8).copied().collect();
    if names.len() > shown.len() {
        shown.push("...");
    }
    shown.join(", ")
}
