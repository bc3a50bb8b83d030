//! Heap accounting for memory benchmarks: a global allocator that counts live bytes and their
//! peak. The `flashover` binary installs it; a library user's program can too (in its `main`
//! crate: `#[global_allocator] static HEAP: flashover::heap::CountingAllocator =
//! flashover::heap::CountingAllocator;`, as `examples/activation_checkpointing.rs` does).
//!
//! ```
//! use flashover::heap;
//!
//! // Without the allocator installed the counters stay at zero and `counting` says so.
//! if heap::counting() {
//!     let before = heap::live_bytes();
//!     let buffer = vec![0u8; 1 << 20];
//!     assert!(heap::peak_bytes() >= before + buffer.len());
//! } else {
//!     assert_eq!(heap::live_bytes(), 0);
//! }
//! ```
//!
//! Flex tensors live on the heap, so on the CPU backend the peak is the honest peak of bytes
//! held by tensors (plus everything else the process holds). The counters are process-wide:
//! ranks run as threads of one process share them.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting.
pub struct CountingAllocator;

impl CountingAllocator {
    fn grew(size: usize) {
        let live = LIVE.fetch_add(size, Ordering::Relaxed) + size;
        PEAK.fetch_max(live, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to `System` unchanged; only counters are updated.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        INSTALLED.store(true, Ordering::Relaxed);
        // SAFETY: the caller's contract is System's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            Self::grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        INSTALLED.store(true, Ordering::Relaxed);
        // SAFETY: the caller's contract is System's.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            Self::grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is System's.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract is System's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                Self::grew(new_size - layout.size());
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

/// Whether [`CountingAllocator`] is the global allocator (it has counted an allocation).
pub fn counting() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// Bytes allocated and not yet freed.
pub fn live_bytes() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// The most bytes live at once since the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new peak from the bytes live now; returns them.
pub fn reset_peak() -> usize {
    let live = live_bytes();
    PEAK.store(live, Ordering::Relaxed);
    live
}
