//! Data movement on published buffer addresses, used inside the phases of a collective.

use crate::dtype::{DType, Element, reduce_slices, with_dtype};
use crate::op::ReduceOp;
use std::ops::Range;

/// Elements per reduction block: small enough that the accumulator stays in L1/L2 cache.
const BLOCK: usize = 4096;

/// The `r`-th of `n` near-equal contiguous chunks of `len` elements.
pub(crate) fn chunk(len: usize, n: usize, r: usize) -> Range<usize> {
    (r * len / n)..((r + 1) * len / n)
}

/// Reduces elements `range` of every buffer in `srcs` (in rank order) into `dst[range]`.
///
/// # Safety
/// Every address must point to at least `range.end` elements of `dtype`, alive and not written
/// by anyone else for the duration of the call. `dst` may be one of `srcs`.
pub(crate) unsafe fn reduce_chunk(
    dtype: DType,
    op: ReduceOp,
    srcs: &[usize],
    dst: usize,
    range: Range<usize>,
) {
    with_dtype!(dtype, T => unsafe { reduce_typed::<T>(op, srcs, dst, range) })
}

unsafe fn reduce_typed<T: Element>(op: ReduceOp, srcs: &[usize], dst: usize, range: Range<usize>) {
    let mut out = vec![T::zeroed(); BLOCK.min(range.len())];
    let mut start = range.start;
    while start < range.end {
        let len = BLOCK.min(range.end - start);
        {
            // The input slices (one of which may alias `dst`) live only inside this block.
            let inputs: Vec<&[T]> = srcs
                .iter()
                .map(|&p| unsafe { std::slice::from_raw_parts((p as *const T).add(start), len) })
                .collect();
            reduce_slices(op, &inputs, &mut out[..len]);
        }
        unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), (dst as *mut T).add(start), len) };
        start += len;
    }
}

/// Copies `count` elements of `dtype` from address `src` to address `dst`.
///
/// # Safety
/// Both addresses must hold `count` elements; the source must not be written and the
/// destination not read by anyone else during the call; they must not overlap.
pub(crate) unsafe fn copy_elems(dtype: DType, src: usize, dst: usize, count: usize) {
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, count * dtype.size()) }
}
