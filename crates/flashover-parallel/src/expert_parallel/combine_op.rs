//! The MoE combine (expert outputs back per token, weighted by the routing weights and summed
//! over the token's kept choices) as one differentiable operation whose forward is
//! `flashover_kernels::unpermute_rows` (one fused kernel on the CubeCL backend) and whose
//! backward is written out as gathers: each kept row `r` (token `t`, choice `c`) gets
//! `d out_r = w_c d y_t`, each choice `d w_c = out_r · d y_t` (0 where dropped).

use crate::moe::Routing;
use burn::backend::autodiff::{
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{
    Autodiff, Backend, Dispatch, TensorMetadata, backend_extension, tensor::FloatTensor,
    tensor::IntTensor,
};
use burn::tensor::{DType, IndexingUpdateOp, IntDType, Shape, Tensor, TensorData};
use flashover_kernels::MoePermuteOps;
use std::sync::Arc;

/// Where each kept row and each `[tokens, top_k]` choice belong (host indices).
#[derive(Debug, Clone)]
pub struct CombinePlan(Arc<PlanIndices>);

#[derive(Debug)]
struct PlanIndices {
    /// Per kept row: its token.
    token: Vec<i64>,
    /// Per kept row: its choice (`token * top_k + j`).
    choice: Vec<i64>,
    /// Per choice: its kept row, or the number of kept rows where dropped.
    slot: Vec<i64>,
    /// Per choice: its kept row as f32, -1 where dropped (the kernel's `positions`).
    positions: Vec<f32>,
    tokens: usize,
    top_k: usize,
}

impl CombinePlan {
    fn new(routing: &Routing, tokens: usize, top_k: usize) -> Self {
        let rows = routing.token.len();
        let slot = routing.slots(tokens * top_k);
        let positions = slot
            .iter()
            .map(|&r| if r == rows { -1.0 } else { r as f32 })
            .collect();
        let int = |v: &[usize]| v.iter().map(|&x| x as i64).collect();
        CombinePlan(Arc::new(PlanIndices {
            token: int(&routing.token),
            choice: int(&routing.choice),
            slot: int(&slot),
            positions,
            tokens,
            top_k,
        }))
    }
}

#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub trait CombineGradOps: Backend {
    /// `outputs: [rows, d]`, `weights: [tokens, top_k]` -> `[tokens, d]`, differentiable.
    fn combine_with_grad(
        outputs: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        plan: CombinePlan,
    ) -> FloatTensor<Self>;
}

/// The kernel's forward on a backend's primitives.
fn forward<B: Backend + MoePermuteOps>(
    outputs: FloatTensor<B>,
    weights: FloatTensor<B>,
    plan: &CombinePlan,
) -> FloatTensor<B> {
    let p = &plan.0;
    let data = TensorData::new(p.positions.clone(), [p.tokens, p.top_k]);
    let positions = B::float_from_data(data, &outputs.device());
    B::unpermute_rows(outputs, positions, weights)
}

crate::collective_op::for_inner_backends! {
    impl CombineGradOps {
        fn combine_with_grad(
            outputs: FloatTensor<Self>,
            weights: FloatTensor<Self>,
            plan: CombinePlan,
        ) -> FloatTensor<Self> {
            forward::<Self>(outputs, weights, &plan)
        }
    }
}

#[derive(Debug)]
struct CombineBackward;

impl<B: Backend> Backward<B, 2> for CombineBackward {
    /// The expert outputs, the weights and the plan.
    type State = (FloatTensor<B>, FloatTensor<B>, CombinePlan);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (outputs, weights, plan) = ops.state;
        let p = &plan.0;
        let d = grads.consume::<B>(&ops.node);
        let device = d.device();
        let index = |v: &[i64]| -> IntTensor<B> {
            let data = TensorData::new(v.to_vec(), [v.len()]).convert_dtype(DType::I64);
            let ints = B::int_from_data(data, &device);
            B::int_cast(ints, IntDType::I64)
        };
        let rows = p.token.len();
        let [outputs_node, weights_node] = ops.parents;
        // Each kept row's token gradient.
        let d_rows = B::float_select(d, 0, index(&p.token));
        if let Some(node) = weights_node {
            let dots = B::float_sum_dim(B::float_mul(outputs, d_rows.clone()), 1); // [rows, 1]
            let zero = B::float_zeros(Shape::new([1, 1]), &device, dots.dtype().into());
            let padded = B::float_cat(vec![dots, zero], 0);
            let per_choice = B::float_select(padded, 0, index(&p.slot));
            let shape = Shape::new([p.tokens, p.top_k]);
            grads.register::<B>(node.id, B::float_reshape(per_choice, shape));
        }
        if let Some(node) = outputs_node {
            let flat = B::float_reshape(weights, Shape::new([p.tokens * p.top_k]));
            let w_rows = B::float_select(flat, 0, index(&p.choice));
            let w_rows = B::float_reshape(w_rows, Shape::new([rows, 1]));
            grads.register::<B>(node.id, B::float_mul(d_rows, w_rows));
        }
    }
}

impl<B: Backend + MoePermuteOps, C: CheckpointStrategy> CombineGradOps for Autodiff<B, C> {
    fn combine_with_grad(
        outputs: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        plan: CombinePlan,
    ) -> FloatTensor<Self> {
        let nodes = [outputs.node(), weights.node()];
        let (outputs, weights) = (outputs.into_primitive(), weights.into_primitive());
        let y = forward::<B>(outputs.clone(), weights.clone(), &plan);
        match CombineBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((outputs, weights, plan), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

/// Whether [`combine_fused`] runs the kernel: f32 outputs on a CubeCL device with at least one
/// kept row. Elsewhere (Flex, bf16/f16) the combine stays tensor operations.
pub(crate) fn fuses(outputs: &Tensor<2>, weights: &Tensor<2>) -> bool {
    outputs.dtype() == DType::F32
        && weights.dtype() == DType::F32
        && outputs.dims()[0] > 0
        && flashover_kernels::uses_kernels(&outputs.device())
}

/// [`crate::moe::combine`] as the fused differentiable op.
pub(crate) fn combine_fused(
    outputs: Tensor<2>,
    weights: Tensor<2>,
    routing: &Routing,
) -> Tensor<2> {
    let [tokens, top_k] = weights.dims();
    let plan = CombinePlan::new(routing, tokens, top_k);
    Tensor::from_dispatch(<Dispatch as CombineGradOps>::combine_with_grad(
        outputs.into_dispatch(),
        weights.into_dispatch(),
        plan,
    ))
}

/// The source rows of a permutation (host indices and the kernel's f32 order).
#[derive(Debug, Clone)]
pub struct PermutePlan(Arc<(Vec<i64>, Vec<f32>)>);

#[backend_extension(Flex, Cube: cfg(any(feature = "wgpu", feature = "cuda")), Autodiff)]
pub trait PermuteGradOps: Backend {
    /// `x: [tokens, d]` -> `[rows, d]`, row `i` being `x[plan[i]]`, differentiable.
    fn permute_with_grad(x: FloatTensor<Self>, plan: PermutePlan) -> FloatTensor<Self>;
}

/// The kernel's forward on a backend's primitives.
fn permute_forward<B: Backend + MoePermuteOps>(
    x: FloatTensor<B>,
    plan: &PermutePlan,
) -> FloatTensor<B> {
    let order = &plan.0.1;
    let data = TensorData::new(order.clone(), [order.len()]);
    let order = B::float_from_data(data, &x.device());
    B::permute_rows(x, order)
}

crate::collective_op::for_inner_backends! {
    impl PermuteGradOps {
        fn permute_with_grad(x: FloatTensor<Self>, plan: PermutePlan) -> FloatTensor<Self> {
            permute_forward::<Self>(x, &plan)
        }
    }
}

#[derive(Debug)]
struct PermuteBackward;

impl<B: Backend> Backward<B, 1> for PermuteBackward {
    /// The input's shape and the plan.
    type State = (Shape, PermutePlan);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (shape, plan) = ops.state;
        let d = grads.consume::<B>(&ops.node);
        let [x_node] = ops.parents;
        if let Some(node) = x_node {
            // Each row's gradient added back to its token (a token may feed several rows).
            let device = d.device();
            let rows = &plan.0.0;
            let data = TensorData::new(rows.clone(), [rows.len()]);
            let index = B::int_cast(B::int_from_data(data, &device), IntDType::I64);
            let zeros = B::float_zeros(shape, &device, d.dtype().into());
            let grad = B::float_select_assign(zeros, 0, index, d, IndexingUpdateOp::Add);
            grads.register::<B>(node.id, grad);
        }
    }
}

impl<B: Backend + MoePermuteOps, C: CheckpointStrategy> PermuteGradOps for Autodiff<B, C> {
    fn permute_with_grad(x: FloatTensor<Self>, plan: PermutePlan) -> FloatTensor<Self> {
        let nodes = [x.node()];
        let x = x.into_primitive();
        let shape = x.shape();
        let y = permute_forward::<B>(x, &plan);
        match PermuteBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((shape, plan), y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

/// Whether [`gather_fused`] runs the kernel: f32 `x` on a device where the strategies use the
/// kernels, with at least one row to gather.
pub(crate) fn gathers(x: &Tensor<2>, rows: &[usize]) -> bool {
    x.dtype() == DType::F32 && !rows.is_empty() && flashover_kernels::uses_kernels(&x.device())
}

/// The dispatch gather (`select` in `ExpertDispatch::gather`) as the fused permute kernel.
pub(crate) fn gather_fused(x: Tensor<2>, rows: &[usize]) -> Tensor<2> {
    let plan = PermutePlan(Arc::new((
        rows.iter().map(|&r| r as i64).collect(),
        rows.iter().map(|&r| r as f32).collect(),
    )));
    Tensor::from_dispatch(<Dispatch as PermuteGradOps>::permute_with_grad(
        x.into_dispatch(),
        plan,
    ))
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use burn::tensor::{Device, DeviceKind, Distribution};

    /// The fused gather (the permute kernel) against `select`: values, and the input gradient
    /// summed over repeated tokens.
    #[test]
    fn the_fused_gather_has_selects_values_and_gradient() {
        let _serial = crate::attention_op::hold_kernel_use(flashover_kernels::KernelUse::Always);
        let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        let x = Tensor::<2>::random([5, 6], Distribution::Uniform(-1.0, 1.0), &device).detach();
        // Rows in expert order; tokens 0 and 3 go to two experts, token 4 to none.
        let rows = [3, 0, 2, 3, 1, 0];
        assert!(gathers(&x, &rows));
        let r = Tensor::<2>::random([rows.len(), 6], Distribution::Default, &device);
        let run = |fused: bool| {
            let leaf = x.clone().require_grad();
            let y = if fused {
                gather_fused(leaf.clone(), &rows)
            } else {
                let index = crate::tensor_util::index_tensor(&rows, [rows.len()], &device);
                leaf.clone().select(0, index)
            };
            let grads = (y.clone() * r.clone()).sum().backward();
            let v = |t: Tensor<2>| t.inner().into_data().try_to_vec::<f32>().unwrap();
            [v(y), v(leaf.grad(&grads).unwrap())]
        };
        let (fused, plain) = (run(true), run(false));
        for ((f, p), name) in fused.iter().zip(&plain).zip(["y", "d x"]) {
            for (a, b) in f.iter().zip(p) {
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                    "{name}: {a} vs {b}"
                );
            }
        }
    }

    /// Values and both inputs' gradients of the fused combine (the kernel) against the tensor
    /// operations, on wgpu, with dropped choices and rows in expert (not token) order.
    #[test]
    fn the_fused_combine_has_the_tensor_combines_values_and_gradients() {
        let _serial = crate::attention_op::hold_kernel_use(flashover_kernels::KernelUse::Always);
        let device = Device::wgpu(DeviceKind::DefaultDevice).autodiff();
        let (tokens, top_k, d) = (5, 2, 6);
        // Kept choices in expert order; choices 3 and 8 are dropped.
        let choice = vec![4, 0, 9, 2, 6, 1, 5, 7];
        let routing = Routing {
            token: choice.iter().map(|c| c / top_k).collect(),
            choice,
            chosen: vec![0; tokens * top_k],
            kept: vec![8],
            routed: vec![10],
        };
        let rows = routing.token.len();
        let rand = |shape: [usize; 2]| {
            Tensor::<2>::random(shape, Distribution::Uniform(-1.0, 1.0), &device).detach()
        };
        let (outputs, weights, r) = (rand([rows, d]), rand([tokens, top_k]), rand([tokens, d]));
        assert!(fuses(&outputs, &weights));
        let run = |fused: bool| {
            let (o, w) = (
                outputs.clone().require_grad(),
                weights.clone().require_grad(),
            );
            let y = if fused {
                combine_fused(o.clone(), w.clone(), &routing)
            } else {
                crate::moe::combine(o.clone(), w.clone(), &routing)
            };
            let grads = (y.clone() * r.clone()).sum().backward();
            let v = |t: Tensor<2>| t.inner().into_data().try_to_vec::<f32>().unwrap();
            [v(y), v(o.grad(&grads).unwrap()), v(w.grad(&grads).unwrap())]
        };
        let (fused, plain) = (run(true), run(false));
        for ((f, p), name) in fused
            .iter()
            .zip(&plain)
            .zip(["y", "d outputs", "d weights"])
        {
            for (x, y) in f.iter().zip(p) {
                assert!(
                    (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                    "{name}: {x} vs {y}"
                );
            }
        }
    }
}
