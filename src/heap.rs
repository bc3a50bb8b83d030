//! The process's heap: a global allocator that counts live bytes and their peak (for memory
//! benchmarks) and keeps freed blocks of 32 MiB or more for the next allocation of the same
//! size (for collectives on large Flex tensors). The `flashover` binary installs it; a library
//! user's program can too (in its `main` crate: `#[global_allocator] static HEAP:
//! flashover::heap::Allocator = flashover::heap::Allocator;`, as
//! `examples/activation_checkpointing.rs` does).
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
//! ranks run as threads of one process share them. A kept block is not live: the process
//! holds up to [`KEPT_BYTES`] of them beyond what the counters show.
//!
//! Why keep large blocks: glibc serves every allocation of 32 MiB or more with a mapping of its
//! own and unmaps it when it is freed. A collective consumes its input tensor, so at 64 MiB
//! each call freed one, and the unmapping (page tables, TLB shoot-downs to the other ranks'
//! threads) cost the rank about as long as the collective itself; the next fresh tensor then
//! faulted in every page again (docs/benchmarks.md, "bench comm"). Smaller blocks glibc keeps
//! in its heap itself.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Freed blocks of at least this many bytes are kept for the next allocation of the same
/// layout (glibc's largest mmap threshold).
const KEPT_FROM: usize = 32 << 20;

/// The most freed blocks kept at once.
const KEPT_BLOCKS: usize = 8;

/// The most bytes kept at once.
pub const KEPT_BYTES: usize = 512 << 20;

/// Freed large blocks, oldest first: address, size and alignment. A fixed array, since the
/// allocator must not allocate.
struct Kept {
    blocks: [(usize, usize, usize); KEPT_BLOCKS],
    len: usize,
    bytes: usize,
}

static KEPT: Mutex<Kept> = Mutex::new(Kept::new());

fn kept() -> std::sync::MutexGuard<'static, Kept> {
    KEPT.lock().unwrap_or_else(|p| p.into_inner())
}

impl Kept {
    const fn new() -> Self {
        Kept {
            blocks: [(0, 0, 0); KEPT_BLOCKS],
            len: 0,
            bytes: 0,
        }
    }

    /// A kept block of `layout`, taken out.
    fn take(&mut self, layout: Layout) -> Option<usize> {
        let at = self.blocks[..self.len]
            .iter()
            .position(|&(_, size, align)| size == layout.size() && align == layout.align())?;
        Some(self.remove(at).0)
    }

    fn remove(&mut self, at: usize) -> (usize, usize, usize) {
        let block = self.blocks[at];
        self.blocks.copy_within(at + 1..self.len, at);
        self.len -= 1;
        self.bytes -= block.1;
        block
    }

    /// Keeps the freed block at `ptr` of `layout`. Returns the blocks to free now: the oldest
    /// kept ones, where room had to be made (sizes a run no longer asks for), or this one,
    /// where it is larger than everything kept may be.
    fn keep(&mut self, ptr: usize, layout: Layout) -> [Option<(usize, Layout)>; KEPT_BLOCKS] {
        let mut free = [None; KEPT_BLOCKS];
        if layout.size() > KEPT_BYTES {
            free[0] = Some((ptr, layout));
            return free;
        }
        let mut evicted = 0;
        while self.len == KEPT_BLOCKS || self.bytes + layout.size() > KEPT_BYTES {
            let (old, size, align) = self.remove(0);
            // SAFETY: the layout the block was freed with, so a valid one.
            free[evicted] = Some((old, unsafe {
                Layout::from_size_align_unchecked(size, align)
            }));
            evicted += 1;
        }
        self.blocks[self.len] = (ptr, layout.size(), layout.align());
        self.len += 1;
        self.bytes += layout.size();
        free
    }
}

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting, and keeping freed blocks of 32 MiB or more for reuse.
pub struct Allocator;

impl Allocator {
    fn grew(size: usize) {
        let live = LIVE.fetch_add(size, Ordering::Relaxed) + size;
        PEAK.fetch_max(live, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to `System` unchanged, except that a freed large block may
// be kept and handed out again, whole, for an allocation of exactly its size and alignment
// (which `System` would have served with a block of that layout too).
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        INSTALLED.store(true, Ordering::Relaxed);
        let reused = (layout.size() >= KEPT_FROM)
            .then(|| kept().take(layout))
            .flatten()
            .map(|p| p as *mut u8);
        // SAFETY: the caller's contract is System's; a kept block came from `System` with
        // this layout and nothing uses it since it was freed.
        let p = reused.unwrap_or_else(|| unsafe { System.alloc(layout) });
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
        if layout.size() < KEPT_FROM {
            // SAFETY: the caller's contract is System's.
            unsafe { System.dealloc(ptr, layout) };
        } else {
            // Freed outside the lock: unmapping takes a while.
            let evicted = kept().keep(ptr as usize, layout);
            for (old, old_layout) in evicted.into_iter().flatten() {
                // SAFETY: a block `System` allocated with this layout, kept unused since.
                unsafe { System.dealloc(old as *mut u8, old_layout) };
            }
        }
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

/// Whether [`Allocator`] is the global allocator (it has counted an allocation).
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

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(mib: usize) -> Layout {
        Layout::from_size_align(mib << 20, 8).unwrap()
    }

    // Addresses are only compared, never read: the blocks are bookkeeping.
    #[test]
    fn a_kept_block_serves_its_layout_only_and_the_oldest_make_room() {
        let mut kept = Kept::new();
        let none = [None; KEPT_BLOCKS];
        assert_eq!(kept.keep(0x1000, layout(64)), none);
        assert_eq!(kept.take(layout(32)), None, "another size");
        assert_eq!(
            kept.take(Layout::from_size_align(64 << 20, 16).unwrap()),
            None,
            "another alignment"
        );
        assert_eq!(kept.take(layout(64)), Some(0x1000));
        assert_eq!(kept.take(layout(64)), None, "taken once");
        // Eight blocks of 64 MiB fill the slots and the 512 MiB; the ninth evicts the first.
        for i in 0..8 {
            assert_eq!(kept.keep(0x1000 * (i + 1), layout(64)), none);
        }
        let mut first = none;
        first[0] = Some((0x1000, layout(64)));
        assert_eq!(kept.keep(0x9000, layout(64)), first);
        // A block of 448 MiB needs the room of the seven oldest.
        let evicted = kept.keep(0xB000, layout(448));
        let expected: Vec<_> = (2..9).map(|i| Some((0x1000 * i, layout(64)))).collect();
        assert_eq!(evicted[..7], expected[..]);
        assert_eq!((kept.len, kept.bytes), (2, 512 << 20));
        // A block larger than the whole cap is freed at once.
        let huge = Layout::from_size_align(KEPT_BYTES + 1, 8).unwrap();
        assert_eq!(kept.keep(0xA000, huge)[0], Some((0xA000, huge)));
        assert_eq!(kept.take(layout(448)), Some(0xB000));
    }
}
