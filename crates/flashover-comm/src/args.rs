//! Checks of one rank's call on its own (sizes, root, counts, peer), the same for every engine:
//! each returns what the operation needs (an element count) or the message of an
//! `InvalidArgument` error.

use crate::dtype::DType;

/// Elements of `dtype` in `bytes`.
pub(crate) fn elements(bytes: usize, dtype: DType) -> Result<usize, String> {
    if !bytes.is_multiple_of(dtype.size()) {
        return Err(format!(
            "buffer of {bytes} bytes is not a whole number of {dtype} elements"
        ));
    }
    Ok(bytes / dtype.size())
}

/// Reduce-scatter over `n` ranks: `send` holds `n` blocks of `recv`'s size. Returns the
/// elements per block.
pub(crate) fn reduce_scatter(
    n: usize,
    send: usize,
    recv: usize,
    dtype: DType,
) -> Result<usize, String> {
    let m = elements(recv, dtype)?;
    if send != n * recv {
        return Err(format!(
            "send has {send} bytes, expected group size {n} x recv {recv} bytes"
        ));
    }
    Ok(m)
}

/// All-gather over `n` ranks: `recv` holds `n` copies of `send`'s size. Returns the elements
/// each rank contributes.
pub(crate) fn all_gather(
    n: usize,
    send: usize,
    recv: usize,
    dtype: DType,
) -> Result<usize, String> {
    let m = elements(send, dtype)?;
    if recv != n * send {
        return Err(format!(
            "recv has {recv} bytes, expected group size {n} x send {send} bytes"
        ));
    }
    Ok(m)
}

/// Broadcast from `root` over `n` ranks. Returns the elements.
pub(crate) fn broadcast(
    n: usize,
    bytes: usize,
    dtype: DType,
    root: usize,
) -> Result<usize, String> {
    let m = elements(bytes, dtype)?;
    if root >= n {
        return Err(format!("root {root} is not a rank of a group of size {n}"));
    }
    Ok(m)
}

/// Variable all-to-all over `n` ranks: one count per rank each way, summing to the buffers.
pub(crate) fn all_to_all(
    n: usize,
    send: usize,
    send_counts: &[usize],
    recv: usize,
    recv_counts: &[usize],
    dtype: DType,
) -> Result<(), String> {
    if send_counts.len() != n || recv_counts.len() != n {
        return Err(format!(
            "{} send counts and {} recv counts for a group of size {n}",
            send_counts.len(),
            recv_counts.len()
        ));
    }
    let (s, r) = (
        send_counts.iter().sum::<usize>(),
        recv_counts.iter().sum::<usize>(),
    );
    if s * dtype.size() != send || r * dtype.size() != recv {
        return Err(format!(
            "counts sum to {s} send / {r} recv elements but buffers hold {send} / {recv} bytes of {dtype}"
        ));
    }
    Ok(())
}

/// A point-to-point peer (`what`: "destination" or "source") of rank `rank` in a group of `n`;
/// `allow_self` says whether the engine can deliver a message to its own rank.
pub(crate) fn peer(
    n: usize,
    rank: usize,
    peer: usize,
    what: &str,
    allow_self: bool,
) -> Result<(), String> {
    if peer >= n || (!allow_self && peer == rank) {
        return Err(format!("{what} {peer} (group size {n}, own rank {rank})"));
    }
    Ok(())
}
