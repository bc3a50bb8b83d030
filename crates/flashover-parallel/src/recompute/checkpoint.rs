//! The recompute op's entry points: a module's forward run again in backward from its input
//! alone ([`checkpoint`]), and the body of that rerun ([`regrad`]).

use super::op::{RecomputeHook, recompute};
use super::{recomputing, settle_claims};
use crate::hook::hooks_supported;
use crate::params::ParamLayout;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, FloatDType, GradientCheckpointingStrategy, Tensor};
use burn_dispatch::DispatchTensor;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

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

/// `t` outside any graph. `detach` alone keeps a leaf's `require_grad` (Burn keeps it so that a
/// detached parameter stays trainable), and a forward from such a leaf would record a graph.
fn untracked<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    t.detach().set_require_grad(false)
}

/// Parameters outside any graph. A lazy parameter no forward has read yet (a gradient hook
/// made at its first read) is left lazy, unread: its first read belongs to the forward that
/// reads it, not to this layer's checkpoint, and made in backward it would register a node
/// in the graph being run.
struct Detach;

impl ModuleMapper for Detach {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        match param.is_initialized() {
            true => param.map(untracked),
            false => param,
        }
    }
}

/// Parameters as fresh leaves of a new graph (same ids and values); a lazy one not read yet
/// left lazy, as [`Detach`] leaves it.
struct Leaves;

impl ModuleMapper for Leaves {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        match param.is_initialized() {
            true => param.map(|t| t.detach().require_grad()),
            false => param,
        }
    }
}

/// `forward(module, x)`, keeping only `x` for backward and running `forward` again there (see
/// `crate::activation_checkpointing`'s docs). Falls back to a plain call when nothing needs a gradient or the
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
    settle_claims(&mut grads);
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
