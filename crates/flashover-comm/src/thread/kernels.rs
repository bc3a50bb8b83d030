//! Data movement on published buffer addresses, used inside the phases of a collective.

use crate::dtype::{DType, Element, with_dtype};
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
/// Every element is combined as `((x0 op x1) op x2) ...` in the accumulator type and rounded
/// once, so the result equals a sequential fold in rank order, whichever rank computes it.
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
    with_dtype!(dtype, T => unsafe {
        match op {
            ReduceOp::Sum => reduce_typed::<T>(srcs, dst, range, |a, b| T::combine(ReduceOp::Sum, a, b), None),
            ReduceOp::Avg => {
                reduce_typed::<T>(srcs, dst, range, |a, b| T::combine(ReduceOp::Sum, a, b), Some(srcs.len()))
            }
            ReduceOp::Max => reduce_typed::<T>(srcs, dst, range, |a, b| T::combine(ReduceOp::Max, a, b), None),
            ReduceOp::Min => reduce_typed::<T>(srcs, dst, range, |a, b| T::combine(ReduceOp::Min, a, b), None),
        }
    })
}

/// Block-wise fold: the accumulator block stays in cache, each input is streamed once and the
/// result is written once. `combine` is monomorphised per op so the inner loops vectorise.
unsafe fn reduce_typed<T: Element>(
    srcs: &[usize],
    dst: usize,
    range: Range<usize>,
    combine: impl Fn(T::Acc, T::Acc) -> T::Acc,
    average_over: Option<usize>,
) {
    let mut acc: Vec<T::Acc> = Vec::with_capacity(BLOCK.min(range.len()));
    let mut start = range.start;
    while start < range.end {
        let len = BLOCK.min(range.end - start);
        // Input slices (one of which may alias `dst`) live only until the block is folded.
        let block =
            |p: usize| unsafe { std::slice::from_raw_parts((p as *const T).add(start), len) };
        acc.clear();
        acc.extend(block(srcs[0]).iter().map(|x| x.to_acc()));
        for &p in &srcs[1..] {
            for (a, x) in acc.iter_mut().zip(block(p)) {
                *a = combine(*a, x.to_acc());
            }
        }
        let out = unsafe { std::slice::from_raw_parts_mut((dst as *mut T).add(start), len) };
        match average_over {
            Some(n) => out
                .iter_mut()
                .zip(&acc)
                .for_each(|(o, a)| *o = T::from_acc(T::div_count(*a, n))),
            None => out
                .iter_mut()
                .zip(&acc)
                .for_each(|(o, a)| *o = T::from_acc(*a)),
        }
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
