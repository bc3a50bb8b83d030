//! Context parallelism over the `cp` mesh axis: every rank holds some positions of every
//! sequence, for the whole model.
//!
//! **What is split:** the sequence. A rank embeds, normalises, runs the MLP and the loss on its
//! own positions ([`SequenceLayout`]: one chunk, or a head and a tail chunk so causal work is
//! even); rotary embeddings and dropout use the global positions
//! ([`ForwardContext::positions`]). **Communication:** attention only, the one place positions
//! meet. [`RingAttention`] passes key/value blocks around the ring and merges partial results
//! with the log-sum-exp rule; [`AllToAllAttention`] (Ulysses) swaps the sequence split for a
//! head split with two all-to-alls. Parameters are replicated over `cp`, and each rank's loss
//! is the mean over its positions, so averaging gradients over `dp x cp` (the training job's
//! gradient group) gives one rank's gradient of the whole batch.

mod all_to_all;
mod blocks;
mod comm;
mod layout;
mod merge_op;
mod ring;
mod sequence;
mod work;

pub use all_to_all::AllToAllAttention;
pub use blocks::{
    Partial, attend_block, attend_block_fused, attend_masked, attend_positions, causal_mask, merge,
};
pub use comm::{heads_to_sequence, ring_pass, sequence_to_heads};
pub use layout::{SequenceLayout, Visibility};
pub use ring::RingAttention;
pub use sequence::CpSequences;
pub use work::{AttentionWork, WorkCounter};

use crate::ParallelError;
use crate::forward_context::{AttentionHook, ForwardContext, SequenceHook};
pub use crate::plan::CpAttention;
use burn::tensor::{Int, Tensor, TensorData};
use flashover_comm::Group;
use std::sync::Arc;

/// One rank's share of a context-parallel layout and the attention hook that serves it.
#[derive(Clone)]
pub struct ContextParallel {
    /// The `cp` group.
    pub group: Group,
    /// Which positions each rank holds.
    pub layout: SequenceLayout,
    /// The attention algorithm.
    pub algorithm: CpAttention,
    positions: Arc<[usize]>,
    hook: AttentionHook,
    /// The split sequences, for layers that gather them (mixtures of experts route whole ones).
    sequences: SequenceHook,
    work: Arc<WorkCounter>,
}

impl std::fmt::Debug for ContextParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextParallel")
            .field("group", &self.group.name())
            .field("layout", &self.layout)
            .field("algorithm", &self.algorithm)
            .finish()
    }
}

impl ContextParallel {
    /// Splits sequences of `seq_len` positions over `group`. Fails when the length does not
    /// cut into equal chunks, or when all-to-all attention's `local_heads` (per tensor-parallel
    /// rank) do not divide by the group size.
    pub fn new(
        group: &Group,
        seq_len: usize,
        algorithm: CpAttention,
        load_balanced: bool,
        local_heads: usize,
    ) -> Result<Self, ParallelError> {
        let layout = SequenceLayout::new(seq_len, group.size(), load_balanced)?;
        let work = Arc::new(WorkCounter::default());
        let hook = match algorithm {
            CpAttention::Ring => AttentionHook(Arc::new(RingAttention {
                group: group.clone(),
                stream: flashover_runtime::CommStream::new(group, "ring attention stream"),
                layout,
                work: work.clone(),
            })),
            CpAttention::AllToAll => {
                if !local_heads.is_multiple_of(group.size()) {
                    return Err(ParallelError::Invalid(format!(
                        "all-to-all attention splits heads over cp = {}, but a rank holds {local_heads} heads: use ring attention or a head count divisible by cp (x tp)",
                        group.size()
                    )));
                }
                let positions: Vec<usize> = (0..group.size())
                    .flat_map(|r| layout.positions(r))
                    .collect();
                AttentionHook(Arc::new(AllToAllAttention {
                    group: group.clone(),
                    layout,
                    hidden: causal_mask(&positions, &positions),
                    rows_in_order: all_to_all::rows_in_position_order(&positions),
                    indices: Default::default(),
                    positions,
                    work: work.clone(),
                }))
            }
        };
        Ok(ContextParallel {
            group: group.clone(),
            layout,
            algorithm,
            positions: layout.positions(group.rank()).into(),
            hook,
            sequences: SequenceHook(Arc::new(CpSequences::new(group, layout))),
            work,
        })
    }

    /// The global positions this rank holds, in local order.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// This rank's positions of `tokens: [batch, seq_len]` (inputs or targets).
    pub fn local_tokens(&self, tokens: Tensor<2, Int>) -> Tensor<2, Int> {
        let index: Vec<i64> = self.positions.iter().map(|&p| p as i64).collect();
        let index = Tensor::<1, Int>::from_data(
            TensorData::new(index, [self.positions.len()]),
            &tokens.device(),
        );
        tokens.select(1, index)
    }

    /// `ctx` for this rank's positions, with attention over the whole sequence (and the
    /// split sequences, for layers defined on whole ones).
    pub fn forward_context(&self, ctx: ForwardContext) -> ForwardContext {
        ForwardContext {
            positions: Some(self.positions.clone()),
            core_attention: Some(self.hook.clone()),
            sequence: Some(self.sequences.clone()),
            ..ctx
        }
    }

    /// The attention work this rank has done so far.
    pub fn work(&self) -> AttentionWork {
        self.work.snapshot()
    }
}
