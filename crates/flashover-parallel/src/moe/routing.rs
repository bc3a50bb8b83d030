//! Routing on the host: from a batch's router logits, which experts each token goes to, which
//! assignments are dropped when an expert is over capacity, and the order in which the kept
//! ones are laid out (grouped by expert). See the module docs of `crate::moe`.

use super::{DropPolicy, MoeConfig, RouterKind};

/// Where the kept assignments of a batch go, decided from the router logits on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Per kept assignment, grouped by expert (then in priority order): the token's row.
    pub token: Vec<usize>,
    /// Per kept assignment: its index in the `[tokens, top_k]` choices (`token * top_k + j`).
    pub choice: Vec<usize>,
    /// The experts chosen, `[tokens, top_k]` row-major (dropped ones included).
    pub chosen: Vec<usize>,
    /// Kept assignments per expert (the layout of `token`).
    pub kept: Vec<usize>,
    /// Assignments per expert before dropping.
    pub routed: Vec<usize>,
}

impl Routing {
    /// Per choice of the `[tokens, top_k]` slots (`choices` of them): the kept row holding it,
    /// or the number of kept rows (one past the last) where it was dropped.
    pub fn slots(&self, choices: usize) -> Vec<usize> {
        let mut slot = vec![self.token.len(); choices];
        for (row, &c) in self.choice.iter().enumerate() {
            slot[c] = row;
        }
        slot
    }

    /// This rank's part of a routing decided for whole sequences (`batch` of `seq_len`
    /// tokens): the tokens at `positions` of each sequence, numbered as the rank holds them
    /// (`[batch, positions.len()]`), in the same expert groups.
    pub fn restrict(&self, batch: usize, seq_len: usize, positions: &[usize]) -> Routing {
        let k = self.chosen.len() / (batch * seq_len).max(1);
        let local = positions.len();
        let mut local_of = vec![None; seq_len];
        for (i, &p) in positions.iter().enumerate() {
            local_of[p] = Some(i);
        }
        let renumber =
            |token: usize| local_of[token % seq_len].map(|i| token / seq_len * local + i);
        let mut chosen = Vec::with_capacity(batch * local * k);
        for s in 0..batch {
            for &p in positions {
                let g = s * seq_len + p;
                chosen.extend_from_slice(&self.chosen[g * k..(g + 1) * k]);
            }
        }
        let mut routed = vec![0; self.routed.len()];
        chosen.iter().for_each(|&x| routed[x] += 1);
        let (mut token, mut choice) = (vec![], vec![]);
        let mut kept = vec![0; self.kept.len()];
        let mut at = 0;
        for (x, &n) in self.kept.iter().enumerate() {
            for row in at..at + n {
                if let Some(t) = renumber(self.token[row]) {
                    token.push(t);
                    choice.push(t * k + self.choice[row] % k);
                    kept[x] += 1;
                }
            }
            at += n;
        }
        Routing {
            token,
            choice,
            chosen,
            kept,
            routed,
        }
    }

    /// Assignments dropped for want of capacity.
    pub fn dropped(&self) -> usize {
        self.routed.iter().sum::<usize>() - self.kept.iter().sum::<usize>()
    }
}

/// Chooses experts for `logits: [tokens, n_experts]` (row-major, `seq_len` consecutive tokens
/// per sequence) and applies the capacity of `config`. `bias` (one per expert) is added to the
/// scores for choosing only.
pub fn route(logits: &[f32], seq_len: usize, config: &MoeConfig, bias: Option<&[f32]>) -> Routing {
    let k = config.top_k;
    let tokens = logits.len() / config.n_experts;
    let chosen = choose_experts(logits, seq_len, config, bias);
    // Priority within each (sequence, expert): by choice rank then position, or by weight
    // (each choice's router score, computed once rather than in every comparison).
    let weight: Vec<f32> = match config.drop_policy {
        DropPolicy::Position => vec![],
        DropPolicy::Probability => choice_weights(logits, &chosen, config),
    };
    let capacity = config.capacity(seq_len);
    let mut per_expert: Vec<Vec<(usize, usize)>> = vec![vec![]; config.n_experts];
    let mut routed = vec![0; config.n_experts];
    for start in (0..tokens).step_by(seq_len.max(1)) {
        let end = (start + seq_len).min(tokens);
        let mut candidates: Vec<usize> = (start * k..end * k).collect();
        match config.drop_policy {
            DropPolicy::Position => candidates.sort_by_key(|&c| (c % k, c / k)),
            DropPolicy::Probability => candidates.sort_by(|&a, &b| {
                weight[b]
                    .total_cmp(&weight[a])
                    .then((a / k).cmp(&(b / k)))
                    .then(a.cmp(&b))
            }),
        }
        let mut taken = vec![0; config.n_experts];
        for c in candidates {
            let x = chosen[c];
            routed[x] += 1;
            if capacity.is_none_or(|cap| taken[x] < cap) {
                taken[x] += 1;
                per_expert[x].push((c / k, c));
            }
        }
    }
    let kept = per_expert.iter().map(Vec::len).collect();
    let mut token = Vec::new();
    let mut choice = Vec::new();
    for mut list in per_expert {
        // Within an expert, rows go in token order (the order does not change the result; a
        // fixed one keeps every layout's expert inputs identical).
        list.sort_unstable();
        for (t, c) in list {
            token.push(t);
            choice.push(c);
        }
    }
    Routing {
        token,
        choice,
        chosen,
        kept,
        routed,
    }
}

/// Each token's `top_k` experts (token-major), by its logits plus `bias` and, under balanced
/// routing, its sequence's Sinkhorn scaling. Softmax and sigmoid are monotone in the logit,
/// so choosing by logit chooses by score; ties go to the lower expert index.
fn choose_experts(
    logits: &[f32],
    seq_len: usize,
    config: &MoeConfig,
    bias: Option<&[f32]>,
) -> Vec<usize> {
    let (e, k) = (config.n_experts, config.top_k);
    let mut chosen = Vec::with_capacity(logits.len() / e * k);
    let mut order: Vec<usize> = (0..e).collect();
    for rows in logits.chunks(seq_len.max(1) * e) {
        // Balanced routing: per sequence, the log of Sinkhorn's expert scaling joins the bias.
        let balance = sinkhorn_log_scaling(rows, e, config.sinkhorn_iters);
        for row in rows.chunks(e) {
            let score = |x: usize| {
                row[x] + bias.map_or(0.0, |b| b[x]) + balance.as_ref().map_or(0.0, |s| s[x])
            };
            order.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
            chosen.extend_from_slice(&order[..k]);
        }
    }
    chosen
}

/// The router's score of each choice in `chosen` (token-major, `top_k` per token).
fn choice_weights(logits: &[f32], chosen: &[usize], config: &MoeConfig) -> Vec<f32> {
    let (e, k) = (config.n_experts, config.top_k);
    (0..chosen.len())
        .map(|choice| {
            let (t, x) = (choice / k, chosen[choice]);
            let row = &logits[t * e..(t + 1) * e];
            match config.router {
                RouterKind::Softmax => {
                    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                    (row[x] - max).exp() / row.iter().map(|&v| (v - max).exp()).sum::<f32>()
                }
                RouterKind::Sigmoid => 1.0 / (1.0 + (-row[x]).exp()),
            }
        })
        .collect()
}

/// Sinkhorn balancing of one sequence's `rows: [tokens, e]` logits: the log of the per-expert
/// scaling `c` such that `exp(logits) * r * c` (for some per-token `r`) has rows summing to
/// `1 / tokens` and columns to `1 / e`: choosing by `logit + ln c` is choosing from a plan that
/// gives every expert the same share. `None` when `iterations` is 0.
fn sinkhorn_log_scaling(rows: &[f32], e: usize, iterations: usize) -> Option<Vec<f32>> {
    if iterations == 0 {
        return None;
    }
    let t = rows.len() / e;
    // Subtracting each row's max leaves the plan's scaling of columns unchanged.
    let p: Vec<f64> = rows
        .chunks(e)
        .flat_map(|row| {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            row.iter().map(move |&v| ((v - max) as f64).exp())
        })
        .collect();
    let (mut r, mut c) = (vec![1.0f64; t], vec![1.0f64; e]);
    for _ in 0..iterations {
        for (i, ri) in r.iter_mut().enumerate() {
            let s: f64 = (0..e).map(|x| p[i * e + x] * c[x]).sum();
            *ri = 1.0 / (t as f64 * s);
        }
        for (x, cx) in c.iter_mut().enumerate() {
            let s: f64 = (0..t).map(|i| p[i * e + x] * r[i]).sum();
            *cx = 1.0 / (e as f64 * s);
        }
    }
    Some(c.iter().map(|&v| v.ln() as f32).collect())
}
