//! ZeRO-3 / FSDP: a module whose parameters live as one flat shard per rank, gathered just
//! before use and released after.
//!
//! [`FullyShardConfig::init`] turns any Burn module into a [`FullyShardedUnit`]: each of its
//! float parameters is cut along its first dimension over the shard group, as FSDP2 does
//! ([`UnitShards`]), and a rank keeps only its rows of each, packed into the unit's one Burn
//! parameter, so a model made of units is itself a Burn module whose parameters are shards.
//! Wrap each transformer block in its own unit (and the rest of the model in one more) to get
//! the FSDP policy "every block".
//!
//! **When parameters are gathered** ([`FullyShardedUnit::forward`]): one all-gather just before
//! the unit's forward. With `reshard_after_forward` the full parameters are dropped as soon as
//! the forward returns and gathered again in backward, where the unit's forward is recomputed
//! from its saved input (Burn's autodiff keeps the tensors an op needs for backward, so the only
//! way to free a unit's weights between forward and backward is to not record its forward at
//! all: this is unit-level activation recomputation). Without it, the full parameters stay alive
//! from forward to backward and nothing is recomputed.
//! **Gradients** reach the shards through a reduce-scatter in the unit's backward; see
//! [`super::FullyShardedOptimizer`] for the step (and HSDP's all-reduce across replicas).
//! **Prefetch:** every collective runs on the [`ShardGroup`]'s communication thread, so
//! [`FullyShardedUnit::prefetch`] starts the next unit's all-gather while this one computes,
//! and [`FullyShardedUnit::forward_prefetching`] names the unit whose all-gather to start when
//! this one's backward begins (the unit before it in forward order), as FSDP2's
//! `set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch` do.
//!
//! These ops run host code in their backward: on Flex, and on the CubeCL backend (wgpu, CUDA)
//! with the `wgpu` / `cuda` features.

use super::ops::{ScatterHook, gather_shard};
use super::shard_group::{Pending, ShardGroup};
use super::unit_shards::UnitShards;
use crate::activation_checkpointing::{RecomputeHook, recompute, regrad};
use crate::error::ParallelError;
use crate::hook::hooks_supported;
use crate::params::{
    ParamLayout, ParamSlot, broadcast_module, flatten_params, placeholders, to_f32,
};
use crate::placement::{ParamPlacement, PlacementTable};
use burn::config::Config;
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Device, Shape, Tensor, TensorData};
use flashover_runtime::Axis;
use std::sync::{Arc, Mutex};

/// How a unit's parameters are gathered and released.
#[derive(Config, Debug)]
pub struct FullyShardConfig {
    /// Free the gathered parameters right after the unit's forward and gather them again in
    /// its backward (recomputing the unit's forward there). `false` keeps them from forward to
    /// backward: more memory, no second all-gather, no recomputation.
    #[config(default = true)]
    pub reshard_after_forward: bool,
}

/// What a unit needs besides its shard; shared (behind an `Arc`) by clones of the unit and by
/// the backward closures it records.
struct UnitSpec<M> {
    /// The module with placeholder parameters: only its structure is used.
    skeleton: Mutex<M>,
    layout: ParamLayout,
    shards: UnitShards,
    shard_group: Arc<ShardGroup>,
    reshard_after_forward: bool,
    /// An all-gather of this unit submitted ahead of use (a prefetch).
    pending: Mutex<Option<Pending>>,
}

impl<M> std::fmt::Debug for UnitSpec<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnitSpec")
            .field("params", &self.layout.slots.len())
            .field("numel", &self.layout.numel)
            .field("shards", &self.shards)
            .field("group", &self.shard_group.group().name())
            .finish()
    }
}

/// One fully sharded unit; see [`FullyShardConfig`]. Its only Burn parameter is this rank's
/// shard of the unit's flattened parameters.
#[derive(Module, Debug)]
pub struct FullyShardedUnit<M: Send + Sync + 'static> {
    /// This rank's shard (padded), the parameter the optimizer steps.
    pub shard: Param<Tensor<1>>,
    #[module(skip)]
    spec: Arc<UnitSpec<M>>,
}

impl FullyShardConfig {
    /// Shards `module` over `shard_group` (collective: rank 0's parameters are broadcast first,
    /// so every rank starts from the same values). The units of one model share one group.
    pub fn init<M: Module + Sync + 'static>(
        &self,
        module: M,
        shard_group: &Arc<ShardGroup>,
    ) -> Result<FullyShardedUnit<M>, ParallelError> {
        let group = shard_group.group();
        let device = module
            .devices()
            .into_iter()
            .next()
            .ok_or_else(|| ParallelError::Invalid("a sharded unit needs parameters".into()))?;
        if !hooks_supported(&device) {
            return Err(ParallelError::Invalid(format!(
                "fully sharded units run host code in backward and need an autodiff device of a \
                 backend their ops are built for (Flex; wgpu/CUDA with those features); the module \
                 is on {device:?}"
            )));
        }
        let module = broadcast_module(module, group, 0)?;
        let layout = ParamLayout::of(&module);
        let shards = UnitShards::new(&layout, group.size());
        let own = shards.take(group.rank(), &flatten_params(&module));
        let shard = Param::from_data(TensorData::new(own, [shards.shard_len()]), &device);
        let skeleton = placeholders(module);
        Ok(FullyShardedUnit {
            shard,
            spec: Arc::new(UnitSpec {
                skeleton: Mutex::new(skeleton),
                layout,
                shards,
                shard_group: shard_group.clone(),
                reshard_after_forward: self.reshard_after_forward,
                pending: Mutex::new(None),
            }),
        })
    }
}

/// Where materialised parameters come from.
enum Source<'a> {
    /// Host values, as tensors that are (`true`) or are not new autodiff leaves.
    Host(&'a [f32], bool),
    /// Slices of a tracked full buffer.
    Tracked(&'a Tensor<1>),
}

struct Materialize<'a> {
    source: Source<'a>,
    layout: &'a ParamLayout,
    index: usize,
    device: Device,
}

impl ModuleMapper for Materialize<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let slot = &self.layout.slots[self.index];
        self.index += 1;
        let range = slot.offset..slot.offset + slot.numel;
        let shape = Shape::from(slot.shape.clone());
        param.map(|_| match &self.source {
            Source::Host(values, leaf) => {
                let data = TensorData::new(values[range].to_vec(), shape);
                let t = Tensor::from_data(data, &self.device);
                if *leaf { t.require_grad() } else { t }
            }
            Source::Tracked(full) => Tensor::clone(full).slice(range).reshape(shape),
        })
    }
}

impl<M: Module + Sync + 'static> UnitSpec<M> {
    fn materialize(&self, source: Source<'_>, device: &Device) -> M {
        let skeleton = self
            .skeleton
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        skeleton.map(&mut Materialize {
            source,
            layout: &self.layout,
            index: 0,
            device: device.clone(),
        })
    }

    fn bytes(&self) -> usize {
        self.layout.numel * 4
    }

    /// Submits the all-gather of `shard` unless one is already pending (a prefetch).
    fn prefetch(&self, shard: &Tensor<1>) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if pending.is_none() {
            self.shard_group.stats().gathered(self.bytes(), true);
            *pending = Some(self.shard_group.all_gather(to_f32(shard.clone())));
        }
    }

    /// The unit's parameters (parameter-major, unpadded) from the prefetched all-gather's
    /// result, or a new all-gather.
    fn all_gather(&self, shard: &Tensor<1>) -> Result<Vec<f32>, ParallelError> {
        let pending = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let pending = pending.unwrap_or_else(|| {
            self.shard_group.stats().gathered(self.bytes(), false);
            self.shard_group.all_gather(to_f32(shard.clone()))
        });
        let t0 = std::time::Instant::now();
        let gathered = pending.wait();
        self.shard_group.stats().waited(t0.elapsed());
        Ok(self.shards.assemble(&gathered?))
    }

    /// Reduce-scatters (sums) the gradient of the unit's parameters (parameter-major): this
    /// rank's shard of it. Runs inside Burn's backward, which cannot return errors: a failed
    /// collective panics with the `CommError` as payload, which the launcher reports like a
    /// returned error.
    fn reduce_scatter(&self, full: Vec<f32>) -> Vec<f32> {
        let full = self.shards.rank_major(&full);
        let t0 = std::time::Instant::now();
        let shard = self.shard_group.reduce_scatter(full).wait();
        self.shard_group.stats().waited(t0.elapsed());
        match shard {
            Ok(shard) => shard,
            Err(e) => std::panic::panic_any(e),
        }
    }
}

/// A unit's all-gather, ready to be started later by another unit (see
/// [`FullyShardedUnit::forward_prefetching`]).
#[derive(Clone)]
pub struct Prefetch(Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for Prefetch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Prefetch")
    }
}

impl<M: Module + Sync + 'static> FullyShardedUnit<M> {
    /// Elements of the unit's parameters (unpadded).
    pub fn numel(&self) -> usize {
        self.spec.layout.numel
    }

    /// The unit's parameter layout (names and shapes of the full parameters).
    pub fn layout(&self) -> &ParamLayout {
        &self.spec.layout
    }

    /// How the unit's parameters are cut over the group.
    pub fn shards(&self) -> &UnitShards {
        &self.spec.shards
    }

    /// The unit's shard as pieces of its parameters, for a flat vector in which the shard
    /// starts at `base`: each parameter's entry in `placements` (found by the id it had before
    /// sharding) with its rows split over `axis` ([`UnitShards::placed`]).
    pub fn placed(
        &self,
        placements: &PlacementTable,
        axis: Axis,
        base: usize,
    ) -> Result<Vec<(ParamSlot, ParamPlacement)>, ParallelError> {
        self.spec
            .shards
            .placed(&self.spec.layout, placements, axis, base)
    }

    /// The full module, gathered now and differentiable with respect to the shard: its
    /// parameters stay alive until the step's backward has passed through them, which then
    /// reduce-scatters their gradient into the shard's.
    pub fn gather(&self) -> Result<M, ParallelError> {
        let shard = self.shard.val();
        let device = shard.device();
        let full = self.spec.all_gather(&shard)?;
        let padded = full.len();
        let full = Tensor::<1>::from_data(TensorData::new(full, [padded]), &device);
        let tracked = shard.is_require_grad();
        let spec = self.spec.clone();
        let hook = ScatterHook(Arc::new(move |grad: Vec<f32>| {
            spec.shard_group.stats().released(spec.bytes());
            spec.reduce_scatter(grad)
        }));
        if !tracked {
            // No backward will release them: account for them as released now.
            self.spec.shard_group.stats().released(self.spec.bytes());
        }
        let full = gather_shard(shard, full, hook);
        Ok(self.spec.materialize(Source::Tracked(&full), &device))
    }

    /// Starts this unit's all-gather now, on the communication thread, so that its next
    /// [`FullyShardedUnit::gather`] or forward finds the parameters ready. Call it for the next
    /// unit before running the current one.
    pub fn prefetch(&self) {
        self.spec.prefetch(&self.shard.val());
    }

    /// A handle that starts this unit's all-gather when called: pass it as `backward_prefetch`
    /// to the unit that runs after this one in forward.
    pub fn prefetch_handle(&self) -> Prefetch {
        let spec = self.spec.clone();
        // The shard's storage, shared with the parameter, not copied.
        let shard = self.shard.val().detach();
        Prefetch(Arc::new(move || spec.prefetch(&shard)))
    }

    /// Whether the unit's forward is recomputed in backward (it reshards after forward).
    pub fn recomputes(&self) -> bool {
        self.spec.reshard_after_forward
    }

    /// Runs `f` (the unit's forward) on `x` with the unit's parameters gathered, as the
    /// configuration says (see [`FullyShardConfig`]).
    pub fn forward<const D: usize, const E: usize, F>(
        &self,
        x: Tensor<D>,
        f: F,
    ) -> Result<Tensor<E>, ParallelError>
    where
        F: Fn(&M, Tensor<D>) -> Tensor<E> + Send + Sync + 'static,
    {
        self.forward_prefetching(x, f, None)
    }

    /// [`FullyShardedUnit::forward`], and when this unit's backward begins (with
    /// `reshard_after_forward`), first start `backward_prefetch`: the all-gather of the unit
    /// whose backward comes next.
    pub fn forward_prefetching<const D: usize, const E: usize, F>(
        &self,
        x: Tensor<D>,
        f: F,
        backward_prefetch: Option<Prefetch>,
    ) -> Result<Tensor<E>, ParallelError>
    where
        F: Fn(&M, Tensor<D>) -> Tensor<E> + Send + Sync + 'static,
    {
        let shard = self.shard.val();
        if !self.spec.reshard_after_forward || !shard.is_require_grad() {
            return Ok(f(&self.gather()?, x));
        }
        let device = shard.device();
        let bytes = self.spec.bytes();
        // The shard's storage, shared (not copied) with the parameter, for the backward gather.
        let saved_shard = shard.clone().detach();
        let y = {
            let full = self.spec.all_gather(&saved_shard)?;
            let module = self.spec.materialize(Source::Host(&full, false), &device);
            f(&module, x.clone().detach().set_require_grad(false))
        };
        self.spec.shard_group.stats().released(bytes);
        let spec = self.spec.clone();
        let dtypes = (x.dtype(), y.dtype());
        let hook = RecomputeHook(Arc::new(move |x: TensorData, grad_y: TensorData| {
            let full = spec.all_gather(&saved_shard);
            if let Some(next) = &backward_prefetch {
                (next.0)();
            }
            let full = match full {
                Ok(full) => full,
                Err(ParallelError::Comm(e)) => std::panic::panic_any(e),
                Err(e) => panic!("FSDP parameter all-gather in backward failed: {e}"),
            };
            let module = spec.materialize(Source::Host(&full, true), &device);
            drop(full);
            let (grad_x, flat) = regrad(&module, &f, x, grad_y, dtypes, &device, None);
            drop(module);
            spec.shard_group.stats().released(bytes);
            (grad_x, spec.reduce_scatter(flat))
        }));
        Ok(recompute(x, shard, y, hook))
    }
}
