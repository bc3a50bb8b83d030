//! Sequences split over `cp`, as a mixture-of-experts layer sees them: it routes whole
//! sequences (Sinkhorn balancing, capacity and drops are per sequence), so it gathers every
//! rank's router logits into position order.

use super::SequenceLayout;
use crate::collective_op::ok;
use crate::forward_context::SequenceShare;
use crate::tensor_util::index_tensor;
use burn::tensor::Tensor;
use flashover_comm::Group;
use flashover_runtime::TensorCollectives;

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

    fn gather(&self, rows: Tensor<3>) -> Tensor<3> {
        let local = self.layout.local_len();
        // Every rank's positions side by side in rank order, then each position's column
        // picked into place. A failed collective inside a forward has no error path: it
        // panics with the error, which the launcher reports as this rank's failure.
        let device = rows.device();
        let side_by_side = ok(self.group.all_gather_tensor(rows, 1));
        let mut column = vec![0; local * self.group.size()];
        for q in 0..self.group.size() {
            for (i, p) in self.layout.positions(q).into_iter().enumerate() {
                column[p] = q * local + i;
            }
        }
        side_by_side.select(1, index_tensor(&column, [column.len()], &device))
    }
}
