//! A plan's sequence split over `cp`, as one rank sees it ([`SequenceSplit`],
//! `Parallelized::sequences`): each rank's positions, the forward context of a model whose
//! attention runs through one, and the check that attention reached across the ranks.

use crate::error::ParallelError;
use crate::placed::ContextSplit;
use burn::tensor::{Int, Tensor, TensorData};
use flashover_comm::{CommunicatorExt, Group, ReduceOp, control};

/// The plan's sequence split on this rank: which positions of each sequence it computes
/// (all of them without context parallelism), and the checks that a sequence cuts as the plan
/// cuts it and that attention reached the other ranks' positions.
#[derive(Debug, Default)]
pub struct SequenceSplit {
    /// The split over `cp`, when the plan splits sequences on this mesh.
    context: Option<ContextSplit>,
    /// Under sequence parallelism, the `tp` group a rank's positions are cut over again.
    sequence_tp: Option<Group>,
    /// Attention scores computed across the `cp` ranks at the last check.
    attended: std::sync::Mutex<u64>,
}

impl SequenceSplit {
    /// The split `context` (none: sequences whole on every rank), cut again over
    /// `sequence_tp` under sequence parallelism.
    pub(super) fn new(context: Option<ContextSplit>, sequence_tp: Option<Group>) -> Self {
        SequenceSplit {
            context,
            sequence_tp,
            attended: Default::default(),
        }
    }

    /// This rank's positions of `x`'s sequences along dimension `dim` (`x: [batch, seq]`
    /// tokens or targets, `dim = 1`): all of them, or, when the plan splits sequences over
    /// `cp`, the positions [`Self::positions`] lists, in that order. Fails when the sequence
    /// does not cut into the rank's chunks.
    pub fn share<const D: usize, K>(
        &self,
        x: Tensor<D, K>,
        dim: usize,
    ) -> Result<Tensor<D, K>, ParallelError>
    where
        K: burn::tensor::kind::Basic,
    {
        if self.context.is_none() {
            return Ok(x);
        }
        let positions: Vec<i64> = self
            .positions(x.dims()[dim])?
            .into_iter()
            .map(|p| p as i64)
            .collect();
        let len = positions.len();
        let index = Tensor::<1, Int>::from_data(TensorData::new(positions, [len]), &x.device());
        Ok(x.select(dim, index))
    }

    /// `ctx` with attention over whole sequences of `seq` positions across the `cp` ranks
    /// (`heads` attention heads on this rank: the model's, divided by `tp` where the plan splits
    /// them), and this rank's positions for rotary embeddings: for a model whose attention
    /// runs through a [`crate::forward_context::ForwardContext`] (the reference transformer:
    /// `flashover_models::transformer::split_sequences`) rather than through
    /// [`crate::nn::CausalAttention`] cores, under a `context_parallel` rule that names none
    /// (`ContextParallelRule::ring(&[])`). `ctx` itself without a sequence split. Fails when
    /// the sequence or the heads do not cut over `cp`.
    pub fn forward_context(
        &self,
        ctx: crate::forward_context::ForwardContext,
        seq: usize,
        heads: usize,
    ) -> Result<crate::forward_context::ForwardContext, ParallelError> {
        match &self.context {
            None => Ok(ctx),
            Some(split) => Ok(split.attention(seq, heads)?.forward_context(ctx)),
        }
    }

    /// The attention this rank has computed across the `cp` ranks so far (scores, and the
    /// time in attention blocks), when the plan splits sequences on this mesh: per-rank
    /// attention work for reports (load balancing shows in it).
    pub fn attention_work(&self) -> Option<crate::context_parallel::AttentionWork> {
        self.context.as_ref().map(ContextSplit::work)
    }

    /// Fails when sequences are split over `cp` and no attention reached across the ranks
    /// since the last check (on any pipeline stage): the model computed each rank's
    /// positions alone, which no reduction can repair. Collective over `pp` when pipelined.
    pub(super) fn check_attended(&self, pipeline: Option<&Group>) -> Result<(), ParallelError> {
        let Some(split) = &self.context else {
            return Ok(());
        };
        let now = split.attended();
        let mut seen = self.attended.lock().unwrap_or_else(|p| p.into_inner());
        let mut advanced = [u64::from(now != *seen)];
        *seen = now;
        if let Some(pp) = pipeline {
            control(|| pp.all_reduce(&mut advanced, ReduceOp::Max))?;
        }
        match advanced[0] {
            0 => Err(ParallelError::Invalid(
                "the plan splits sequences over cp, but no attention attended across the cp \
                 ranks this step: each rank's positions saw only each other. Name the \
                 attention cores (flashover::nn::CausalAttention) in context_parallel's \
                 `attention`, or run the forward in the context of Parallelized::sequences().forward_context"
                    .into(),
            )),
            _ => Ok(()),
        }
    }

    /// The positions of a `seq`-long sequence this rank computes, in the order its share
    /// holds them ([`Self::share`]): `0..seq`, or with context parallelism this
    /// rank's chunks (for position embeddings and rotary tables). Fails when `seq` does not cut
    /// into `cp` equal shares (`2 x cp` chunks when load-balanced).
    pub fn positions(&self, seq: usize) -> Result<Vec<usize>, ParallelError> {
        match &self.context {
            None => Ok((0..seq).collect()),
            Some(split) => Ok(split.layout(seq)?.positions(split.group.rank())),
        }
    }

    /// Checks that a `seq`-long sequence splits as the plan splits sequences: into `cp` equal
    /// shares (`2 x cp` chunks when load-balanced) and, under sequence parallelism, each share
    /// into `tp` equal parts. Call it on every stream's length (an encoder's inputs, a
    /// decoder's targets) before the first forward: a length that does not split fails here,
    /// naming the axis, instead of inside a layer after the layers before it have run.
    pub fn check(&self, seq: usize) -> Result<(), ParallelError> {
        let share = match &self.context {
            None => seq,
            Some(split) => {
                split.layout(seq)?;
                seq / split.group.size()
            }
        };
        match &self.sequence_tp {
            Some(tp) if !share.is_multiple_of(tp.size()) => Err(ParallelError::Invalid(format!(
                "a sequence of {seq} positions ({share} on this rank) does not divide by tp = \
                 {}: sequence parallelism splits it into tp equal parts",
                tp.size()
            ))),
            _ => Ok(()),
        }
    }

    /// The `cp` ranks that hold the other positions of this rank's sequences, when the plan
    /// splits sequences on this mesh (to put per-position outputs back together).
    pub fn ranks(&self) -> Option<&Group> {
        self.context.as_ref().map(|split| &split.group)
    }

    /// Whether the plan splits sequences over `cp` on this mesh (a rank then computes its
    /// positions of every sequence: [`Self::share`]).
    pub fn is_split(&self) -> bool {
        self.context.is_some()
    }
}
