//! A plan checked against a model's parameters before anything moves: every path names
//! something, every tensor-parallel path names a linear layer, and every split width divides.
//! Each refusal names the path and the reason.

use super::plan::{ModulePath, ParallelizePlan, TensorParallelRule, TpStyle};
use crate::activation_checkpointing::CheckpointPolicy;
use crate::error::ParallelError;
use crate::params::ParamSlot;

/// Checks `plan` against the parameters `slots` of a model to be split over `tp` ranks (its
/// paths and styles only, not the widths, with `None`).
pub(super) fn check_plan(
    plan: &ParallelizePlan,
    slots: &[ParamSlot],
    tp: Option<usize>,
) -> Result<(), ParallelError> {
    let names: Vec<&str> = slots.iter().map(|s| s.name.as_str()).collect();
    for path in &plan.fully_shard {
        names_a_module(path, "fully_shard", &names)?;
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
    if tp.is_some_and(|tp| tp > 1) && !plan.sequence_parallel.is_empty() && !vocab {
        return Err(ParallelError::Invalid(
            "sequence_parallel: activations must reach the blocks split by sequence, which a \
             vocabulary-parallel token embedding does (its lookups are reduce-scattered along \
             the sequence): add a `vocab` rule for the token embedding"
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
        names_a_module(&rule.layers, "pipeline layers", &names)?;
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
    Ok(())
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
    let mut layers: Vec<(&str, Vec<&ParamSlot>)> = vec![];
    for slot in inside {
        let module = slot.name.rsplit_once('.').map_or("", |(m, _)| m);
        match layers.iter_mut().find(|(m, _)| *m == module) {
            Some((_, params)) => params.push(slot),
            None => layers.push((module, vec![slot])),
        }
    }
    layers
        .into_iter()
        .map(|(module, params)| {
            let weights: Vec<&&ParamSlot> = params.iter().filter(|p| p.shape.len() == 2).collect();
            let [weight] = weights[..] else {
                return Err(not_linear(path, style, module, &params));
            };
            let (d_in, d_out) = (weight.shape[0], weight.shape[1]);
            let others_are_one_bias = params.len() <= 2
                && params
                    .iter()
                    .filter(|p| p.shape.len() != 2)
                    .all(|p| p.shape == [d_out]);
            if !others_are_one_bias {
                return Err(not_linear(path, style, module, &params));
            }
            Ok(LinearLayer {
                path: module,
                d_in,
                d_out,
                has_bias: params.len() == 2,
            })
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
