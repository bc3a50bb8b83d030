//! Sequences split over `cp`, as a mixture-of-experts layer sees them: it routes whole
//! sequences (Sinkhorn balancing, capacity and drops are per sequence), so it gathers every
//! rank's router logits into position order.

use super::SequenceLayout;
use crate::collective_op::ok;
use crate::forward_context::SequenceShare;
use flashover_comm::{CommunicatorExt, Group, ReduceOp};

/// The `cp` group and which positions each of its ranks holds.
pub struct CpSequences {
    group: Group,
    layout: SequenceLayout,
}

impl CpSequences {
    /// The sequences `layout` cuts over `group`.
    pub fn new(group: &Group, layout: SequenceLayout) -> Self {
        CpSequences {
            group: group.clone(),
            layout,
        }
    }
}

impl SequenceShare for CpSequences {
    fn ranks(&self) -> usize {
        self.group.size()
    }

    fn gather(&self, rows: &[f32], batch: usize, width: usize) -> Vec<f32> {
        let local = self.layout.local_len();
        let seq_len = local * self.group.size();
        // A failed collective inside a forward has no error path: it panics with the error,
        // which the launcher reports as this rank's failure.
        let all = ok(self.group.all_gather_vec(rows));
        let mut whole = vec![0.0; batch * seq_len * width];
        for (q, part) in all.chunks(batch * local * width).enumerate() {
            for (i, p) in self.layout.positions(q).into_iter().enumerate() {
                for s in 0..batch {
                    let from = (s * local + i) * width;
                    let to = (s * seq_len + p) * width;
                    whole[to..to + width].copy_from_slice(&part[from..from + width]);
                }
            }
        }
        whole
    }

    fn sum(&self, value: f64) -> f64 {
        let mut v = [value];
        ok(self.group.all_reduce(&mut v, ReduceOp::Sum));
        v[0]
    }
}
