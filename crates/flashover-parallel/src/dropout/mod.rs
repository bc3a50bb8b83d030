//! Counter-based dropout: layout-independent and replayable.
//!
//! Whether an element is dropped is a hash of (seed, step, site, the element's coordinates in
//! the *logical* tensor, the one a single rank would hold). A rank that holds part of that tensor
//! (a slice of the batch, of the heads, of the sequence) passes the part's offsets and gets
//! exactly the logical mask's part; recomputing a forward (activation checkpointing, ZeRO-3
//! resharding) replays the same mask. So masks that must match across tensor-parallel ranks
//! (replicated activations) match, masks of split activations differ where the elements
//! differ, and every layout drops the same elements as one rank, reproducibly from the seed.

pub(crate) mod draws;

use burn::tensor::{Shape, Tensor, TensorData};
use flashover_data::SplitMix64;

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
        self.apply_site(x, layer as u64 * 8 + site as u64, coords)
    }

    /// `x` with the mask of site `site` (any number naming where in the forward it is drawn)
    /// applied; `coords` place `x` in the logical tensor.
    pub(crate) fn apply_site<const D: usize>(
        &self,
        x: Tensor<D>,
        site: u64,
        coords: [Coords<'_>; D],
    ) -> Tensor<D> {
        if self.p <= 0.0 {
            return x;
        }
        let dims = x.dims();
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
