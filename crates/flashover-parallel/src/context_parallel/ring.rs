//! Ring attention: queries stay, key/value blocks travel the ring.

use super::blocks::{Partial, attend_block, attend_block_fused, merge};
use super::comm::{ring_passed, ring_shift};
use super::layout::{SequenceLayout, Visibility};
use super::merge_op;
use super::work::WorkCounter;
use crate::collective_op::ok;
use crate::forward_context::{AttentionOp, ForwardContext};
use burn::tensor::Tensor;
use flashover_comm::Group;
use flashover_runtime::CommStream;
use std::sync::Arc;
use std::time::Instant;

/// Causal attention over a sequence split by `layout` across `group`.
///
/// In `cp` steps each rank attends its query chunks to the key/value block it holds, merging
/// the blocks with the log-sum-exp rule, while the block moves on to the next rank (the
/// exchange for step `s + 1` runs on the cp group's communication stream during step `s`'s
/// attention). Chunk pairs wholly in the future are skipped, which is the work load balancing
/// evens out.
/// Backward is autodiff through the same steps: each pass's gradient goes back one rank, so
/// key/value gradients travel the ring in reverse and arrive home summed over every rank that
/// used them.
pub struct RingAttention {
    pub(super) group: Group,
    /// Runs the passes of key/value blocks while attention computes.
    pub(super) stream: Arc<CommStream>,
    pub(super) layout: SequenceLayout,
    pub(super) work: Arc<WorkCounter>,
}

impl AttentionOp for RingAttention {
    fn attend(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        ctx: &ForwardContext,
        layer: usize,
    ) -> Tensor<4> {
        let (group, layout) = (&self.group, &self.layout);
        let (n, rank) = (group.size(), group.rank());
        let heads = q.dims()[1];
        let c = layout.chunk_len();
        let mine = layout.chunks(rank);
        let queries: Vec<Tensor<4>> = (0..mine.len())
            .map(|i| q.clone().narrow(2, i * c, c))
            .collect();
        let mut partials: Vec<Option<Partial>> = mine.iter().map(|_| None).collect();
        // Keys and values travel as one block, stacked along the head dim.
        let fused = ctx.takes_fused_attention(&q.device());
        let mut kv = Tensor::cat(vec![k, v], 1);
        let mut used = false;
        for step in 0..n {
            used = false;
            let theirs = layout.chunks((rank + n - step) % n);
            // The block's values, untracked (the pass's own op carries its gradient), start
            // their trip to the next rank on the stream while this step's blocks compute.
            let pass = (step + 1 < n).then(|| {
                let block = kv.clone().inner();
                self.stream.submit(move |g| Ok(ring_shift(g, block, 1)))
            });
            let started = Instant::now();
            let mut elements = 0;
            for (qi, q_range) in mine.iter().enumerate() {
                for (ki, k_range) in theirs.iter().enumerate() {
                    let visibility = Visibility::of(q_range, k_range);
                    if visibility == Visibility::Hidden {
                        continue;
                    }
                    let block = kv.clone().narrow(2, ki * c, c);
                    let (kb, vb) = (
                        block.clone().narrow(1, 0, heads),
                        block.narrow(1, heads, heads),
                    );
                    let (q_pos, k_pos): (Vec<usize>, Vec<usize>) =
                        (q_range.clone().collect(), k_range.clone().collect());
                    let part = match fused {
                        true => attend_block_fused(queries[qi].clone(), kb, vb, visibility),
                        false => attend_block(queries[qi].clone(), kb, vb, visibility, |p| {
                            ctx.attention_at(p, layer, ctx.head_offset, &q_pos, &k_pos)
                        }),
                    };
                    elements += queries[qi].dims()[0] * heads * c * c;
                    used = true;
                    partials[qi] = Some(match partials[qi].take() {
                        None => part,
                        Some(acc) if merge_op::fuses(&acc) => merge_op::merge_fused(acc, part),
                        Some(acc) => merge(acc, part),
                    });
                }
            }
            self.work.add(elements, started.elapsed());
            if let Some(block) = pass.map(|work| ok(work.wait())) {
                kv = ring_passed(kv, block, group);
            }
        }
        let outs = partials
            .into_iter()
            .map(|p| p.expect("every query chunk sees its own positions").out)
            .collect();
        let out = Tensor::cat(outs, 2);
        if used {
            return out;
        }
        // Backward runs only where gradients flow. A rank that used none of the last block it
        // received (its queries all precede it) must still pass the (zero) gradients back
        // around the ring, which its neighbours wait for: tie the block to the output.
        out + kv.sum().mul_scalar(0.0).reshape([1, 1, 1, 1])
    }
}
