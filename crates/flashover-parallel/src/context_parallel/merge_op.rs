//! Ring attention's log-sum-exp merge as one differentiable operation whose forward is
//! `flashover_kernels::merge_partials` (one fused kernel on the CubeCL backend) and whose
//! backward is written out, instead of the dozen tensor operations autodiff would record.
//!
//! With `α = exp(lse_a - lse)`, `β = exp(lse_b - lse)` (the blocks' shares of the merged
//! denominator) and `out = α out_a + β out_b`, the gradients are
//! `d out_a = α d out`, `d out_b = β d out`,
//! `d lse_a = α (Σ d out · (out_a - out) + d lse)` and likewise for `b`.
//! Burn's custom ops have one output each, so the merge is two ops sharing one forward: one
//! for `out` (all four inputs) and one for `lse` (the two log-sum-exps).

use super::blocks::Partial;
use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{
    Autodiff, Backend, Dispatch, TensorMetadata, backend_extension, tensor::FloatTensor,
};
use burn::tensor::{DType, Shape, Tensor};
use flashover_kernels::MergeOps;

#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub trait MergeGradOps: Backend {
    /// `out_*: [rows, width]`, `lse_*: [rows]` -> merged `(out, lse)`, differentiable.
    fn merge_with_grad(
        out_a: FloatTensor<Self>,
        lse_a: FloatTensor<Self>,
        out_b: FloatTensor<Self>,
        lse_b: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

crate::collective_op::for_inner_backends! {
    impl MergeGradOps {
        fn merge_with_grad(
            out_a: FloatTensor<Self>,
            lse_a: FloatTensor<Self>,
            out_b: FloatTensor<Self>,
            lse_b: FloatTensor<Self>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            <Self as MergeOps>::merge_partials(out_a, lse_a, out_b, lse_b)
        }
    }
}

/// `x: [rows]` as a `[rows, 1]` column, to scale rows.
fn column<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let rows = x.shape().num_elements();
    B::float_reshape(x, Shape::new([rows, 1]))
}

/// `exp(lse_x - lse)`: a block's share of the merged denominator, `[rows]`.
fn share<B: Backend>(lse_x: FloatTensor<B>, lse: FloatTensor<B>) -> FloatTensor<B> {
    B::float_exp(B::float_sub(lse_x, lse))
}

/// The backward of the merged `out`.
#[derive(Debug)]
struct MergeOutBackward;

/// `(out_a, out_b, out, α, β)`.
type OutState<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
);

impl<B: Backend> Backward<B, 4> for MergeOutBackward {
    type State = OutState<B>;

    fn backward(self, ops: Ops<Self::State, 4>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (out_a, out_b, out, alpha, beta) = ops.state;
        let d = grads.consume::<B>(&ops.node);
        let [oa_node, la_node, ob_node, lb_node] = ops.parents;
        let (alpha, beta) = (column::<B>(alpha), column::<B>(beta));
        // d lse_x = α_x Σ_j d_j (out_x - out)_j: one row sum per block.
        let lse_grad = |x: FloatTensor<B>, share: &FloatTensor<B>| {
            let diff = B::float_sub(x, out.clone());
            let rows = B::float_sum_dim(B::float_mul(d.clone(), diff), 1);
            let g = B::float_mul(rows, share.clone());
            let n = g.shape().num_elements();
            B::float_reshape(g, Shape::new([n]))
        };
        if let Some(node) = la_node {
            grads.register::<B>(node.id, lse_grad(out_a, &alpha));
        }
        if let Some(node) = lb_node {
            grads.register::<B>(node.id, lse_grad(out_b, &beta));
        }
        if let Some(node) = oa_node {
            grads.register::<B>(node.id, B::float_mul(d.clone(), alpha));
        }
        if let Some(node) = ob_node {
            grads.register::<B>(node.id, B::float_mul(d, beta));
        }
    }
}

/// The backward of the merged `lse`: `d lse_x = α_x d lse`.
#[derive(Debug)]
struct MergeLseBackward;

impl<B: Backend> Backward<B, 2> for MergeLseBackward {
    /// `(α, β)`.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (alpha, beta) = ops.state;
        let d = grads.consume::<B>(&ops.node);
        let [la_node, lb_node] = ops.parents;
        if let Some(node) = la_node {
            grads.register::<B>(node.id, B::float_mul(d.clone(), alpha));
        }
        if let Some(node) = lb_node {
            grads.register::<B>(node.id, B::float_mul(d, beta));
        }
    }
}

impl<B: Backend + MergeOps, C: CheckpointStrategy> MergeGradOps for Autodiff<B, C> {
    fn merge_with_grad(
        out_a: FloatTensor<Self>,
        lse_a: FloatTensor<Self>,
        out_b: FloatTensor<Self>,
        lse_b: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let out_nodes = [out_a.node(), lse_a.node(), out_b.node(), lse_b.node()];
        let lse_nodes = [lse_a.node(), lse_b.node()];
        let (oa, la, ob, lb) = (
            out_a.into_primitive(),
            lse_a.into_primitive(),
            out_b.into_primitive(),
            lse_b.into_primitive(),
        );
        let (out, lse) = B::merge_partials(oa.clone(), la.clone(), ob.clone(), lb.clone());
        let alpha = share::<B>(la, lse.clone());
        let beta = share::<B>(lb, lse.clone());
        let out = match MergeOutBackward
            .prepare::<C>(out_nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let state = (oa, ob, out.clone(), alpha.clone(), beta.clone());
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        let lse = match MergeLseBackward
            .prepare::<C>(lse_nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((alpha, beta), lse),
            OpsKind::UnTracked(prep) => prep.finish(lse),
        };
        (out, lse)
    }
}

/// Whether [`merge_fused`] runs the fused kernel for `a`: f32 tensors on a CubeCL device
/// (with autodiff). Elsewhere — Flex, where the tensor operations are as fast, and bf16/f16,
/// which the kernel does not take — the merge stays the composed tensor operations.
pub(super) fn fuses(a: &Partial) -> bool {
    a.out.dtype() == DType::F32 && flashover_kernels::uses_kernels(&a.out.device())
}

/// The merge of [`super::blocks::merge`], as the fused differentiable op (see the module docs).
pub(super) fn merge_fused(a: Partial, b: Partial) -> Partial {
    let [batch, heads, queries, width] = a.out.dims();
    let rows = batch * heads * queries;
    let flat = |t: Tensor<4>, w: usize| t.reshape([rows * w]).into_dispatch();
    let rows2 = |t: Tensor<4>| t.reshape([rows, width]).into_dispatch();
    let (out, lse) = <Dispatch as MergeGradOps>::merge_with_grad(
        rows2(a.out),
        flat(a.lse, 1),
        rows2(b.out),
        flat(b.lse, 1),
    );
    Partial {
        out: Tensor::<2>::from_dispatch(out).reshape([batch, heads, queries, width]),
        lse: Tensor::<1>::from_dispatch(lse).reshape([batch, heads, queries, 1]),
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use burn::tensor::{Device, DeviceKind, Distribution};

    fn values(t: Tensor<4>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().unwrap()
    }

    /// Forward values and every input's gradient of the fused op (the kernel) against the
    /// composed tensor operations, on the wgpu device.
    #[test]
    fn the_fused_merge_has_the_composed_merges_values_and_gradients() {
        let _serial = crate::attention_op::hold_kernel_use(flashover_kernels::KernelUse::Always);
        let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        assert!(crate::context_parallel::merge_op::fuses(&Partial {
            out: Tensor::zeros([1, 1, 1, 1], &device),
            lse: Tensor::zeros([1, 1, 1, 1], &device),
        }));
        let (b, h, q, w) = (2, 3, 5, 7);
        let rand = |shape: [usize; 4], scale: f64| {
            Tensor::<4>::random(shape, Distribution::Uniform(-scale, scale), &device).detach()
        };
        let inputs = [
            rand([b, h, q, w], 1.0),
            rand([b, h, q, 1], 3.0),
            rand([b, h, q, w], 1.0),
            rand([b, h, q, 1], 3.0),
        ];
        let (r_out, r_lse) = (rand([b, h, q, w], 1.0), rand([b, h, q, 1], 1.0));
        let run = |fused: bool| {
            let leaves: Vec<Tensor<4>> = inputs.iter().map(|t| t.clone().require_grad()).collect();
            let part = |o: usize| Partial {
                out: leaves[o].clone(),
                lse: leaves[o + 1].clone(),
            };
            let merged = if fused {
                merge_fused(part(0), part(2))
            } else {
                super::super::blocks::merge(part(0), part(2))
            };
            let loss = (merged.out.clone() * r_out.clone()).sum()
                + (merged.lse.clone() * r_lse.clone()).sum();
            let grads = loss.backward();
            let mut all = vec![values(merged.out.inner()), values(merged.lse.inner())];
            all.extend(
                leaves
                    .iter()
                    .map(|l| values(l.grad(&grads).unwrap().inner())),
            );
            all
        };
        let (fused, composed) = (run(true), run(false));
        let names = ["out", "lse", "d out_a", "d lse_a", "d out_b", "d lse_b"];
        for ((f, c), name) in fused.iter().zip(&composed).zip(names) {
            for (x, y) in f.iter().zip(c) {
                assert!(
                    (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                    "{name}: {x} vs {y}"
                );
            }
        }
    }
}
