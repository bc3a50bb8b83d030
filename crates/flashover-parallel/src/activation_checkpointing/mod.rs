//! Activation checkpointing (recomputation): keep less of the forward for backward and compute
//! it again when backward needs it. Not to be confused with training checkpoints
//! (`flashover-checkpoint`).
//!
//! - **Block-level** ([`checkpoint`]): any Burn module's forward runs outside the autodiff
//!   graph; only its input is kept (its parameters are alive anyway). In backward the forward
//!   runs again with a graph, from that input, and its own backward gives the gradients of the
//!   input and of every parameter, which continue into the outer graph (so data-parallel
//!   gradient hooks, tensor-parallel operators and fully sharded gathers see them as usual).
//!   The equivalent of `torch.utils.checkpoint`. [`CheckpointPolicy`] picks the transformer
//!   blocks: all, every k-th, or a list.
//! - **Selective**: Burn's balanced checkpointing (`Device::gradient_checkpointing`), which keeps
//!   the outputs of compute-bound operations (matrix products) and recomputes memory-bound ones
//!   (norms, activations, softmax, elementwise) in backward.
//!
//! **Random numbers:** the model's dropout masks are a hash of (seed, step, site, logical
//! coordinates) (`crate::dropout::Dropout`), not a stream: a recomputed forward draws exactly
//! the masks the first one drew, so gradients equal those without recomputation.
//!
//! Block-level recomputation is a custom autodiff op whose backward reruns the forward on the
//! device (module `op`), implemented for Flex and, with the `wgpu` / `cuda` features, the
//! CubeCL backend.

mod op;

use op::{RecomputeHook, recompute};

use crate::forward_context::{BlockFn, CheckpointHook, ForwardContext};
use crate::hook::hooks_supported;
use crate::moe::MoeHook;
use crate::params::ParamLayout;
pub use crate::plan::CheckpointPolicy;
use crate::recompute::recomputing;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, FloatDType, GradientCheckpointingStrategy, Tensor};
use burn_dispatch::DispatchTensor;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

impl CheckpointPolicy {
    /// What recomputes the blocks this policy names (`None` when it names none); its
    /// [`BlockRecompute::hook`] goes into the `ForwardContext`.
    pub fn block_recompute(&self) -> Option<Arc<BlockRecompute>> {
        self.is_block_level().then(|| {
            Arc::new(BlockRecompute {
                policy: self.clone(),
                recomputed: Arc::new(AtomicUsize::new(0)),
            })
        })
    }
}

/// Recomputes the blocks a [`CheckpointPolicy`] names, counting the recomputations.
pub struct BlockRecompute {
    policy: CheckpointPolicy,
    recomputed: Arc<AtomicUsize>,
}

impl BlockRecompute {
    /// The forward-context hook.
    pub fn hook(self: &Arc<Self>) -> CheckpointHook {
        CheckpointHook(self.clone())
    }

    /// Block forwards run again in backward so far.
    pub fn recomputed(&self) -> usize {
        self.recomputed.load(Ordering::Relaxed)
    }
}

impl BlockRecompute {
    /// `forward(block, x, ctx)` for block `layer`: recomputed in backward from `x` alone when
    /// the policy names the layer (through [`ForwardContext::block`]). `aux_losses`: whether
    /// the block adds auxiliary losses to `ctx`'s `moe` hook.
    pub fn run<B: Module + Send + Sync + 'static>(
        &self,
        layer: usize,
        block: &B,
        x: Tensor<3>,
        ctx: &ForwardContext,
        aux_losses: bool,
        forward: BlockFn<B>,
    ) -> Tensor<3> {
        if !self.policy.recomputes_block(layer) {
            return forward(block, x, ctx);
        }
        if let (Some(moe), true) = (&ctx.moe, aux_losses) {
            return self.run_with_aux_losses(block, x, ctx, moe, forward);
        }
        let replays = self.replays();
        let ctx = ctx.clone();
        checkpoint(block, x, move |b: &B, x: Tensor<3>| {
            replays.next_is_replay();
            forward(b, x, &ctx)
        })
    }
}

/// Tells a checkpointed function's runs apart: the first (in forward) from the ones after it
/// (recomputations in backward), which it counts. Not by whether the input is tracked: on a
/// device without the recompute op the first call is the only one, with a graph.
pub(crate) struct Replays {
    calls: AtomicUsize,
    recomputed: Arc<AtomicUsize>,
}

impl Replays {
    /// Counts one checkpointed function's recomputations into `recomputed`.
    pub(crate) fn new(recomputed: Arc<AtomicUsize>) -> Self {
        Replays {
            calls: AtomicUsize::new(0),
            recomputed,
        }
    }

    /// Whether this call is a recomputation (counted if so).
    pub(crate) fn next_is_replay(&self) -> bool {
        let replay = self.calls.fetch_add(1, Ordering::Relaxed) > 0;
        if replay {
            self.recomputed.fetch_add(1, Ordering::Relaxed);
        }
        replay
    }
}

impl BlockRecompute {
    /// A counter of one checkpointed block's runs, adding its recomputations to this policy's.
    fn replays(&self) -> Replays {
        Replays::new(self.recomputed.clone())
    }

    /// A mixture-of-experts block, recomputed. Its router's auxiliary losses are a second
    /// output: they leave the checkpointed function as one more element after the block's
    /// output (in f32), so their gradient reaches the router through the recomputation, as the
    /// block output's does. The first run records the routing statistics; the run in backward
    /// records nothing (it would count twice).
    fn run_with_aux_losses<B: Module + Send + Sync + 'static>(
        &self,
        block: &B,
        x: Tensor<3>,
        ctx: &ForwardContext,
        moe: &MoeHook,
        forward: BlockFn<B>,
    ) -> Tensor<3> {
        let (dims, dtype) = (x.dims(), x.dtype());
        let numel = dims.iter().product();
        let first = ForwardContext {
            moe: Some(moe.with_own_aux_losses()),
            ..ctx.clone()
        };
        let again = ForwardContext {
            moe: Some(moe.replaying()),
            ..ctx.clone()
        };
        let replays = self.replays();
        let output = checkpoint(block, x, move |b: &B, x: Tensor<3>| {
            let ctx = match replays.next_is_replay() {
                false => &first,
                true => &again,
            };
            let y = forward(b, x, ctx);
            let device = y.device();
            let aux = ctx.moe.as_ref().and_then(MoeHook::take_aux_loss);
            let aux = aux.unwrap_or_else(|| Tensor::zeros([1], &device));
            let y = y.cast(FloatDType::F32).reshape([numel]);
            Tensor::cat(vec![y, aux.cast(FloatDType::F32).reshape([1])], 0)
        });
        moe.push_aux_loss(output.clone().narrow(0, numel, 1));
        output.narrow(0, 0, numel).reshape(dims).cast(dtype)
    }
}

/// `t` outside any graph. `detach` alone keeps a leaf's `require_grad` (Burn keeps it so that a
/// detached parameter stays trainable), and a forward from such a leaf would record a graph.
fn untracked<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    t.detach().set_require_grad(false)
}

struct Detach;

impl ModuleMapper for Detach {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(untracked)
    }
}

/// Parameters as fresh leaves of a new graph (same ids and values).
struct Leaves;

impl ModuleMapper for Leaves {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|t| t.detach().require_grad())
    }
}

/// `forward(module, x)`, keeping only `x` for backward and running `forward` again there (see
/// the [module docs](self)). Falls back to a plain call when nothing needs a gradient or the
/// device has no recompute op (not an autodiff device of a backend it is built for).
///
/// Parameters a `parallelize` plan placed work too: the recomputation reads them through their
/// reparameterization again (a fully sharded unit is gathered again in backward, so between
/// its forward and backward a rank keeps its shard, not the gathered weights), and their
/// gradients reach the stored parts.
pub fn checkpoint<M, const D: usize, const E: usize, F>(
    module: &M,
    x: Tensor<D>,
    forward: F,
) -> Tensor<E>
where
    M: Module + Send + Sync + 'static,
    F: Fn(&M, Tensor<D>) -> Tensor<E> + Send + Sync + 'static,
{
    checkpoint_part(module, x, forward, None)
}

/// [`checkpoint`] that carries into backward only the parameters of `module` that `part`
/// marks (one flag per parameter, in layout order; `None`: all of them), so a layer of a whole
/// model costs its own parameters. `forward` must read no other parameter: in backward a
/// gradient reaching one fails, naming it (it would otherwise be lost).
pub(crate) fn checkpoint_part<M, const D: usize, const E: usize, F>(
    module: &M,
    x: Tensor<D>,
    forward: F,
    part: Option<Arc<[bool]>>,
) -> Tensor<E>
where
    M: Module + Send + Sync + 'static,
    F: Fn(&M, Tensor<D>) -> Tensor<E> + Send + Sync + 'static,
{
    let device = x.device();
    let marked = marked_params(module, part.as_deref());
    let tracked = x.is_tracked() || marked.iter().any(|(_, p)| p.is_tracked());
    if !tracked || !hooks_supported(&device) {
        return forward(module, x);
    }
    let params = match marked.is_empty() {
        true => Tensor::<1>::zeros([0], &device),
        false => Tensor::cat(marked.iter().map(|(_, p)| p.clone()).collect(), 0),
    };
    // Shares the parameters' storage: nothing is copied.
    let values = module.clone().map(&mut Detach);
    // Both runs read the parameters apart from any unit gathered around them: the first
    // from the values of the parameters collected above.
    let stored = marked.into_iter().map(|(id, p)| (id, untracked(p)));
    let y = recomputing(stored.collect(), false, || {
        forward(&values, untracked(x.clone()))
    });
    let dtypes = (x.dtype(), y.dtype());
    let strategy = x.gradient_checkpointing_strategy();
    let hook = RecomputeHook(Arc::new(
        move |x: DispatchTensor, grad_y: DispatchTensor| {
            let module = values.clone().map(&mut Leaves);
            let stored = marked_params(&module, part.as_deref())
                .into_iter()
                .collect();
            recomputing(stored, true, || {
                let (grad_x, grad_params) = regrad(
                    &module,
                    &forward,
                    Tensor::from_dispatch(x),
                    Tensor::from_dispatch(grad_y),
                    dtypes,
                    strategy,
                    part.as_deref(),
                );
                (grad_x.into_dispatch(), grad_params)
            })
        },
    ));
    recompute(x, params, y, hook)
}

/// The body of a recomputation in backward: `forward(module, x)` run again with a graph from
/// the saved input `x` and the output gradient `grad_y` (untracked tensors of the inner
/// backend), returning the input's gradient and the gradients of `module`'s parameters that
/// `part` marks (all without it), flattened in layout order in f32 (zero where a parameter got
/// none), all on the device. `dtypes` are the input's and output's dtypes in the forward;
/// `strategy` the forward's autodiff context (`None`: none).
pub(crate) fn regrad<M, const D: usize, const E: usize>(
    module: &M,
    forward: &impl Fn(&M, Tensor<D>) -> Tensor<E>,
    x: Tensor<D>,
    grad_y: Tensor<E>,
    (x_dtype, y_dtype): (DType, DType),
    strategy: Option<GradientCheckpointingStrategy>,
    part: Option<&[bool]>,
) -> (Tensor<D>, Tensor<1>)
where
    M: Module,
{
    let inner = x.device();
    let x = match strategy {
        Some(s) => x.autodiff().with_gradient_checkpointing_strategy(s),
        None => x,
    };
    let x = x.cast(x_dtype).require_grad();
    let y = forward(module, x.clone());
    let mut grads = (y * grad_y.cast(y_dtype)).sum().backward();
    // Hot-expert copies the layer ran on are not its parameters: their step folds them.
    crate::recompute::settle_claims(&mut grads);
    let grad_x = x
        .grad(&grads)
        .unwrap_or_else(|| Tensor::<D>::zeros(x.shape(), &inner).cast(x_dtype));
    let params = GradientsParams::from_grads(grads, module);
    let layout = ParamLayout::of(module);
    let found = flat_grads(module, &params);
    let held = |i: usize| part.is_none_or(|p| p[i]);
    if let Some((slot, _)) = layout
        .slots
        .iter()
        .zip(&found)
        .enumerate()
        .find(|(i, (_, g))| g.is_some() && !held(*i))
        .map(|(_, pair)| pair)
    {
        panic!(
            "a recomputed layer read `{}`, a parameter outside it: name the layers so that each \
             reads only its own parameters (its gradient would be lost)",
            slot.name
        );
    }
    let pieces: Vec<Tensor<1>> = layout
        .slots
        .iter()
        .zip(found)
        .enumerate()
        .filter(|(i, _)| held(*i))
        .map(|(_, (slot, grad))| grad.unwrap_or_else(|| Tensor::zeros([slot.numel], &inner)))
        .collect();
    let flat = match pieces.is_empty() {
        true => Tensor::zeros([0], &inner),
        false => Tensor::cat(pieces, 0),
    };
    (grad_x, flat)
}

/// Per float parameter of `module` (layout order), its gradient in `grads` flattened, in f32.
fn flat_grads<M: Module>(module: &M, grads: &GradientsParams) -> Vec<Option<Tensor<1>>> {
    struct Collect<'a> {
        grads: &'a GradientsParams,
        found: Vec<Option<Tensor<1>>>,
    }
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let grad = self.grads.get::<D>(param.id).map(|g| {
                let numel = g.shape().num_elements();
                g.reshape([numel]).cast(FloatDType::F32)
            });
            self.found.push(grad);
        }
    }
    let mut c = Collect {
        grads,
        found: vec![],
    };
    module.visit(&mut c);
    c.found
}

/// The float parameters of `module` that `part` marks (all without it), in layout order, by
/// id: their stored values (a visitor sees a parameter without its reparameterization),
/// flattened.
pub(crate) fn marked_params<M: Module>(
    module: &M,
    part: Option<&[bool]>,
) -> Vec<(ParamId, Tensor<1>)> {
    struct Collect<'a> {
        part: Option<&'a [bool]>,
        index: usize,
        params: Vec<(ParamId, Tensor<1>)>,
    }
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let held = self.part.is_none_or(|p| p[self.index]);
            self.index += 1;
            if held {
                let t = param.val();
                let numel = t.shape().num_elements();
                self.params.push((param.id, t.reshape([numel])));
            }
        }
    }
    let mut c = Collect {
        part,
        index: 0,
        params: vec![],
    };
    module.visit(&mut c);
    c.params
}
