//! A plan's `expert_parallel` layers: each `ep` rank holds `n_experts / ep` of the experts of
//! every named mixture-of-experts layer ([`crate::moe::Moe`], found by type), and the
//! others become placeholders; the layer's forward ([`crate::expert_parallel::MoeForward`]) sends each
//! token to the rank that holds its expert and back.

use crate::error::ParallelError;
use crate::expert_parallel::{ExpertTraffic, Replicas};
use crate::moe::{Role, moe_params};
use crate::params::ParamLayout;
use crate::placed::ExpertSplit;
use crate::placement::PlacementTable;
use crate::plan::{ModulePath, ParallelizePlan};
use burn::module::Module;
use flashover_comm::{CommunicatorExt, Group, ReduceOp, control};
use flashover_runtime::Axis;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// A mixture-of-experts layer of a model, as its parameters show it.
#[derive(Debug, Clone)]
struct MoeLayer {
    /// Its module path (`blocks.1.moe`).
    path: String,
    /// Routed experts (the router's output width).
    n_experts: usize,
    /// Its router's parameter paths.
    router: Vec<String>,
    /// Per routed-expert parameter path, the expert's index.
    expert_of: HashMap<String, usize>,
}

/// Every [`crate::moe::Moe`] layer of `model`, found by type ([`moe_params`]).
fn moe_layers<M: Module>(model: &M) -> Vec<MoeLayer> {
    let mut layers: Vec<MoeLayer> = vec![];
    for param in moe_params(model) {
        let (Some(layer_path), Some((_, role))) = (param.layer_path(), param.in_layer) else {
            continue;
        };
        if layers.last().is_none_or(|l| l.path != layer_path) {
            layers.push(MoeLayer {
                path: layer_path,
                n_experts: 0,
                router: vec![],
                expert_of: HashMap::new(),
            });
        }
        let layer = layers.last_mut().expect("pushed");
        match role {
            Role::Router => {
                // The router's weight `[d_model, n_experts]` (it has no other matrix).
                if let [_, n_experts] = param.dims[..] {
                    layer.n_experts = n_experts;
                }
                layer.router.push(param.path());
            }
            Role::Experts => {
                let index = param.expert().expect("a Vec's entries are numbered");
                layer.expert_of.insert(param.path(), index);
            }
            Role::Shared => {}
        }
    }
    layers
}

/// The `expert_parallel` layers of a plan among `layers`: each path must name mixture-of-experts
/// layers whose experts divide over `ep` ranks.
fn named_layers<'a>(
    paths: &[ModulePath],
    layers: &'a [MoeLayer],
    ep: usize,
) -> Result<Vec<&'a MoeLayer>, ParallelError> {
    let mut named = vec![];
    for path in paths {
        let found: Vec<&MoeLayer> = layers
            .iter()
            .filter(|l| path.contains(&l.path) && path.depth() == l.path.split('.').count())
            .collect();
        if found.is_empty() {
            let all: Vec<&str> = layers.iter().map(|l| l.path.as_str()).collect();
            return Err(ParallelError::Invalid(format!(
                "plan path `{}` (expert_parallel) names no mixture-of-experts layer \
                 (flashover::models::Moe); the model's are: [{}]",
                path.as_str(),
                all.join(", ")
            )));
        }
        for layer in found {
            if !layer.n_experts.is_multiple_of(ep) {
                return Err(ParallelError::Invalid(format!(
                    "plan path `{}` (expert_parallel): `{}` has {} experts, which do not divide \
                     over ep = {ep}; use an ep that divides {}",
                    path.as_str(),
                    layer.path,
                    layer.n_experts,
                    layer.n_experts
                )));
            }
            named.push(layer);
        }
    }
    Ok(named)
}

/// A model's mixture-of-experts layers under a plan, seen from one rank.
pub(super) struct Experts {
    /// Which experts this rank holds, when the plan spreads them over more than one `ep` rank.
    pub(super) shares: Option<ExpertShares>,
    /// The routers of the `expert_parallel` layers, by parameter path, with their split.
    pub(super) routers: HashMap<String, ExpertSplit>,
    /// The routers of every `Moe` layer, by parameter path (they route whole sequences).
    pub(super) all_routers: HashSet<String>,
    /// Token rows the `expert_parallel` layers' dispatch sent to other ranks.
    pub(super) traffic: Arc<ExpertTraffic>,
    /// Under `replicate_hot_experts` with more than one `ep` rank: the step's hot-expert
    /// copies, and the paths of the routed experts' parameters (which must stay unsharded).
    pub(super) hot: Option<(Replicas, HashSet<String>)>,
}

impl Experts {
    /// The `Moe` layers of `model` (of parameters `layout`), and the `expert_parallel` ones of
    /// `plan` spread over `ep`. Fails naming a path that names no `Moe` layer, or a layer
    /// whose experts do not divide over `ep`.
    pub(super) fn of<M: Module>(
        model: &M,
        plan: &ParallelizePlan,
        layout: &ParamLayout,
        ep: &Group,
    ) -> Result<Self, ParallelError> {
        let layers = moe_layers(model);
        let spread = named_layers(&plan.expert_parallel, &layers, ep.size())?;
        let n_hot = plan.replicate_hot_experts;
        if n_hot > 0 {
            check_hot(n_hot, &spread)?;
        }
        let split = ep.size() > 1;
        let shares = split.then(|| ExpertShares::new(&spread, layout, ep));
        let traffic = Arc::new(ExpertTraffic::default());
        let hot = (split && n_hot > 0).then(|| {
            let experts = spread.iter().flat_map(|l| l.expert_of.keys().cloned());
            (Replicas::lazy(n_hot), experts.collect())
        });
        let routers = spread
            .iter()
            .filter(|_| split)
            .flat_map(|l| {
                let split = ExpertSplit {
                    group: ep.clone(),
                    n_experts: l.n_experts,
                    shared: crate::expert_parallel::share(
                        traffic.clone(),
                        hot.as_ref().map(|(r, _)| r.clone()).unwrap_or_default(),
                    ),
                };
                l.router.iter().map(move |p| (p.clone(), split.clone()))
            })
            .collect();
        let all_routers = layers.iter().flat_map(|l| l.router.clone()).collect();
        Ok(Experts {
            shares,
            routers,
            all_routers,
            traffic,
            hot,
        })
    }

    /// Fails, naming the parameter, when `sharded` (per parameter of `layout`: cut over
    /// `fsdp`) shards a routed expert that hot-expert replication copies.
    pub(super) fn check_unsharded(
        &self,
        layout: &ParamLayout,
        sharded: &[bool],
    ) -> Result<(), ParallelError> {
        let Some((_, experts)) = &self.hot else {
            return Ok(());
        };
        let cut = layout
            .slots
            .iter()
            .zip(sharded)
            .find(|(slot, sharded)| **sharded && experts.contains(&slot.name));
        match cut {
            Some((slot, _)) => Err(ParallelError::Invalid(format!(
                "replicate_hot_experts copies whole experts, but a fully_shard rule shards \
                 `{}` over fsdp (the copies' gradients would need a reduce-scatter of their \
                 own): leave the experts out of fully_shard, or set replicate_hot_experts = 0",
                slot.name
            ))),
            None => Ok(()),
        }
    }
}

/// Fails unless every layer of `layers` has at least `n` experts, and there is one.
fn check_hot(n: usize, layers: &[&MoeLayer]) -> Result<(), ParallelError> {
    if layers.is_empty() {
        return Err(ParallelError::Invalid(format!(
            "replicate_hot_experts = {n} copies experts of the plan's expert_parallel layers, \
             and the plan names none"
        )));
    }
    match layers.iter().find(|l| l.n_experts < n) {
        Some(l) => Err(ParallelError::Invalid(format!(
            "replicate_hot_experts = {n} exceeds the {} experts of `{}`",
            l.n_experts, l.path
        ))),
        None => Ok(()),
    }
}

/// Which experts this `ep` rank holds, and the gather that makes the whole model again.
pub(super) struct ExpertShares {
    ep: Group,
    /// Per parameter (layout order): whether this rank holds it.
    pub(super) held: Vec<bool>,
    /// The routed-expert parameters (layout order) whatever rank holds them.
    routed: Vec<bool>,
}

impl ExpertShares {
    /// The experts of `layers` spread over `ep` (rank `r` holds each layer's experts
    /// `r * n / ep ..`), for a model of parameters `whole`.
    fn new(layers: &[&MoeLayer], whole: &ParamLayout, ep: &Group) -> Self {
        let (rank, n) = (ep.rank(), ep.size());
        let expert_of = |name: &str| {
            layers
                .iter()
                .find_map(|l| l.expert_of.get(name).map(|&e| (e, l.n_experts / n)))
        };
        let owners: Vec<Option<usize>> = whole
            .slots
            .iter()
            .map(|slot| expert_of(&slot.name).map(|(e, per)| e / per))
            .collect();
        ExpertShares {
            ep: ep.clone(),
            held: owners.iter().map(|o| o.is_none_or(|o| o == rank)).collect(),
            routed: owners.iter().map(Option::is_some).collect(),
        }
    }

    /// Records that each routed expert's parameters (of the model of parameters `whole`) are
    /// their holder's own over `ep`.
    pub(super) fn place(
        &self,
        whole: &ParamLayout,
        placements: &mut PlacementTable,
    ) -> Result<(), ParallelError> {
        for (slot, routed) in whole.slots.iter().zip(&self.routed) {
            if *routed {
                placements.own(slot.id, Axis::Ep)?;
            }
        }
        Ok(())
    }

    /// Whether this rank's value of parameter `index` (layout order) is the one counted when
    /// the whole model is gathered over `ep`: a routed expert it holds, or, on `ep` rank 0, a
    /// parameter every `ep` rank holds.
    pub(super) fn counts(&self, index: usize) -> bool {
        self.held[index] && (self.routed[index] || self.ep.rank() == 0)
    }
}

/// What the plan's mixture-of-experts layers routed and sent on this rank
/// (`Parallelized::experts`): the whole batch's routing loads, and the token rows the
/// expert-parallel all-to-alls moved between ranks.
#[derive(Debug)]
pub struct ExpertRouting {
    /// The ranks that route different tokens (`dp` x `fsdp` x `ep` x `cp`).
    routed_apart: Group,
    /// The pipeline ranks, each of which counts its own layers (none without `pp`).
    pipeline: Option<Group>,
    /// Token rows the `expert_parallel` layers sent to other `ep` ranks.
    traffic: Arc<ExpertTraffic>,
}

impl ExpertRouting {
    /// Loads summed over `routed_apart` and `pipeline`; rows counted into `traffic`.
    pub(super) fn new(
        routed_apart: Group,
        pipeline: Option<Group>,
        traffic: Arc<ExpertTraffic>,
    ) -> Self {
        ExpertRouting {
            routed_apart,
            pipeline,
            traffic,
        }
    }

    /// The whole batch's routing loads of a step, the same on every rank: `stats`, what this
    /// rank's forwards counted ([`crate::expert_parallel::MoeForward::forward_counted`] into a hook,
    /// layers by index, `n_experts` each), summed over the ranks that route different tokens
    /// (`dp` x `fsdp` x `ep`, and `cp`, whose ranks route their own positions) and over the
    /// pipeline stages (each counts its own layers). `tp` ranks route the same tokens, and
    /// are not summed. Per layer (`layers` of them) and expert: what `Moe::update_bias` takes.
    /// Fails when `stats` counts more layers or experts. Collective.
    pub fn loads(
        &self,
        stats: &crate::moe::MoeStats,
        layers: usize,
        n_experts: usize,
    ) -> Result<Vec<Vec<u64>>, ParallelError> {
        let too_many = stats.routed.len() > layers
            || stats.routed.iter().any(|counts| counts.len() > n_experts);
        if too_many {
            return Err(ParallelError::Invalid(format!(
                "routing statistics of {} layers, up to {} experts each, do not fit {layers} \
                 layers of {n_experts} experts",
                stats.routed.len(),
                stats.routed.iter().map(Vec::len).max().unwrap_or(0)
            )));
        }
        let mut sums = vec![0u64; layers * n_experts];
        for (layer, counts) in stats.routed.iter().enumerate() {
            sums[layer * n_experts..][..counts.len()].copy_from_slice(counts);
        }
        if self.routed_apart.size() > 1 {
            control(|| self.routed_apart.all_reduce(&mut sums, ReduceOp::Sum))?;
        }
        if let Some(pp) = &self.pipeline {
            control(|| pp.all_reduce(&mut sums, ReduceOp::Sum))?;
        }
        Ok(sums
            .chunks(n_experts.max(1))
            .take(layers)
            .map(<[u64]>::to_vec)
            .collect())
    }

    /// Token rows this rank's `expert_parallel` layers sent to other `ep` ranks since the last
    /// call (forward and backward, counted by the sender; a rank's rows to itself move no
    /// bytes and are not counted): what the all-to-alls moved between ranks.
    pub fn rows_sent(&self) -> u64 {
        self.traffic.take()
    }
}
