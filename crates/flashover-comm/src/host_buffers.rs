//! Which host buffers reach an engine's byte-level collectives, and why.
//!
//! A tensor's values should reach an engine only through the one adapter that stages them
//! where the (device, engine) pair needs it (`flashover_runtime::TensorCollectives`), which
//! marks its calls [`Purpose::Staging`]. Values that live on the host on both sides and are
//! never a tensor's elements (counts, flags, codes, scalar metrics) go through [`control`].
//! Anything else is a strategy handing the engine a host buffer of its own: the
//! [`crate::FlightRecorder`] tallies every call of each kind per rank ([`HostBuffers`]), so a
//! test can run a step of every strategy and require none.

use crate::dtype::DType;
use crate::op::OpKind;
use std::cell::Cell;

/// Why a caller hands an engine a host buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A tensor's bytes, staged by the tensor adapter for an engine that takes host memory.
    Staging,
    /// Host values that are not a tensor's elements: counts, flags, codes, scalar metrics.
    Control,
}

thread_local! {
    static PURPOSE: Cell<Option<Purpose>> = const { Cell::new(None) };
}

/// Runs `f`, marking the host buffers it hands to collectives (on this thread) as `purpose`.
pub fn marked<R>(purpose: Purpose, f: impl FnOnce() -> R) -> R {
    let before = PURPOSE.with(|p| p.replace(Some(purpose)));
    // Restored on unwind too, so a panicking collective leaves no mark behind.
    struct Restore(Option<Purpose>);
    impl Drop for Restore {
        fn drop(&mut self) {
            PURPOSE.with(|p| p.set(self.0));
        }
    }
    let _restore = Restore(before);
    f()
}

/// Runs `f`, whose collectives move control values: counts, flags, codes, scalar metrics,
/// host values on both sides that are never a tensor's elements.
pub fn control<R>(f: impl FnOnce() -> R) -> R {
    marked(Purpose::Control, f)
}

/// The purpose the calling thread's collectives are marked with now.
pub(crate) fn current() -> Option<Purpose> {
    PURPOSE.with(Cell::get)
}

/// Calls and bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// How many calls.
    pub calls: u64,
    /// Bytes of each call's largest buffer, summed.
    pub bytes: u64,
}

impl Tally {
    fn add(&mut self, bytes: usize) {
        self.calls += 1;
        self.bytes += bytes as u64;
    }
}

/// How many unmarked calls [`HostBuffers::first_unmarked`] describes.
const DESCRIBED: usize = 8;

/// One rank's byte-level collectives on host buffers, by purpose.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostBuffers {
    /// A tensor's bytes staged by the tensor adapter.
    pub staged: Tally,
    /// Control values ([`control`]).
    pub control: Tally,
    /// Neither: a host buffer handed to the engine outside the adapter.
    pub unmarked: Tally,
    /// The most floating-point elements in one control call (metrics are scalars; a larger
    /// figure is data travelling as control).
    pub largest_float_control: usize,
    /// The first unmarked calls, described (`all_reduce of 256 B f32 on tp[0,1]`).
    pub first_unmarked: Vec<String>,
}

impl HostBuffers {
    /// Tallies a call; whether it was unmarked (neither staging nor control).
    pub(crate) fn note(&mut self, op: OpKind, group: &str, dtype: DType, bytes: usize) -> bool {
        match current() {
            Some(Purpose::Staging) => self.staged.add(bytes),
            Some(Purpose::Control) => {
                self.control.add(bytes);
                if dtype.is_float() {
                    let elements = bytes / dtype.size().max(1);
                    self.largest_float_control = self.largest_float_control.max(elements);
                }
            }
            None => {
                self.unmarked.add(bytes);
                if self.first_unmarked.len() < DESCRIBED {
                    self.first_unmarked
                        .push(format!("{op:?} of {bytes} B {dtype:?} on {group}"));
                }
                return true;
            }
        }
        false
    }
}
