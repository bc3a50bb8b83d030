//! How a pipeline cuts a model's blocks into stages, and what the cut costs: stages hold whole
//! blocks, and the last one also the LM head, so the busiest stage, which sets the pipeline's
//! pace, usually has more than the mean. The training job cuts by this (`pp_split = "cost"`)
//! and the planner charges the difference.

/// Blocks per stage for `blocks` blocks of cost `block` each over `stages` stages, the last
/// also paying `head`: the contiguous split whose most expensive stage is cheapest, every stage
/// holding at least one block; with that stage's cost. `None` if there are fewer blocks than
/// stages.
pub fn balanced_stages(
    blocks: usize,
    stages: usize,
    block: f64,
    head: f64,
) -> Option<(Vec<usize>, f64)> {
    if stages == 0 || blocks < stages {
        return None;
    }
    let cost =
        |from: usize, to: usize| (to - from) as f64 * block + if to == blocks { head } else { 0.0 };
    // best[k][i]: the smallest possible maximum stage cost putting the first i blocks into k
    // stages; cut[k][i]: where that k-th stage starts.
    let mut best = vec![vec![f64::INFINITY; blocks + 1]; stages + 1];
    let mut cut = vec![vec![0usize; blocks + 1]; stages + 1];
    best[0][0] = 0.0;
    for k in 1..=stages {
        for i in k..=blocks {
            for j in (k - 1)..i {
                let c = best[k - 1][j].max(cost(j, i));
                if c < best[k][i] {
                    best[k][i] = c;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut counts = vec![0; stages];
    let mut i = blocks;
    for k in (1..=stages).rev() {
        let j = cut[k][i];
        counts[k - 1] = i - j;
        i = j;
    }
    Some((counts, best[stages][blocks]))
}

/// The busiest stage's cost over the mean stage's under [`balanced_stages`] (1 without a
/// pipeline): the factor by which whole blocks and the head slow a pipeline down.
pub fn stage_imbalance(blocks: usize, stages: usize, block: f64, head: f64) -> f64 {
    if stages <= 1 {
        return 1.0;
    }
    let mean = (blocks as f64 * block + head) / stages as f64;
    balanced_stages(blocks, stages, block, head).map_or(1.0, |(_, busiest)| busiest / mean)
}

/// Blocks each pipeline rank holds when [`balanced_stages`] cuts `blocks` blocks into
/// `ranks x chunks` virtual stages, rank `r` holding virtual stages `r`, `r + ranks`, ... (the
/// interleaved schedule's assignment; one stage per rank when `chunks` is 1). `None` if there
/// are fewer blocks than virtual stages.
pub fn blocks_per_rank(
    blocks: usize,
    ranks: usize,
    chunks: usize,
    block: f64,
    head: f64,
) -> Option<Vec<usize>> {
    let (counts, _) = balanced_stages(blocks, ranks * chunks, block, head)?;
    let mut per_rank = vec![0; ranks];
    for (stage, count) in counts.into_iter().enumerate() {
        per_rank[stage % ranks] += count;
    }
    Some(per_rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_pushes_blocks_off_the_last_stage_as_far_as_it_pays() {
        // 7 blocks, 4 stages, a head worth one block: the last stage holds one block.
        let (counts, busiest) = balanced_stages(7, 4, 1.0, 1.0).unwrap();
        assert_eq!(counts, vec![2, 2, 2, 1]);
        assert_eq!(busiest, 2.0);
        assert_eq!(stage_imbalance(7, 4, 1.0, 1.0), 1.0);
        // Without a head the split is even and costs nothing.
        assert_eq!(balanced_stages(8, 4, 1.0, 0.0).unwrap().0, vec![2, 2, 2, 2]);
        assert_eq!(stage_imbalance(8, 4, 1.0, 0.0), 1.0);
        // 80 blocks over 16 stages with a head of 0.95 blocks: 5.95 / 5.06.
        let f = stage_imbalance(80, 16, 1.0, 0.95);
        assert!((f - 5.95 / (80.95 / 16.0)).abs() < 1e-12, "{f}");
        assert_eq!(balanced_stages(3, 4, 1.0, 0.0), None);
    }

    #[test]
    fn uneven_blocks_go_to_the_stages_without_the_head() {
        // Llama 3 405B's 126 blocks over 8 stages: none holds more than 16.
        let counts = blocks_per_rank(126, 8, 1, 1.0, 0.0).unwrap();
        assert_eq!(
            (counts.iter().sum::<usize>(), counts.iter().max()),
            (126, Some(&16))
        );
        // Interleaved: rank r sums its virtual stages r and r + ranks.
        assert_eq!(blocks_per_rank(8, 2, 2, 1.0, 0.0).unwrap(), vec![4, 4]);
        assert_eq!(blocks_per_rank(3, 2, 2, 1.0, 0.0), None);
    }
}
