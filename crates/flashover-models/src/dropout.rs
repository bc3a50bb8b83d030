//! Counter-based dropout: layout-independent and replayable.
//!
//! Whether an element is dropped is a hash of (seed, step, site, the element's coordinates in
//! the *logical* tensor, the one a single rank would hold). A rank that holds part of that tensor
//! (a slice of the batch, of the heads, of the sequence) passes the part's offsets and gets
//! exactly the logical mask's part; recomputing a forward (activation checkpointing, ZeRO-3
//! resharding) replays the same mask. So masks that must match across tensor-parallel ranks
//! (replicated activations) match, masks of split activations differ where the elements
//! differ, and every layout drops the same elements as one rank, reproducibly from the seed.

use crate::layers::{Block, rope_tables_at};
use burn::nn::Linear;
use burn::tensor::{Device, Shape, Tensor, TensorData};
use flashover_data::SplitMix64;
use std::sync::Arc;

/// Dropout with probability `p` for optimizer step `step` of a run seeded `seed`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    /// Probability of dropping an element.
    pub p: f64,
    /// The run's seed.
    pub seed: u64,
    /// The optimizer step (masks change every step).
    pub step: u64,
}

/// Where a forward runs: its dropout, where its local tensors sit in the logical ones, and who
/// computes its linear layers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ForwardContext {
    /// Dropout, if any.
    pub dropout: Option<Dropout>,
    /// Global index of the first sample of the local batch.
    pub sample_offset: usize,
    /// First attention head held locally (tensor parallelism).
    pub head_offset: usize,
    /// First sequence position held locally in the residual stream (sequence parallelism).
    pub seq_offset: usize,
    /// The global sequence positions of the local sequence, when they are not `0..seq`
    /// (context parallelism: a rank holds chunks of every sequence). Rotary embeddings and
    /// dropout masks use them; `None` means `seq_offset..`.
    pub positions: Option<Arc<[usize]>>,
    /// Computes the blocks' linear layers in place of [`Linear::forward`] when set.
    pub linear: Option<LinearHook>,
    /// Runs mixture-of-experts layers' experts and collects their auxiliary losses when set
    /// (without it, experts run locally and auxiliary losses are not added).
    pub moe: Option<crate::moe::MoeHook>,
    /// Computes attention's core (softmax of scores times values) in place of the local causal
    /// attention when set: context parallelism, whose keys and values live on other ranks too.
    pub core_attention: Option<AttentionHook>,
    /// Runs the transformer blocks when set: activation checkpointing recomputes some of them
    /// in backward instead of keeping their activations.
    pub checkpointing: Option<CheckpointHook>,
}

/// A block's forward as a function of the block and its input (everything else captured).
pub type BlockFn = Arc<dyn Fn(&Block, Tensor<3>) -> Tensor<3> + Send + Sync>;

/// Runs transformer blocks: how a strategy changes what a block keeps for backward.
pub trait BlockCheckpoint: Send + Sync {
    /// `forward(block, x)` for block `layer`; may keep only `x` and run `forward` again in
    /// backward.
    fn run(&self, layer: usize, block: &Block, x: Tensor<3>, forward: BlockFn) -> Tensor<3>;
}

/// A shared [`BlockCheckpoint`]; two hooks are equal when they are the same object.
#[derive(Clone)]
pub struct CheckpointHook(pub Arc<dyn BlockCheckpoint>);

impl std::fmt::Debug for CheckpointHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CheckpointHook")
    }
}

impl PartialEq for CheckpointHook {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Computes causal attention over a sequence that is split across ranks.
pub trait AttentionOp: Send + Sync {
    /// `q`, `k`, `v`: `[batch, heads, seq, head_dim]` of this rank's positions
    /// ([`ForwardContext::positions`]), rotary embeddings applied. Returns this rank's rows of
    /// `softmax(q K^T / sqrt(head_dim) + causal mask) V` over the *whole* sequence's keys `K`
    /// and values `V`, `[batch, heads, seq, head_dim]`, with `ctx`'s dropout on the
    /// probabilities of layer `layer`.
    fn attend(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        ctx: &ForwardContext,
        layer: usize,
    ) -> Tensor<4>;
}

/// A shared [`AttentionOp`]; two hooks are equal when they are the same object.
#[derive(Clone)]
pub struct AttentionHook(pub Arc<dyn AttentionOp>);

impl std::fmt::Debug for AttentionHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AttentionHook")
    }
}

impl PartialEq for AttentionHook {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Where a local tensor's elements sit along one dimension of the logical tensor.
#[derive(Debug, Clone, Copy)]
pub enum Coords<'a> {
    /// Consecutive, from this index.
    From(usize),
    /// At these indices, one per local element.
    At(&'a [usize]),
}

impl Coords<'_> {
    fn at(&self, i: usize) -> usize {
        match self {
            Coords::From(start) => start + i,
            Coords::At(indices) => indices[i],
        }
    }
}

/// Computes a linear layer in place of [`Linear::forward`]: how a strategy changes the way a
/// weight's gradient is produced (a zero-bubble pipeline defers it to a later action).
pub trait LinearOp: Send + Sync {
    /// `linear` applied to `x: [batch, seq, d_in]`.
    fn apply(&self, linear: &Linear, x: Tensor<3>) -> Tensor<3>;
}

/// A shared [`LinearOp`]; two hooks are equal when they are the same object.
#[derive(Clone)]
pub struct LinearHook(pub Arc<dyn LinearOp>);

impl std::fmt::Debug for LinearHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LinearHook")
    }
}

impl PartialEq for LinearHook {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Dropout sites in a block, combined with the layer index into a site id.
#[derive(Debug, Clone, Copy)]
pub enum Site {
    /// Attention probabilities `[batch, heads, seq, seq]`.
    AttentionProbs,
    /// The attention branch's output `[batch, seq, d_model]`, before the residual add.
    AttentionOut,
    /// The MLP branch's output `[batch, seq, d_model]`, before the residual add.
    MlpOut,
}

impl Dropout {
    fn keep(&self, site: u64, coords: &[usize]) -> bool {
        let mut h =
            SplitMix64::stream(self.seed ^ self.step.wrapping_mul(0x9E37_79B9), site).next_u64();
        for &c in coords {
            h = SplitMix64::new(h ^ c as u64).next_u64();
        }
        ((h >> 11) as f64 / (1u64 << 53) as f64) >= self.p
    }

    /// `x` with this dropout applied at `(layer, site)`; `offsets` place `x` in the logical
    /// tensor, per dimension.
    pub fn apply<const D: usize>(
        &self,
        x: Tensor<D>,
        layer: usize,
        site: Site,
        offsets: [usize; D],
    ) -> Tensor<D> {
        self.apply_at(x, layer, site, offsets.map(Coords::From))
    }

    /// [`Dropout::apply`] with each dimension's logical coordinates given by `coords`.
    pub fn apply_at<const D: usize>(
        &self,
        x: Tensor<D>,
        layer: usize,
        site: Site,
        coords: [Coords<'_>; D],
    ) -> Tensor<D> {
        if self.p <= 0.0 {
            return x;
        }
        let dims = x.dims();
        let site = layer as u64 * 8 + site as u64;
        let scale = (1.0 / (1.0 - self.p)) as f32;
        let numel: usize = dims.iter().product();
        let mut mask = Vec::with_capacity(numel);
        let mut at = [0; D];
        for i in 0..numel {
            let mut rest = i;
            for d in (0..D).rev() {
                at[d] = coords[d].at(rest % dims[d]);
                rest /= dims[d];
            }
            mask.push(if self.keep(site, &at) { scale } else { 0.0 });
        }
        let mask = Tensor::<D>::from_data(
            TensorData::new(mask, Shape::from(dims.to_vec())),
            &x.device(),
        )
        .cast(x.dtype());
        x * mask
    }
}

impl ForwardContext {
    /// `linear` applied to `x`, by the context's [`LinearOp`] if it has one.
    pub fn linear(&self, linear: &Linear, x: Tensor<3>) -> Tensor<3> {
        match &self.linear {
            Some(hook) => hook.0.apply(linear, x),
            None => linear.forward(x),
        }
    }

    /// Block `layer`'s forward, `forward(block, x)`, through the context's
    /// [`BlockCheckpoint`] if it has one.
    pub fn block(
        &self,
        layer: usize,
        block: &Block,
        x: Tensor<3>,
        forward: impl Fn(&Block, Tensor<3>) -> Tensor<3> + Send + Sync + 'static,
    ) -> Tensor<3> {
        match &self.checkpointing {
            Some(hook) => hook.0.run(layer, block, x, Arc::new(forward)),
            None => forward(block, x),
        }
    }

    /// Dropout at `(layer, site)` on a `[batch, seq, d]` residual-stream tensor.
    pub fn hidden(&self, x: Tensor<3>, layer: usize, site: Site) -> Tensor<3> {
        let Some(d) = &self.dropout else { return x };
        let seq = match &self.positions {
            Some(p) => Coords::At(&p[self.seq_offset..]),
            None => Coords::From(self.seq_offset),
        };
        d.apply_at(
            x,
            layer,
            site,
            [Coords::From(self.sample_offset), seq, Coords::From(0)],
        )
    }

    /// Rotary tables `(cos, sin)` for a local sequence of `len` positions: `0..len`, or
    /// [`ForwardContext::positions`] when set.
    pub fn rope_tables(
        &self,
        len: usize,
        head_dim: usize,
        theta: f64,
        device: &Device,
    ) -> (Tensor<2>, Tensor<2>) {
        match &self.positions {
            Some(p) => rope_tables_at(p, head_dim, theta, device),
            None => rope_tables_at(&(0..len).collect::<Vec<_>>(), head_dim, theta, device),
        }
    }

    /// Dropout on a block of attention probabilities `[batch, heads, q, k]` whose heads start
    /// at `head_offset` (of the whole model's heads) and whose queries and keys sit at global
    /// positions `q_positions` and `k_positions`.
    pub fn attention_at(
        &self,
        probs: Tensor<4>,
        layer: usize,
        head_offset: usize,
        q_positions: &[usize],
        k_positions: &[usize],
    ) -> Tensor<4> {
        match &self.dropout {
            Some(d) => d.apply_at(
                probs,
                layer,
                Site::AttentionProbs,
                [
                    Coords::From(self.sample_offset),
                    Coords::From(head_offset),
                    Coords::At(q_positions),
                    Coords::At(k_positions),
                ],
            ),
            None => probs,
        }
    }

    /// Dropout on `[batch, heads, seq, seq]` attention probabilities.
    pub fn attention(&self, probs: Tensor<4>, layer: usize) -> Tensor<4> {
        match &self.dropout {
            Some(d) => d.apply(
                probs,
                layer,
                Site::AttentionProbs,
                [self.sample_offset, self.head_offset, 0, 0],
            ),
            None => probs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn mask(d: &Dropout, dims: [usize; 3], offsets: [usize; 3]) -> Vec<f32> {
        let x = Tensor::<3>::ones(dims, &Device::flex());
        d.apply(x, 1, Site::MlpOut, offsets)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
    }

    #[test]
    fn a_part_of_the_logical_mask_is_the_mask_of_the_part_and_masks_are_reproducible() {
        let d = Dropout {
            p: 0.3,
            seed: 5,
            step: 2,
        };
        let full = mask(&d, [2, 4, 3], [0, 0, 0]);
        assert_eq!(full, mask(&d, [2, 4, 3], [0, 0, 0]), "reproducible");
        // The second half of the sequence, as a sequence-parallel rank holds it.
        let part = mask(&d, [2, 2, 3], [0, 2, 0]);
        let expected: Vec<f32> = (0..2)
            .flat_map(|b| full[b * 12 + 6..b * 12 + 12].to_vec())
            .collect();
        assert_eq!(part, expected);
        let dropped = full.iter().filter(|&&v| v == 0.0).count();
        assert!(
            dropped > 0 && dropped < full.len(),
            "{dropped} of {}",
            full.len()
        );
        let next_step = Dropout { step: 3, ..d };
        assert_ne!(
            full,
            mask(&next_step, [2, 4, 3], [0, 0, 0]),
            "masks change every step"
        );
    }
}
