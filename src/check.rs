//! Checking that a layout trains what one rank trains: compare loss curves and weights
//! relative to the reference's scale (the checklist in `docs/guide.md`, section 9).
//!
//! ```
//! use flashover::check::{assert_close, relative_difference};
//!
//! let one_rank = [2.50, 2.10, 1.70];
//! let four_ranks = [2.50, 2.100001, 1.70];
//! assert!(relative_difference(&one_rank, &four_ranks) < 1e-6);
//! assert_close("loss curve", &one_rank, &four_ranks, 1e-5);
//! ```

/// Largest `|candidate - reference|` over the largest `|reference|`: 0 for equal slices;
/// infinite when the lengths differ or any value is not finite (a NaN never passes).
pub fn relative_difference(reference: &[f32], candidate: &[f32]) -> f32 {
    if reference.len() != candidate.len()
        || reference.iter().chain(candidate).any(|v| !v.is_finite())
    {
        return f32::INFINITY;
    }
    let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = reference
        .iter()
        .zip(candidate)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    if worst == 0.0 {
        0.0
    } else {
        worst / scale.max(f32::MIN_POSITIVE)
    }
}

/// Largest `|candidate[i] - reference[i]| / |reference[i]|`: each value against itself, as
/// loss curves are compared step by step; infinite when the lengths differ or any value is not
/// finite (a NaN never passes).
///
/// ```
/// use flashover::check::stepwise_relative_difference;
/// assert!(stepwise_relative_difference(&[2.0, 0.5], &[2.0, 0.5000001]) < 1e-6);
/// assert!(stepwise_relative_difference(&[2.0, 0.5], &[2.0, f32::NAN]).is_infinite());
/// ```
pub fn stepwise_relative_difference(reference: &[f32], candidate: &[f32]) -> f32 {
    if reference.len() != candidate.len()
        || reference.iter().chain(candidate).any(|v| !v.is_finite())
    {
        return f32::INFINITY;
    }
    reference
        .iter()
        .zip(candidate)
        .map(|(a, b)| match (a - b).abs() {
            0.0 => 0.0,
            d => d / a.abs().max(f32::MIN_POSITIVE),
        })
        .fold(0.0, f32::max)
}

/// Panics, naming `what` and the difference, when `candidate` is not within `tolerance` of
/// `reference` ([`relative_difference`]).
pub fn assert_close(what: &str, reference: &[f32], candidate: &[f32], tolerance: f32) {
    let d = relative_difference(reference, candidate);
    assert!(
        d <= tolerance,
        "{what}: relative difference {d:.3e} exceeds the tolerance {tolerance:.1e}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_are_relative_and_nan_or_shape_never_passes() {
        assert_eq!(relative_difference(&[1.0, -4.0], &[1.0, -4.0]), 0.0);
        assert!((relative_difference(&[1.0, -4.0], &[1.4, -4.0]) - 0.1).abs() < 1e-6);
        assert!(relative_difference(&[1.0], &[f32::NAN]).is_infinite());
        assert!(relative_difference(&[1.0], &[1.0, 2.0]).is_infinite());
        let caught = std::panic::catch_unwind(|| assert_close("w", &[1.0], &[2.0], 1e-5));
        assert!(caught.is_err());
    }
}
