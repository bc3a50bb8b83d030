//! Operation kinds and reduction operators.

use serde::{Deserialize, Serialize};
use std::fmt;

/// How an all-reduce or reduce-scatter combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    /// Element-wise sum, in rank order.
    Sum,
    /// Element-wise sum in rank order, then divided by the group size.
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

/// The kind of a communication operation: used in errors, statistics and fault rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    /// [`crate::Communicator::all_reduce_bytes`].
    AllReduce,
    /// [`crate::Communicator::reduce_scatter_bytes`].
    ReduceScatter,
    /// [`crate::Communicator::all_gather_bytes`].
    AllGather,
    /// [`crate::Communicator::broadcast_bytes`].
    Broadcast,
    /// [`crate::Communicator::all_to_all_v_bytes`].
    AllToAll,
    /// [`crate::Communicator::send_bytes`].
    Send,
    /// [`crate::Communicator::recv_bytes`].
    Recv,
    /// [`crate::Communicator::exchange_bytes`]: sends and receives as one batch.
    Exchange,
    /// [`crate::Communicator::barrier`].
    Barrier,
    /// [`crate::Communicator::split`].
    Split,
}

impl OpKind {
    /// Every kind, in a stable order.
    pub const ALL: [OpKind; 10] = [
        OpKind::AllReduce,
        OpKind::ReduceScatter,
        OpKind::AllGather,
        OpKind::Broadcast,
        OpKind::AllToAll,
        OpKind::Send,
        OpKind::Recv,
        OpKind::Exchange,
        OpKind::Barrier,
        OpKind::Split,
    ];

    /// The snake_case name used in logs and JSON (`all_reduce`, ...).
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::AllToAll => "all_to_all",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Exchange => "exchange",
            OpKind::Barrier => "barrier",
            OpKind::Split => "split",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
