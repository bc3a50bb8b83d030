//! A seeded first-order Markov chain over a vocabulary, with its exact entropy rate.

use crate::TokenSource;
use crate::rng::SplitMix64;

/// Sequences from a random sparse Markov chain: each token has `branching` possible successors
/// (always including `token + 1`, which makes the chain irreducible) with random probabilities.
///
/// The first token of every sample is drawn from the stationary distribution, so every position
/// is stationary and the expected next-token cross-entropy of a perfect model is exactly the
/// entropy rate `H = sum_s pi(s) * sum_t -P(s,t) ln P(s,t)`.
#[derive(Debug, Clone)]
pub struct MarkovSource {
    seed: u64,
    /// `successors[s]` = (token, cumulative probability) pairs.
    successors: Vec<Vec<(u32, f64)>>,
    /// Cumulative stationary distribution.
    stationary_cdf: Vec<f64>,
    entropy_rate: f64,
}

impl MarkovSource {
    /// A chain over `vocab` tokens with `branching` successors per token, from `seed`.
    pub fn new(vocab: usize, branching: usize, seed: u64) -> Self {
        assert!(vocab >= 2, "a Markov chain needs at least two tokens");
        let branching = branching.clamp(1, vocab);
        let mut rng = SplitMix64::stream(seed, u64::MAX);
        let mut probs: Vec<Vec<(u32, f64)>> = Vec::with_capacity(vocab);
        for s in 0..vocab {
            let mut next = vec![((s + 1) % vocab) as u32];
            while next.len() < branching {
                let t = rng.below(vocab as u64) as u32;
                if !next.contains(&t) {
                    next.push(t);
                }
            }
            // Skewed weights give a chain whose entropy is well below ln(branching).
            let weights: Vec<f64> = next.iter().map(|_| rng.next_f64().powi(2) + 0.05).collect();
            let total: f64 = weights.iter().sum();
            probs.push(
                next.into_iter()
                    .zip(weights)
                    .map(|(t, w)| (t, w / total))
                    .collect(),
            );
        }
        let stationary = stationary_distribution(&probs);
        let entropy_rate = stationary
            .iter()
            .zip(&probs)
            .map(|(pi, row)| pi * row.iter().map(|&(_, p)| -p * p.ln()).sum::<f64>())
            .sum();
        let successors = probs
            .iter()
            .map(|row| cumulative(row.iter().map(|&(t, p)| (t, p))))
            .collect();
        let stationary_cdf = cumulative(stationary.iter().enumerate().map(|(t, &p)| (t as u32, p)))
            .into_iter()
            .map(|(_, c)| c)
            .collect();
        MarkovSource {
            seed,
            successors,
            stationary_cdf,
            entropy_rate,
        }
    }

    /// The chain's entropy rate in nats per token.
    pub fn entropy_rate(&self) -> f64 {
        self.entropy_rate
    }
}

fn cumulative(items: impl Iterator<Item = (u32, f64)>) -> Vec<(u32, f64)> {
    let mut acc = 0.0;
    let mut out: Vec<(u32, f64)> = items
        .map(|(t, p)| {
            acc += p;
            (t, acc)
        })
        .collect();
    if let Some(last) = out.last_mut() {
        last.1 = 1.0; // guard against rounding leaving a gap at the top
    }
    out
}

/// Stationary distribution by power iteration on the lazy chain `(P + I) / 2` (same fixed point,
/// always aperiodic), until an iteration moves it by less than 1e-13 in the L1 norm (or after
/// 20,000 iterations, which bounds start-up time for very large vocabularies).
fn stationary_distribution(probs: &[Vec<(u32, f64)>]) -> Vec<f64> {
    let n = probs.len();
    let mut pi = vec![1.0 / n as f64; n];
    for _ in 0..20_000 {
        let mut next: Vec<f64> = pi.iter().map(|p| 0.5 * p).collect();
        for (s, row) in probs.iter().enumerate() {
            for &(t, p) in row {
                next[t as usize] += 0.5 * pi[s] * p;
            }
        }
        let delta: f64 = next.iter().zip(&pi).map(|(a, b)| (a - b).abs()).sum();
        pi = next;
        if delta < 1e-13 {
            break;
        }
    }
    pi
}

fn draw(cdf: impl Iterator<Item = (u32, f64)>, u: f64) -> u32 {
    let mut last = 0;
    for (t, c) in cdf {
        last = t;
        if u < c {
            return t;
        }
    }
    last
}

impl TokenSource for MarkovSource {
    fn vocab_size(&self) -> usize {
        self.successors.len()
    }

    fn sample(&self, index: u64, len: usize) -> Vec<u32> {
        let mut rng = SplitMix64::stream(self.seed, index);
        let mut out = Vec::with_capacity(len);
        if len == 0 {
            return out;
        }
        let mut cur = draw(
            self.stationary_cdf
                .iter()
                .enumerate()
                .map(|(t, &c)| (t as u32, c)),
            rng.next_f64(),
        );
        out.push(cur);
        while out.len() < len {
            cur = draw(
                self.successors[cur as usize].iter().copied(),
                rng.next_f64(),
            );
            out.push(cur);
        }
        out
    }

    fn loss_floor(&self) -> Option<f64> {
        Some(self.entropy_rate)
    }

    fn describe(&self) -> String {
        format!(
            "markov chain: vocab {}, {} successors per token, seed {}, entropy rate {:.4} nats",
            self.vocab_size(),
            self.successors[0].len(),
            self.seed,
            self.entropy_rate
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_reproducible_and_follow_the_chain() {
        let m = MarkovSource::new(64, 4, 7);
        assert_eq!(m.sample(3, 50), m.sample(3, 50));
        assert_ne!(m.sample(3, 50), m.sample(4, 50));
        let s = m.sample(11, 200);
        for w in s.windows(2) {
            assert!(
                m.successors[w[0] as usize].iter().any(|&(t, _)| t == w[1]),
                "{w:?} is not a transition"
            );
        }
    }

    #[test]
    fn the_empirical_cross_entropy_of_the_true_chain_matches_the_entropy_rate() {
        let m = MarkovSource::new(32, 3, 1);
        // Mean of -ln P(next | cur) over many transitions -> entropy rate.
        let (mut total, mut count) = (0.0, 0usize);
        for i in 0..400 {
            let s = m.sample(i, 100);
            for w in s.windows(2) {
                let row = &m.successors[w[0] as usize];
                let pos = row.iter().position(|&(t, _)| t == w[1]).unwrap();
                let p = row[pos].1 - if pos == 0 { 0.0 } else { row[pos - 1].1 };
                total -= p.ln();
                count += 1;
            }
        }
        let empirical = total / count as f64;
        assert!(
            (empirical - m.entropy_rate()).abs() < 0.02,
            "{empirical} vs {}",
            m.entropy_rate()
        );
        assert!(m.entropy_rate() > 0.1 && m.entropy_rate() < 3f64.ln());
    }
}
