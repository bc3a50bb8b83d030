//! Host transfers, counted by cause: each place in Flashover's communication, gradient and
//! optimizer paths that moves a tensor's values between its device and host memory says so
//! here, and why. On a GPU each one is a PCIe trip and a wait for the device queue; on Flex,
//! whose tensors are host memory, the same places mark where a GPU would pay.
//!
//! The counters are process-wide: ranks running as threads of one process add to the same
//! ones, so a step's figure is the sum over this process's ranks. What is not counted: the
//! model's own reads and uploads (index tensors, masks), the data batches, the metrics and
//! checkpoints.

use serde::Serialize;
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
}

impl Cause {
    /// Every cause, in report order.
    pub const ALL: [Cause; 2] = [Cause::Collective, Cause::Flat];

    fn index(self) -> usize {
        self as usize
    }

    /// The cause's name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Cause::Collective => "collective staging",
            Cause::Flat => "flat vectors (optimizers, norms)",
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

/// Records a read of `bytes` from a device to the host.
pub fn to_host(cause: Cause, bytes: usize) {
    let c = &COUNTERS[cause.index()];
    c[0].fetch_add(1, Ordering::Relaxed);
    c[1].fetch_add(bytes as u64, Ordering::Relaxed);
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
        let exact = Transfers([
            Crossings {
                to_host: Moved {
                    count: 2,
                    bytes: 16,
                },
                to_device: Moved { count: 1, bytes: 4 },
            },
            Crossings::default(),
        ]);
        assert_eq!(exact.since(&Transfers::default()), exact);
        assert_eq!(exact.since(&exact), Transfers::default());
        assert_eq!(exact.of(Cause::Collective).to_host.count, 2);
    }
}
