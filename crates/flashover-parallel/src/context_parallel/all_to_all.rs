//! All-to-all (Ulysses) attention: trade the sequence split for a head split around attention.

use super::blocks::attend_masked;
use super::comm::{heads_to_sequence, sequence_to_heads};
use super::layout::SequenceLayout;
use super::work::WorkCounter;
use crate::forward_context::{AttentionOp, ForwardContext};
use burn::tensor::Tensor;
use flashover_comm::Group;
use std::sync::Arc;
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
    pub(super) work: Arc<WorkCounter>,
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
        let out = attend_masked(q, k, v, self.hidden.clone(), |p| {
            ctx.attention_at(p, layer, head_offset, all, all)
        });
        let t = all.len();
        self.work.add(b * heads / n * t * t, started.elapsed());
        heads_to_sequence(out, group)
    }
}
