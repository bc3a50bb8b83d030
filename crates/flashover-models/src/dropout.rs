//! Counter-based dropout: layout-independent and replayable.
//!
//! Whether an element is dropped is a hash of (seed, step, site, the element's coordinates in
//! the *logical* tensor, the one a single rank would hold). A rank that holds part of that tensor
//! (a slice of the batch, of the heads, of the sequence) passes the part's offsets and gets
//! exactly the logical mask's part; recomputing a forward (activation checkpointing, ZeRO-3
//! resharding) replays the same mask. So masks that must match across tensor-parallel ranks
//! (replicated activations) match, masks of split activations differ where the elements
//! differ, and every layout drops the same elements as one rank, reproducibly from the seed.

use burn::nn::Linear;
use burn::tensor::{Shape, Tensor, TensorData};
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
    /// Computes the blocks' linear layers in place of [`Linear::forward`] when set.
    pub linear: Option<LinearHook>,
    /// Runs mixture-of-experts layers' experts and collects their auxiliary losses when set
    /// (without it, experts run locally and auxiliary losses are not added).
    pub moe: Option<crate::moe::MoeHook>,
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
        if self.p <= 0.0 {
            return x;
        }
        let dims = x.dims();
        let site = layer as u64 * 8 + site as u64;
        let scale = (1.0 / (1.0 - self.p)) as f32;
        let numel: usize = dims.iter().product();
        let mut mask = Vec::with_capacity(numel);
        let mut coords = offsets;
        for i in 0..numel {
            let mut rest = i;
            for d in (0..D).rev() {
                coords[d] = offsets[d] + rest % dims[d];
                rest /= dims[d];
            }
            mask.push(if self.keep(site, &coords) { scale } else { 0.0 });
        }
        let mask = Tensor::<D>::from_data(
            TensorData::new(mask, Shape::from(dims.to_vec())),
            &x.device(),
        );
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

    /// Dropout at `(layer, site)` on a `[batch, seq, d]` residual-stream tensor.
    pub fn hidden(&self, x: Tensor<3>, layer: usize, site: Site) -> Tensor<3> {
        match &self.dropout {
            Some(d) => d.apply(x, layer, site, [self.sample_offset, self.seq_offset, 0]),
            None => x,
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
