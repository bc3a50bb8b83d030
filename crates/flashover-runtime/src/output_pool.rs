//! Host buffers for the outputs of collectives that make a new tensor (all-gather,
//! reduce-scatter, all-to-all, receive) on engines that take host memory, reused: a fresh
//! 64 MiB allocation is mapped anew by the system and faults in every page the engine writes,
//! and a freed one is unmapped again, which cost several times the collective itself
//! (docs/benchmarks.md, "bench comm"). A buffer goes back to the pool when the tensor built on
//! it is dropped, as PyTorch's caching allocator keeps its blocks; the pool keeps at most
//! [`KEPT_BYTES`].

use burn::tensor::{AllocationProperty, Bytes};
use burn_std::{AccessError, AccessPolicy, AllocationController};
use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::sync::{Mutex, MutexGuard};

/// The most bytes the pool keeps for reuse; buffers past it are freed.
const KEPT_BYTES: usize = 512 << 20;

/// Outputs smaller than this are plain allocations: the system allocator reuses small blocks
/// itself, and a pool of many sizes (uneven all-to-all splits) only churns.
const POOLED_FROM: usize = 4 << 20;

/// A buffer's memory, as allocated: its element width is its alignment.
enum Buffer {
    U32(Vec<u32>),
    U64(Vec<u64>),
}

impl Buffer {
    fn bytes(&self) -> usize {
        match self {
            Buffer::U32(v) => v.len() * 4,
            Buffer::U64(v) => v.len() * 8,
        }
    }

    fn align(&self) -> usize {
        match self {
            Buffer::U32(_) => 4,
            Buffer::U64(_) => 8,
        }
    }
}

/// Free buffers by their length in bytes, and the bytes they hold.
#[derive(Default)]
struct Pool {
    free: HashMap<usize, Vec<Buffer>>,
    bytes: usize,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

fn pool() -> MutexGuard<'static, Option<Pool>> {
    POOL.lock().unwrap_or_else(|p| p.into_inner())
}

/// `len` bytes for a collective's output, aligned for elements of `align` bytes (at most 8): a
/// reused buffer of that length (its old values, which the engine overwrites), or a new zeroed
/// one; below [`POOLED_FROM`], a new zeroed one.
pub(crate) fn output(len: usize, align: usize) -> Bytes {
    if len < POOLED_FROM {
        // A vector of the element's width (`Bytes::from_bytes_vec` would copy a `Vec<u8>` to
        // align it).
        return match align {
            2 => Bytes::from_elems(vec![0u16; len.div_ceil(2)]),
            4 => Bytes::from_elems(vec![0u32; len.div_ceil(4)]),
            8 => Bytes::from_elems(vec![0u64; len.div_ceil(8)]),
            _ => Bytes::from_elems(vec![0u8; len]),
        };
    }
    // The lengths a buffer for `len` bytes has: whole 8-byte words, or whole 4-byte ones.
    let sizes = [len.div_ceil(8) * 8, len.div_ceil(4) * 4];
    let reused = pool().as_mut().and_then(|pool| {
        sizes.iter().find_map(|size| {
            let free = pool.free.get_mut(size)?;
            let buffer = free.swap_remove(free.iter().position(|b| b.align() >= align)?);
            pool.bytes -= buffer.bytes();
            Some(buffer)
        })
    });
    let buffer = reused.unwrap_or_else(|| match align > 4 || len.is_multiple_of(8) {
        true => Buffer::U64(vec![0; len.div_ceil(8)]),
        false => Buffer::U32(vec![0; len.div_ceil(4)]),
    });
    // SAFETY: every one of the buffer's bytes (at least `len`) is initialized: zeroed when
    // made, written since.
    unsafe { Bytes::from_controller(Box::new(Pooled(Some(buffer))), len) }
}

/// Keeps `buffer` for a later output. Past [`KEPT_BYTES`] the pool forgets what it kept
/// before (sizes a run no longer asks for), then keeps it if it fits.
fn keep(buffer: Buffer) {
    let bytes = buffer.bytes();
    let mut pool = pool();
    let pool = pool.get_or_insert_with(Pool::default);
    if pool.bytes + bytes > KEPT_BYTES {
        *pool = Pool::default();
    }
    if bytes > 0 && bytes <= KEPT_BYTES {
        pool.bytes += bytes;
        pool.free.entry(bytes).or_default().push(buffer);
    }
}

/// A pooled buffer behind a [`Bytes`]; dropped, it returns to the pool.
struct Pooled(Option<Buffer>);

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(buffer) = self.0.take() {
            keep(buffer);
        }
    }
}

impl Pooled {
    fn buffer(&self) -> &Buffer {
        self.0.as_ref().expect("a pooled buffer until dropped")
    }
}

impl AllocationController for Pooled {
    fn alloc_align(&self) -> usize {
        self.buffer().align()
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Other
    }

    fn memory(&self, _policy: AccessPolicy) -> Result<&[MaybeUninit<u8>], AccessError> {
        let (ptr, len) = match self.buffer() {
            Buffer::U32(v) => (v.as_ptr().cast(), v.len() * 4),
            Buffer::U64(v) => (v.as_ptr().cast(), v.len() * 8),
        };
        // SAFETY: the vector's memory, `len` bytes, viewed as bytes.
        Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
    }

    unsafe fn memory_mut(
        &mut self,
        _policy: AccessPolicy,
    ) -> Result<&mut [MaybeUninit<u8>], AccessError> {
        let (ptr, len) = match self.0.as_mut().expect("a pooled buffer until dropped") {
            Buffer::U32(v) => (v.as_mut_ptr().cast(), v.len() * 4),
            Buffer::U64(v) => (v.as_mut_ptr().cast(), v.len() * 8),
        };
        // SAFETY: the vector's memory, `len` bytes, viewed as bytes; the caller writes only
        // initialized values.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pooled length no other test asks for, so no other test thread takes its buffers.
    const LEN: usize = POOLED_FROM + 1236;

    #[test]
    fn a_dropped_output_is_handed_out_again() {
        let mut first = output(LEN, 8);
        assert_eq!((first.len(), first.align()), (LEN, 8));
        first.copy_from_slice(&[7u8; LEN]);
        let at = first.as_ptr();
        drop(first);
        let again = output(LEN, 8);
        assert_eq!(again.as_ptr(), at, "the dropped output is reused");
        assert_eq!(again.len(), LEN);
        // Another length, 4-byte elements: a buffer of whole 4-byte words.
        let narrow = output(LEN + 2, 4);
        assert_eq!((narrow.len(), narrow.align()), (LEN + 2, 4));
    }
}
