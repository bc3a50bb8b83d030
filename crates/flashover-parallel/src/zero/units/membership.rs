//! Which fully sharded unit each parameter belongs to, and a unit's stored rows.

use crate::plan::ParallelizePlan;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use std::collections::HashMap;

/// Per unit, the stored rows of its parameters in `model` (flattened, by path): `slots` says
/// for each parameter (layout order) its path and unit, if it has one, of `units`. What
/// [`UnitScope::new`] and a pipeline layer's gather take.
pub(crate) fn unit_shards<M: Module>(
    model: &M,
    slots: &[Option<(String, usize)>],
    units: usize,
) -> Vec<Vec<(String, Tensor<1>)>> {
    struct Collect<'a> {
        slots: &'a [Option<(String, usize)>],
        index: usize,
        shards: Vec<Vec<(String, Tensor<1>)>>,
    }
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some((name, unit)) = &self.slots[self.index] {
                // A visitor sees the stored value (this rank's rows), without the
                // reparameterization.
                let rows = param.val();
                let numel = rows.shape().num_elements();
                self.shards[*unit].push((name.clone(), rows.reshape([numel])));
            }
            self.index += 1;
        }
    }
    let mut collect = Collect {
        slots,
        index: 0,
        shards: vec![vec![]; units],
    };
    model.visit(&mut collect);
    collect.shards
}

/// The unit of each fully sharded parameter `names` (paths, layout order): the longest
/// `fully_shard` path containing it, where each element of the first list of layers inside
/// that module is a unit of its own (TorchTitan shards each block, then the root): under
/// `fully_shard("")`, `blocks.0.attn.wq.weight` is unit `blocks.0` and `embed.weight` unit
/// `""`. Units are numbered in order of their first parameter.
pub(crate) fn units_of<'a>(
    plan: &ParallelizePlan,
    names: impl IntoIterator<Item = &'a str>,
) -> (HashMap<String, usize>, Vec<String>) {
    let mut unit_of = HashMap::new();
    let mut units: Vec<String> = vec![];
    for name in names {
        let Some(path) = plan
            .fully_shard
            .iter()
            .filter(|p| p.contains(name))
            .max_by_key(|p| p.depth())
        else {
            continue;
        };
        let segments: Vec<&str> = name.split('.').collect();
        // The last segment is the parameter itself, never a list element.
        let depth = (path.depth()..segments.len().saturating_sub(1))
            .find(|&i| segments[i].parse::<usize>().is_ok())
            .map_or(path.depth(), |i| i + 1);
        let unit = segments[..depth].join(".");
        let index = match units.iter().position(|u| *u == unit) {
            Some(i) => i,
            None => {
                units.push(unit);
                units.len() - 1
            }
        };
        unit_of.insert(name.to_string(), index);
    }
    (unit_of, units)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_of_layers_makes_one_unit_per_layer_and_the_deepest_path_wins() {
        let plan = ParallelizePlan::new()
            .fully_shard("")
            .fully_shard("blocks")
            .fully_shard("head.proj");
        let names = [
            "embed.weight",
            "blocks.0.attn.weight",
            "blocks.0.mlp.weight",
            "blocks.1.attn.weight",
            "head.proj.weight",
            "norm.weight",
        ];
        let (unit_of, units) = units_of(&plan, names);
        assert_eq!(units, ["", "blocks.0", "blocks.1", "head.proj"]);
        let index = |n: &str| unit_of[n];
        assert_eq!(index("embed.weight"), index("norm.weight"));
        assert_eq!(index("blocks.0.attn.weight"), index("blocks.0.mlp.weight"));
        assert_ne!(index("blocks.0.attn.weight"), index("blocks.1.attn.weight"));
        // A parameter directly in a list (`blocks.3` a tensor) is its list's unit.
        let (_, units) = units_of(&ParallelizePlan::new().fully_shard("scales"), ["scales.3"]);
        assert_eq!(units, ["scales"]);
        // The first list inside the module, however deep; lists inside an element stay in it.
        let names = [
            "embed.weight",
            "body.blocks.0.experts.1.weight",
            "body.blocks.0.experts.2.weight",
            "body.blocks.1.norm.weight",
        ];
        let (_, units) = units_of(&ParallelizePlan::new().fully_shard(""), names);
        assert_eq!(units, ["", "body.blocks.0", "body.blocks.1"]);
    }
}
