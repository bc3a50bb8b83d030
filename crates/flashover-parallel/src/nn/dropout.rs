//! Burn's `Dropout`, drawing the masks one device draws, whatever the layout.
//!
//! Burn's `Dropout` draws each mask from the device's generator, so under `tp` every rank
//! drops different elements of the same replicated activation, and no layout drops what one
//! device drops. Here a mask element is a hash of the run's seed, the step, the site and the
//! element's coordinates in the logical tensor ([`crate::dropout`]'s counter-based masks): a
//! rank holding part of the tensor (its samples, its heads, its hidden features) draws exactly
//! that part of the one-device mask, and ranks holding the same part draw the same.
//!
//! What a Burn forward does not carry, a rank's *draws* hold ([`crate::dropout::draws`]): the
//! seed, the step and the global indices of the local batch's samples. [`crate::parallelize::Parallelized`]
//! sets them in `batch_share` and for each micro-batch of `pipeline()?.step` (seeded by the
//! plan's `dropout_seed`); a one-device loop sets them with [`set_dropout_draws`]. Sites are
//! numbered in call order within a scope: before the layer stack, layer `i` (entered by the
//! encoder's and decoder's forward, and by a pipeline around each of its layers), and after
//! it; so the numbering does not depend on which rank runs which layer. Without draws, the
//! layers drop as Burn's does (the device's generator), and a layer split over `tp` refuses.

use crate::dropout::draws::{self, Draws};
use crate::dropout::{Coords, Dropout as CounterDropout};
use crate::placed::tp_split;
use burn::module::{Flag, Module, Param};
use burn::tensor::Tensor;
use std::ops::Range;

/// Burn's [`burn::nn::DropoutConfig`] for [`Dropout`].
#[derive(burn::config::Config, Debug)]
pub struct DropoutConfig {
    /// The probability of zeroing an element in training.
    pub prob: f64,
}

impl DropoutConfig {
    /// A new layer, as Burn's `DropoutConfig::init` makes it (panics on a probability outside
    /// `[0, 1)`).
    pub fn init(&self) -> Dropout {
        burn::nn::DropoutConfig::new(self.prob).init().into()
    }
}

/// Burn's [`burn::nn::Dropout`] with the same fields (so the same record) whose masks are the
/// one-device masks under every layout (see the module's docs). Dimension 0 of its input is
/// the batch.
#[derive(Module, Debug)]
pub struct Dropout {
    /// The probability of zeroing an element in training.
    pub prob: f64,
    /// Whether the layer behaves as in training (Burn's flag, cleared by `freeze`).
    pub training: Param<Flag>,
}

impl From<burn::nn::Dropout> for Dropout {
    fn from(dropout: burn::nn::Dropout) -> Self {
        Dropout {
            prob: dropout.prob,
            training: dropout.training,
        }
    }
}

impl Dropout {
    /// `input` with elements zeroed with probability `prob` and the rest scaled by `1 / (1 -
    /// prob)`, in training on an autodiff device (Burn's conditions); the input otherwise.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        // Dimension 1, if any, may be a residual stream's sequence.
        let positions = match D {
            1 => Positions::Whole,
            _ => Positions::Residual(1),
        };
        drop_elements(self.prob, &self.training, input, [0; D], positions, None)
    }
}

/// Makes this thread's dropout masks those of `samples` (global sample indices: the batch the
/// next forward computes) of step `step` of a run seeded `seed`, as every layout draws them:
/// the call a one-device loop makes before each step's forward to train as a plan does with
/// the same `dropout_seed` (a plan's `batch_share` and `pipeline()?.step` make it themselves).
pub fn set_dropout_draws(seed: u64, step: usize, samples: Range<usize>) {
    draws::set_draws(Some(Draws::new(seed, step, samples)));
}

/// Makes this thread's dropout draw from the device's generator again, as Burn's does.
pub fn clear_dropout_draws() {
    draws::set_draws(None);
}

/// Which dimension of a dropped tensor, if any, holds a sequence's positions that a stack may
/// have split (a splitting stack places them; [`drop_elements`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Positions {
    /// None of its dimensions is split by position (attention weights: whole sequences on
    /// every rank, under `sp` and under a stack's all-to-all `cp`).
    Whole,
    /// This dimension is a residual stream's sequence: this rank's positions inside a
    /// splitting stack.
    Residual(usize),
    /// This dimension is a sequence inside a tensor-parallel region: whole under sequence
    /// parallelism (the region gathered it), this rank's positions under a `cp` stack.
    InRegion(usize),
}

/// Dropout on the output of a residual branch of `layer`, whose attention's query projection
/// is `query` (which says whether the layer is split over `tp`): the residual stream is
/// replicated over `tp`, so every rank draws the whole mask; inside a splitting stack it holds
/// this rank's positions.
pub(crate) fn drop_residual(
    dropout: &burn::nn::Dropout,
    branch: Tensor<3>,
    query: &Param<Tensor<2>>,
    layer: &str,
) -> Tensor<3> {
    let split = tp_split(query).map(|s| (layer, s.group.size()));
    let positions = Positions::Residual(1);
    drop_elements(
        dropout.prob,
        &dropout.training,
        branch,
        [0; 3],
        positions,
        split,
    )
}

/// Whether dropout with probability `prob` drops anything on `device`: in training, on an
/// autodiff device, at a probability above 0 (as Burn's `Dropout`).
pub(crate) fn drops(prob: f64, training: &Param<Flag>, device: &burn::tensor::Device) -> bool {
    training.is_enabled() && device.is_autodiff() && prob != 0.0
}

/// A layer split over `tp` (its name and the group's size), for the refusal without draws.
pub(crate) type SplitLayer<'a> = Option<(&'a str, usize)>;

/// Dropout with probability `prob` of `x`, whose elements sit at `offsets` of the logical
/// tensor past dimension 0 (dimension 0 is the batch, placed by the draws; the dimension
/// `positions` names, if any, placed by a splitting stack): the one-device mask's part with
/// draws set, Burn's device-drawn mask without (which a layer `split` over `tp` refuses).
/// Nothing in eval, off autodiff or at `prob` 0, as Burn's.
pub(crate) fn drop_elements<const D: usize>(
    prob: f64,
    training: &Param<Flag>,
    x: Tensor<D>,
    mut offsets: [usize; D],
    positions: Positions,
    split: SplitLayer<'_>,
) -> Tensor<D> {
    if !drops(prob, training, &x.device()) {
        return x;
    }
    let Some((draws, site)) = draws::next_site() else {
        if let Some((layer, tp)) = split {
            panic!(
                "{layer} is split over tp={tp} and has dropout {prob} in training, with no \
                 dropout draws set on this rank: Burn's device generator would give every tp \
                 rank its own mask. Parallelized::data().batch_share and pipeline()?.step set the draws; \
                 a loop of one's own calls flashover::nn::set_dropout_draws before the forward"
            );
        }
        return burn::nn::Dropout {
            prob,
            training: training.clone(),
        }
        .forward(x);
    };
    if let Some(why) = draws.refusal {
        panic!("dropout {prob} in training is refused under this plan: {why}");
    }
    let held = super::sequence_split::held_positions();
    match (positions, held) {
        (Positions::Residual(dim), Some((first, _))) => offsets[dim] += first,
        (Positions::InRegion(dim), Some((first, true))) => offsets[dim] += first,
        (Positions::Residual(_), None) => {
            if let Some(why) = draws.outside_split {
                panic!("dropout {prob} in training is refused under this plan: {why}");
            }
        }
        _ => {}
    }
    let batch = x.dims()[0];
    assert_eq!(
        batch,
        draws.samples.len(),
        "dropout: the tensor's dimension 0 holds {batch} samples, but this rank's draws are for \
         samples {:?}: dimension 0 must be the batch of the forward, and a forward over part \
         of a step's samples (a micro-batch) sets its own with flashover::nn::set_dropout_draws",
        draws.samples
    );
    let mut coords = offsets.map(Coords::From);
    coords[0] = Coords::From(draws.samples.start + offsets[0]);
    let masks = CounterDropout {
        p: prob,
        seed: draws.seed,
        step: draws.step,
    };
    masks.apply_site(x, site, coords)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dropout::draws::{Scope, in_layer, in_scope};
    use burn::tensor::Device;

    fn mask(dropout: &Dropout, dims: [usize; 2]) -> Vec<f32> {
        let x = Tensor::<2>::ones(dims, &Device::flex().autodiff());
        dropout.forward(x).into_data().try_to_vec::<f32>().unwrap()
    }

    #[test]
    fn a_rank_draws_its_samples_part_of_the_one_device_mask_in_each_scope() {
        let dropout = DropoutConfig::new(0.3).init();
        set_dropout_draws(7, 2, 0..4);
        let whole_before = mask(&dropout, [4, 6]);
        let whole_layer = in_layer(0, || mask(&dropout, [4, 6]));
        let whole_after = mask(&dropout, [4, 6]);
        assert_ne!(whole_before, whole_layer);
        assert_ne!(whole_before, whole_after);
        // The second half of the samples, as a data-parallel rank, or a pipeline's second
        // micro-batch, draws them.
        let half = Draws::new(7, 2, 2..4);
        let part_before = in_scope(Some(&half), Scope::Before, || mask(&dropout, [2, 6]));
        let part_layer = in_scope(Some(&half), Scope::Layer(0), || mask(&dropout, [2, 6]));
        let part_after = in_scope(Some(&half), Scope::After, || mask(&dropout, [2, 6]));
        assert_eq!(part_before, whole_before[12..]);
        assert_eq!(part_layer, whole_layer[12..]);
        assert_eq!(part_after, whole_after[12..]);
        let dropped = whole_before.iter().filter(|&&v| v == 0.0).count();
        assert!(dropped > 0 && dropped < 24, "{dropped} of 24 dropped");
        clear_dropout_draws();
    }

    #[test]
    fn without_draws_or_in_eval_it_is_burns_dropout() {
        clear_dropout_draws();
        let dropout = DropoutConfig::new(0.5).init();
        let x = Tensor::<2>::ones([3, 4], &Device::flex());
        let off_autodiff = dropout.forward(x.clone());
        assert_eq!(off_autodiff.into_data(), x.into_data());
        let drawn = mask(&dropout, [8, 8]);
        assert!(drawn.iter().all(|&v| v == 0.0 || v == 2.0));
    }

    #[test]
    #[should_panic(expected = "dimension 0 holds 3 samples")]
    fn a_batch_other_than_the_draws_samples_is_refused() {
        set_dropout_draws(1, 0, 0..4);
        mask(&DropoutConfig::new(0.1).init(), [3, 5]);
    }
}
