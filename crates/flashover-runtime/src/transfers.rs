//! Host transfers, counted by cause: each place in Flashover's communication, gradient and
//! optimizer paths that moves a tensor's values between its device and host memory says so
//! here, and why. On a GPU each one is a PCIe trip and a wait for the device queue; on Flex,
//! whose tensors are host memory, the same places mark where a GPU would pay.
//!
//! The counters are process-wide: ranks running as threads of one process add to the same
//! ones, so a run's figure is the sum over this process's ranks. Reads are also counted per
//! thread ([`thread_reads`]): a rank's thread reads what its step reads, so a step's reads on
//! a rank are its thread's (collective staging may run on a communication thread, and is
//! reported apart anyway).
//!
//! Every read of a tensor's values to the host in the step's code (flashover-parallel,
//! flashover-models, the trainer and the Learner) goes through [`read`] or [`read_scalar`],
//! which count it; a test fails on a read written any other way there. Not counted yet: uploads
//! of the model's own (rope tables, masks, index tensors), the data batches, checkpoints.

use burn::tensor::kind::Basic;
use burn::tensor::{Tensor, TensorData};
use serde::Serialize;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Why values crossed between a device and the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// Staging for an engine that works on host memory ([`crate::TensorCollectives`]).
    Collective,
    /// Parameters and gradients as flat host vectors: AdamW's host loop (where the device
    /// takes no kernels) and its results written back, the norm's per-parameter sums, state
    /// that still lives on the host (ZeRO-1/2 rows, hot-expert copies).
    Flat,
    /// Losses and auxiliary losses read to the host: a pipeline's per-micro-batch sums, a
    /// mixture-of-experts layer's statistics.
    Loss,
    /// Vocabulary-parallel lookups: token ids read to find this rank's rows.
    Lookup,
    /// Mixture-of-experts routing computed on the host: the router's logits read.
    Routing,
    /// Metrics read for reports (a Learner's outputs, a step's loss and norm).
    Metrics,
    /// Loss-scale decisions (f16): whether a step's gradient norm overflowed, read before its
    /// optimizer step.
    LossScale,
    /// Set-up and checks before training: shards cut on the host, the first step's split and
    /// replica checks.
    SetUp,
    /// Host waits for the device that read no values: the fence before NCCL takes a CUDA
    /// tensor's buffer (one per device collective, until collectives are ordered on the
    /// device). Counted as a read of 0 bytes.
    Fence,
}

impl Cause {
    /// Every cause, in report order.
    pub const ALL: [Cause; 9] = [
        Cause::Collective,
        Cause::Flat,
        Cause::Loss,
        Cause::Lookup,
        Cause::Routing,
        Cause::Metrics,
        Cause::LossScale,
        Cause::SetUp,
        Cause::Fence,
    ];

    fn index(self) -> usize {
        self as usize
    }

    /// The cause's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Cause::Collective => "collective staging",
            Cause::Flat => "flat vectors (optimizers, norms)",
            Cause::Loss => "losses",
            Cause::Lookup => "vocabulary lookups",
            Cause::Routing => "expert routing",
            Cause::Metrics => "metrics",
            Cause::LossScale => "loss-scale decisions",
            Cause::SetUp => "set-up and checks",
            Cause::Fence => "device fences (collectives)",
        }
    }
}

/// Transfers in one direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Moved {
    /// How many.
    pub count: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// The transfers of one cause, both ways.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Crossings {
    /// Device to host (reads).
    pub to_host: Moved,
    /// Host to device (writes).
    pub to_device: Moved,
}

/// Every cause's transfers, indexed as [`Cause::ALL`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Transfers(pub [Crossings; Cause::ALL.len()]);

impl Transfers {
    /// `cause`'s transfers.
    pub fn of(&self, cause: Cause) -> Crossings {
        self.0[cause.index()]
    }

    /// What happened between `earlier` and `self` (both [`snapshot`]s).
    pub fn since(&self, earlier: &Transfers) -> Transfers {
        let mut out = *self;
        for (now, then) in out.0.iter_mut().zip(&earlier.0) {
            now.to_host.count -= then.to_host.count;
            now.to_host.bytes -= then.to_host.bytes;
            now.to_device.count -= then.to_device.count;
            now.to_device.bytes -= then.to_device.bytes;
        }
        out
    }
}

/// Per cause: reads, read bytes, writes, written bytes.
static COUNTERS: [[AtomicU64; 4]; Cause::ALL.len()] =
    [const { [const { AtomicU64::new(0) }; 4] }; Cause::ALL.len()];

thread_local! {
    /// Per cause: reads on this thread.
    static THREAD_READS: Cell<[u64; Cause::ALL.len()]> =
        const { Cell::new([0; Cause::ALL.len()]) };
}

/// Records a read of `bytes` from a device to the host.
pub fn to_host(cause: Cause, bytes: usize) {
    let c = &COUNTERS[cause.index()];
    c[0].fetch_add(1, Ordering::Relaxed);
    c[1].fetch_add(bytes as u64, Ordering::Relaxed);
    THREAD_READS.with(|r| {
        let mut reads = r.get();
        reads[cause.index()] += 1;
        r.set(reads);
    });
}

/// The reads this thread has made so far, per cause (indexed as [`Cause::ALL`]).
pub fn thread_reads() -> [u64; Cause::ALL.len()] {
    THREAD_READS.with(Cell::get)
}

/// `tensor`'s values read to the host, counted as `cause`: the one way the step's code reads
/// a tensor (on a GPU each read waits for the device's queue to drain).
pub fn read<const D: usize, K: Basic>(tensor: Tensor<D, K>, cause: Cause) -> TensorData {
    let data = tensor.into_data();
    to_host(cause, data.as_bytes().len());
    data
}

/// The value of a one-element tensor read to the host as an `f32`, counted as `cause`.
pub fn read_scalar<const D: usize>(tensor: Tensor<D>, cause: Cause) -> f32 {
    to_host(cause, tensor.dtype().size());
    tensor.into_scalar::<f32>()
}

/// Records a write of `bytes` from the host to a device.
pub fn to_device(cause: Cause, bytes: usize) {
    let c = &COUNTERS[cause.index()];
    c[2].fetch_add(1, Ordering::Relaxed);
    c[3].fetch_add(bytes as u64, Ordering::Relaxed);
}

/// The counters now (since the process started).
pub fn snapshot() -> Transfers {
    let mut out = Transfers::default();
    for cause in Cause::ALL {
        let c = &COUNTERS[cause.index()];
        let load = |i: usize| c[i].load(Ordering::Relaxed);
        out.0[cause.index()] = Crossings {
            to_host: Moved {
                count: load(0),
                bytes: load(1),
            },
            to_device: Moved {
                count: load(2),
                bytes: load(3),
            },
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_by_cause_and_direction() {
        // Other tests of this binary may count at the same time: compare lower bounds only.
        let before = snapshot();
        to_host(Cause::Collective, 12);
        to_host(Cause::Collective, 4);
        to_device(Cause::Flat, 8);
        let delta = snapshot().since(&before);
        let staged = delta.of(Cause::Collective);
        assert!(staged.to_host.count >= 2 && staged.to_host.bytes >= 16);
        let flat = delta.of(Cause::Flat);
        assert!(flat.to_device.count >= 1 && flat.to_device.bytes >= 8);
        let mut exact = Transfers::default();
        exact.0[Cause::Collective.index()] = Crossings {
            to_host: Moved {
                count: 2,
                bytes: 16,
            },
            to_device: Moved { count: 1, bytes: 4 },
        };
        assert_eq!(exact.since(&Transfers::default()), exact);
        assert_eq!(exact.since(&exact), Transfers::default());
        assert_eq!(exact.of(Cause::Collective).to_host.count, 2);
    }
}
