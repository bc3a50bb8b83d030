//! All-to-all (Ulysses) attention: trade the sequence split for a head split around attention.

use super::blocks::attend_masked;
use super::comm::{heads_to_sequence, sequence_to_heads};
use super::layout::SequenceLayout;
use super::work::WorkCounter;
use crate::forward_context::{AttentionOp, ForwardContext};
use burn::tensor::{Device, Int, Tensor, TensorData};
use flashover_comm::Group;
use flashover_kernels::AttentionMask;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Causal attention over a sequence split by `layout` across `group`: one all-to-all turns
/// each rank's `[heads, local positions]` of q, k and v into `[heads / cp, all positions]`,
/// every rank runs whole-sequence attention on its head group, and a second all-to-all
/// returns the output to the sequence split. Needs the (local) heads to divide by `cp`.
pub struct AllToAllAttention {
    pub(super) group: Group,
    pub(super) layout: SequenceLayout,
    /// Every position in the order the first all-to-all lays them out (rank-major).
    pub(super) positions: Vec<usize>,
    /// The causal mask over `positions` (the layout is fixed: built once, not per call).
    pub(super) hidden: Vec<bool>,
    /// The row of each position, in position order ([`rows_in_position_order`]).
    pub(super) rows_in_order: Vec<usize>,
    /// `rows_in_order` and `positions` as index tensors on the device of the last call.
    pub(super) indices: OrderIndices,
    pub(super) work: Arc<WorkCounter>,
}

/// The fused path's two index tensors (rows into position order, and back), made on the
/// first call on a device and kept: the layout is fixed, so no call after the first uploads
/// them.
#[derive(Default)]
pub(super) struct OrderIndices(Mutex<Option<(Device, [Tensor<1, Int>; 2])>>);

impl OrderIndices {
    /// The indices on `device`, made by `make` if they are not there yet.
    fn on(
        &self,
        device: &Device,
        make: impl FnOnce() -> [Tensor<1, Int>; 2],
    ) -> [Tensor<1, Int>; 2] {
        let mut held = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match held.as_ref() {
            Some((on, indices)) if on == device => indices.clone(),
            _ => {
                let indices = make();
                *held = Some((device.clone(), indices.clone()));
                indices
            }
        }
    }
}

/// Row `r` holds position `positions[r]`: the row of each position, in position order.
pub(super) fn rows_in_position_order(positions: &[usize]) -> Vec<usize> {
    let mut rows = vec![0; positions.len()];
    for (row, &position) in positions.iter().enumerate() {
        rows[position] = row;
    }
    rows
}

impl AllToAllAttention {
    /// Causal attention over the rows of `q`, `k`, `v` (laid out as `positions`) as the fused
    /// op: the rows put in position order, attended causally, and the output put back.
    fn fused_causal(&self, q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
        let device = q.device();
        let index = |rows: &[usize]| {
            let rows: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
            let n = rows.len();
            Tensor::<1, Int>::from_data(TensorData::new(rows, [n]), &device)
        };
        let [in_order, back] = (self.indices).on(&device, || {
            [index(&self.rows_in_order), index(&self.positions)]
        });
        let ordered = |t: Tensor<4>| t.select(2, in_order.clone());
        let out = crate::attention_op::fused_attention(
            ordered(q),
            ordered(k),
            ordered(v),
            AttentionMask::new(true),
        )
        .0;
        out.select(2, back)
    }
}

impl AttentionOp for AllToAllAttention {
    fn attend(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        ctx: &ForwardContext,
        layer: usize,
    ) -> Tensor<4> {
        let (group, n) = (&self.group, self.group.size());
        let [b, heads, _, _] = q.dims();
        assert!(
            heads.is_multiple_of(n),
            "all-to-all attention needs the {heads} local heads to divide by cp = {n}"
        );
        debug_assert_eq!(self.positions.len(), self.layout.seq_len);
        let (q, k, v) = (
            sequence_to_heads(q, group),
            sequence_to_heads(k, group),
            sequence_to_heads(v, group),
        );
        let started = Instant::now();
        let head_offset = ctx.head_offset + group.rank() * heads / n;
        let all = &self.positions;
        let out = match ctx.takes_fused_attention(&q.device()) {
            true => self.fused_causal(q, k, v),
            false => attend_masked(q, k, v, self.hidden.clone(), |p| {
                ctx.attention_at(p, layer, head_offset, all, all)
            }),
        };
        let t = all.len();
        self.work.add(b * heads / n * t * t, started.elapsed());
        heads_to_sequence(out, group)
    }
}
