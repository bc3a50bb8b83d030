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
    balanced_stages(blocks, stages, block, head)
        .map_or(1.0, |(counts, _)| cut_imbalance(&counts, block, head))
}

/// The busiest stage's cost over the mean stage's for stages holding `counts` blocks of cost
/// `block` each, the last also paying `head` (1 for one stage): any cut, balanced or not.
pub fn cut_imbalance(counts: &[usize], block: f64, head: f64) -> f64 {
    let Some(last) = counts.len().checked_sub(1).filter(|&last| last > 0) else {
        return 1.0;
    };
    let cost = |stage: usize| counts[stage] as f64 * block + if stage == last { head } else { 0.0 };
    let total = counts.iter().sum::<usize>() as f64 * block + head;
    let busiest = (0..=last).map(cost).fold(0.0, f64::max);
    busiest / (total / counts.len() as f64)
}

/// Blocks each pipeline rank holds when the virtual stages hold `counts` blocks, rank `r`
/// holding virtual stages `r`, `r + ranks`, ... (the interleaved schedule's assignment; one
/// stage per rank when there are `ranks` of them).
pub fn per_rank(counts: &[usize], ranks: usize) -> Vec<usize> {
    let mut held = vec![0; ranks];
    for (stage, count) in counts.iter().enumerate() {
        held[stage % ranks] += count;
    }
    held
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
        let (counts, _) = balanced_stages(126, 8, 1.0, 0.0).unwrap();
        assert_eq!(
            (counts.iter().sum::<usize>(), counts.iter().max()),
            (126, Some(&16))
        );
        // Interleaved: rank r sums its virtual stages r and r + ranks.
        let (virtual_stages, _) = balanced_stages(8, 4, 1.0, 0.0).unwrap();
        assert_eq!(per_rank(&virtual_stages, 2), vec![4, 4]);
        assert_eq!(per_rank(&[1, 2, 3, 4], 2), vec![4, 6]);
        assert_eq!(balanced_stages(3, 4, 1.0, 0.0), None);
    }

    #[test]
    fn any_cut_is_charged_its_busiest_stage() {
        // An even cut of 4 blocks with a head worth one: the last stage costs 3 of a mean 2.5.
        assert_eq!(cut_imbalance(&[2, 2], 1.0, 1.0), 3.0 / 2.5);
        assert_eq!(cut_imbalance(&[4], 1.0, 1.0), 1.0);
    }
}
