//! A gradient hook: forward identity; backward hands the gradient (flat, on its device) to a
//! callback, which takes it over: the parameter never receives the gradient, so Burn's gradient
//! container stays free of it (the reducer's bucket is the only copy, which is what lets ZeRO-2
//! hold only a shard). This is how DDP learns, during backward, that a parameter's gradient is
//! final, so its bucket can be reduced while backward continues.
//!
//! Burn 0.22.1 has no tensor hooks; this is a backend-extension op with a hand-written backward
//! (see the project notes' custom-backward recipe). It is implemented for Flex and, with the
//! `wgpu` / `cuda` features, for the CubeCL backend; on other backends the strategies fall
//! back to reading gradients after backward.

use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension, tensor::FloatTensor};
use burn::tensor::{Device, Tensor};
use burn_dispatch::{DispatchKindConversion, DispatchTensor};
use std::sync::Arc;

/// A function receiving a gradient, flattened (row-major), as a tensor of the inner backend
/// outside any graph, on the parameter's device and in the gradient's dtype.
pub type GradFn = dyn Fn(Tensor<1>) + Send + Sync;

/// The callback a hook calls with a gradient's values.
#[derive(Clone)]
pub struct GradCallback(pub Arc<GradFn>);

impl std::fmt::Debug for GradCallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GradCallback")
    }
}

#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub trait GradHookOps: Backend {
    /// Forward: identity. Backward: calls `callback` with the gradient, which does not reach
    /// `x` (the callback took it over).
    fn grad_hook(x: FloatTensor<Self>, callback: GradCallback) -> FloatTensor<Self>;

    /// [`Self::grad_hook`] placed in the backward tape right after `after`'s consumers: Burn
    /// runs backward by depth, and this op is as deep as `after` (whose value it ignores and
    /// to which it hands no gradient), not as shallow as `x`.
    fn grad_hook_after(
        x: FloatTensor<Self>,
        after: FloatTensor<Self>,
        callback: GradCallback,
    ) -> FloatTensor<Self>;
}

crate::collective_op::for_inner_backends! {
    impl GradHookOps {
        fn grad_hook(x: FloatTensor<Self>, _callback: GradCallback) -> FloatTensor<Self> {
            x
        }

        fn grad_hook_after(
            x: FloatTensor<Self>,
            _after: FloatTensor<Self>,
            _callback: GradCallback,
        ) -> FloatTensor<Self> {
            x
        }
    }
}

#[derive(Debug)]
struct HookBackward;

impl<B: Backend, const N: usize> Backward<B, N> for HookBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = GradCallback;

    fn backward(
        self,
        ops: Ops<GradCallback, N>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let callback = ops.state;
        // Consumed, not registered for a parent: the parameter never receives it (nor does
        // the op that only places the hook, `after`).
        let grad: Tensor<1> =
            crate::collective_op::to_tensor::<B, 1>(grads.consume::<B>(&ops.node));
        let numel = grad.shape().num_elements();
        (callback.0)(grad.reshape([numel]));
    }
}

impl<B: Backend, C: CheckpointStrategy> GradHookOps for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn grad_hook(x: FloatTensor<Self>, callback: GradCallback) -> FloatTensor<Self> {
        let node = x.node();
        match HookBackward.prepare::<C>([node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(callback, x.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(x.into_primitive()),
        }
    }

    fn grad_hook_after(
        x: FloatTensor<Self>,
        after: FloatTensor<Self>,
        callback: GradCallback,
    ) -> FloatTensor<Self> {
        let nodes = [x.node(), after.node()];
        match HookBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(callback, x.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(x.into_primitive()),
        }
    }
}

/// How many levels of Burn's backward tape lie between the hooks of two parameters read one
/// after the other ([`ReadDepths`]): more than the ops between two parameter reads of the
/// layers this project meets (Burn's attention core, about 16 levels from its value
/// projection's read to its output projection's; a layer norm, about 8). A stretch deeper
/// than this puts the hooks after it later in backward than they could be, never wrong.
pub(crate) const LEVELS_PER_READ: usize = 128;

/// Where in backward a parameter's hook runs when the model is not cut into layers whose
/// inputs the plan sees (a loop of one's own): Burn runs the tape by depth, deepest first,
/// and the `r`-th parameter a forward reads gets its hook placed `r` x [`LEVELS_PER_READ`]
/// levels deep ([`grad_hook_after`] an untracked one-element tensor of that depth, which
/// takes no part in the graph). Its consumer, the op that computes with it, is then at
/// least as deep, so the hook runs right after that op's backward, as PyTorch's engine runs
/// a parameter's gradient accumulator in reverse creation order. A parameter read again
/// later has its hook from its first read: its gradient is final only after that read's
/// backward, the last of its reads' to run.
#[derive(Default)]
pub(crate) struct ReadDepths {
    /// Per depth `r` x [`LEVELS_PER_READ`] reached so far (`r` from 1), its tensor, on the
    /// device they were built for.
    rungs: std::sync::Mutex<(Option<Device>, Vec<Tensor<1>>)>,
}

impl ReadDepths {
    /// What the hook of the `read`-th parameter a forward reads (from 0) goes after: nothing
    /// for the first (the end of backward), a rung `read` deep for the others.
    fn anchor(&self, read: usize, device: &Device) -> Option<Tensor<1>> {
        (read > 0).then(|| self.rung(read, device))
    }

    /// An untracked tensor `r` x [`LEVELS_PER_READ`] deep on `device` (built once: a chain
    /// of that many one-element ops, each a level deeper than the one before).
    fn rung(&self, r: usize, device: &Device) -> Tensor<1> {
        let mut rungs = self.rungs.lock().unwrap_or_else(|p| p.into_inner());
        if rungs.0.as_ref() != Some(device) {
            *rungs = (Some(device.clone()), vec![]);
        }
        while rungs.1.len() < r {
            let below = (rungs.1.last().cloned()).unwrap_or_else(|| Tensor::zeros([1], device));
            let deeper = (0..LEVELS_PER_READ).fold(below, |t, _| t + 1.0);
            rungs.1.push(deeper);
        }
        rungs.1[r - 1].clone()
    }
}

/// Where the hook of a parameter hooked at its first read goes in backward: right after the
/// backward of what the forward had computed when it read the parameter. One rule, two ways
/// of knowing that point.
#[derive(Clone)]
pub(crate) enum ReadPlacement {
    /// A loop of one's own, whose activations the plan never sees: by read order
    /// ([`ReadDepths`]), the reads counted in `reads`.
    Depths {
        depths: Arc<ReadDepths>,
        reads: Arc<std::sync::atomic::AtomicUsize>,
    },
    /// A pipeline step, which sees its activations: after the one it holds at the read, as
    /// it sets it (none before the layers: the end of backward; after them, the last layer's
    /// output, so a final norm's and a head's hooks run once the head's backward is done).
    Latest(Arc<std::sync::Mutex<Option<Tensor<1>>>>),
}

impl ReadPlacement {
    /// By read order from the first read of a forward.
    pub(crate) fn by_read_order(depths: &Arc<ReadDepths>) -> Self {
        ReadPlacement::Depths {
            depths: depths.clone(),
            reads: Default::default(),
        }
    }

    /// `x`, read now, hooked where this placement says.
    pub(crate) fn hooked<const D: usize>(&self, x: Tensor<D>, callback: GradCallback) -> Tensor<D> {
        let anchor = match self {
            ReadPlacement::Depths { depths, reads } => {
                let read = reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                depths.anchor(read, &x.device())
            }
            ReadPlacement::Latest(latest) => {
                (latest.lock().unwrap_or_else(|p| p.into_inner())).clone()
            }
        };
        match anchor {
            Some(after) => grad_hook_after(x, after, callback),
            None => grad_hook(x, callback),
        }
    }
}

/// Whether gradient hooks and the other custom ops work on `device`: an autodiff device of a
/// backend they are built for (Flex; the CubeCL backend with the `wgpu` / `cuda` features).
pub fn hooks_supported(device: &Device) -> bool {
    device.is_autodiff()
        && (device.clone().inner() == Device::flex()
            || cfg!(any(feature = "wgpu", feature = "cuda")))
}

/// `x` with a gradient hook attached (see the module docs).
pub fn grad_hook<const D: usize>(x: Tensor<D>, callback: GradCallback) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as GradHookOps>::grad_hook(
        x.into_dispatch(),
        callback,
    ))
}

/// [`grad_hook`] whose callback runs right after the backward of `after`'s consumers, not at
/// the end of backward: `x` is a parameter (depth 0 in the tape, which Burn runs deepest
/// first), so a plain hook on it runs after every layer's backward; hooked after its layer's
/// input, it runs when that layer's backward is done. `after`'s value is ignored and gets no
/// gradient from the hook.
pub fn grad_hook_after<const D: usize, const E: usize>(
    x: Tensor<D>,
    after: Tensor<E>,
    callback: GradCallback,
) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as GradHookOps>::grad_hook_after(
        x.into_dispatch(),
        after.into_dispatch(),
        callback,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A callback that logs `name` and the gradient's first value when its hook runs.
    fn probe(log: &Arc<Mutex<Vec<(&'static str, f32)>>>, name: &'static str) -> GradCallback {
        let log = log.clone();
        GradCallback(Arc::new(move |grad: Tensor<1>| {
            let first = grad.into_data().try_to_vec::<f32>().expect("f32")[0];
            log.lock().unwrap().push((name, first));
        }))
    }

    #[test]
    fn a_hook_placed_after_a_layers_input_runs_before_the_layers_below_it() {
        let device = Device::flex().autodiff();
        for placed in [false, true] {
            let log = Arc::new(Mutex::new(vec![]));
            // Layer one, three ops deep, probed in its middle: the probe takes the gradient
            // of a side branch, so it runs during layer one's backward.
            let x = Tensor::<1>::ones([4], &device).require_grad();
            let h1 = x.clone() * 2.0;
            let h2 = h1.clone() * 2.0 + grad_hook(h1, probe(&log, "layer one"));
            // Layer two: its input times a weight, whose hook is the one under test.
            let input = h2 * 2.0;
            let weight = Tensor::<1>::ones([4], &device).require_grad();
            let weight = match placed {
                true => grad_hook_after(weight, input.clone(), probe(&log, "weight")),
                false => grad_hook(weight, probe(&log, "weight")),
            };
            let grads = (input * weight).sum().backward();
            let order: Vec<_> = log.lock().unwrap().clone();
            // The weight's gradient is layer two's input, (2x 2 + 2) x 2 = 12, either way.
            let expected = match placed {
                true => vec![("weight", 12.0), ("layer one", 2.0)],
                false => vec![("layer one", 2.0), ("weight", 12.0)],
            };
            assert_eq!(order, expected, "placed after the input: {placed}");
            // The placement hands `input` no gradient: x's is the chain's 2 x 2 x 2 alone.
            let dx = x.grad(&grads).expect("x has a gradient");
            assert_eq!(dx.into_data().try_to_vec::<f32>().unwrap(), vec![8.0; 4]);
        }
    }
}
