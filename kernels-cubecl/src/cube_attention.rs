//! The attention kernels (see `crate::attention`): one unit per query row (forward, query
//! gradients) or key row (key and value gradients), a cube of [`ROWS`] rows per head, and the
//! other side streamed through shared memory a tile of rows at a time.

use crate::cube::{buffer, empty, f32_contiguous};
use burn::backend::TensorMetadata;
use burn::tensor::Shape;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Rows (queries or keys) a cube computes, one per unit.
const ROWS: usize = 64;
/// The most rows of the streamed side a tile holds.
const MAX_TILE: usize = 64;

/// Whether key `key` is visible to query `query` (`offset = n_k - n_q`).
#[cube]
fn visible(query: usize, key: usize, n_k: usize, offset: usize, causal: u32) -> bool {
    key < n_k && (causal == 0 || key <= query + offset)
}

/// Copies rows `start..start + tile` of `src`'s head `head` (`n` rows of `d`) into `dst`,
/// zeros past the end; every unit of the cube takes part.
#[cube]
fn load_tile(
    src: &[f32],
    dst: &mut Shared<[f32]>,
    head: usize,
    start: usize,
    n: usize,
    #[comptime] d: usize,
    #[comptime] tile: usize,
) {
    let units = CUBE_DIM_X as usize;
    let mut i = UNIT_POS_X as usize;
    while i < comptime!(tile * d) {
        let row = start + i / d;
        let mut x = 0.0f32;
        if row < n {
            x = src[(head * n + row) * d + i % d];
        }
        dst[i] = x;
        i += units;
    }
}

/// `dst[i]` <- `src[base + start + i]` for the `tile` rows from `start`, zeros from row `n`
/// on; every unit of the cube takes part.
#[cube]
fn load_column(
    src: &[f32],
    dst: &mut Shared<[f32]>,
    base: usize,
    start: usize,
    n: usize,
    #[comptime] tile: usize,
) {
    let mut i = UNIT_POS_X as usize;
    while i < tile {
        let mut x = 0.0f32;
        if start + i < n {
            x = src[base + start + i];
        }
        dst[i] = x;
        i += CUBE_DIM_X as usize;
    }
}

/// `dst` <- row `row` of `src` (`d` values from `row * d`), or zeros for an inactive unit.
#[cube]
fn load_row(src: &[f32], row: usize, active: bool, dst: &mut Array<f32>, #[comptime] d: usize) {
    for c in 0..d {
        dst[c] = 0.0;
        if active {
            dst[c] = src[row * d + c];
        }
    }
}

/// `dst` <- `d` zeros.
#[cube]
fn zero_row(dst: &mut Array<f32>, #[comptime] d: usize) {
    for c in 0..d {
        dst[c] = 0.0;
    }
}

/// How many keys any query of this cube sees (from `first`, `CUBE_DIM_X` queries).
#[cube]
fn keys_seen(first: usize, nq: usize, nk: usize, offset: usize, causal: u32) -> usize {
    let mut keys = nk;
    if causal == 1 {
        let mut last = first + CUBE_DIM_X as usize;
        if last > nq {
            last = nq;
        }
        keys = last + offset;
    }
    keys
}

/// Forward: each unit keeps its query, the running maximum and denominator and the unnormalised
/// output in registers, and streams the keys and values through shared memory.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn forward_kernel(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    padding: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    n_q: u32,
    n_k: u32,
    scale: f32,
    causal: u32,
    heads_per_row: u32,
    pad_score: f32,
    #[comptime] d: usize,
    #[comptime] tile: usize,
) {
    let head = CUBE_POS_Y as usize;
    let (nq, nk) = (n_q as usize, n_k as usize);
    let offset = nk - nq;
    let pad_base = (head / heads_per_row as usize) * nk;
    let first = CUBE_POS_X as usize * CUBE_DIM_X as usize;
    let row = first + UNIT_POS_X as usize;
    let active = row < nq;
    let mut k_tile = Shared::<[f32]>::new_slice(comptime!(tile * d));
    let mut v_tile = Shared::<[f32]>::new_slice(comptime!(tile * d));
    let mut pad_tile = Shared::<[f32]>::new_slice(tile);
    let mut q_row = Array::<f32>::new(d);
    let mut acc = Array::<f32>::new(d);
    load_row(q, head * nq + row, active, &mut q_row, d);
    zero_row(&mut acc, d);
    let keys = keys_seen(first, nq, nk, offset, causal);
    // Minus infinity (WGSL has no infinite literals): below any scaled score.
    let mut m = f32::new(-1.0e30);
    let mut l = 0.0f32;
    let mut start = 0usize;
    while start < keys {
        load_tile(k, &mut k_tile, head, start, nk, d, tile);
        load_tile(v, &mut v_tile, head, start, nk, d, tile);
        load_column(padding, &mut pad_tile, pad_base, start, nk, tile);
        sync_cube();
        if active {
            for r in 0..tile {
                if visible(row, start + r, nk, offset, causal) {
                    let mut s = 0.0f32;
                    for c in 0..d {
                        s += q_row[c] * k_tile[r * d + c];
                    }
                    s *= scale;
                    if pad_tile[r] != 0.0 {
                        s = pad_score;
                    }
                    let mut m_new = m;
                    if s > m_new {
                        m_new = s;
                    }
                    let correction = (m - m_new).exp();
                    let p = (s - m_new).exp();
                    l = l * correction + p;
                    for c in 0..d {
                        acc[c] = acc[c] * correction + p * v_tile[r * d + c];
                    }
                    m = m_new;
                }
            }
        }
        sync_cube();
        start += tile;
    }
    if active {
        let base = (head * nq + row) * d;
        let mut norm = 0.0f32;
        let mut log_sum = f32::new(-1.0e30);
        if l > 0.0 {
            norm = 1.0 / l;
            log_sum = m + l.ln();
        }
        for c in 0..d {
            out[base + c] = acc[c] * norm;
        }
        lse[head * nq + row] = log_sum;
    }
}

/// Query gradients: each unit recomputes its row of probabilities from the log-sum-exp, a
/// tile of keys and values at a time, and sums `d_s k` over the keys in order.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn query_grad_kernel(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    lse: &[f32],
    delta: &[f32],
    d_out: &[f32],
    padding: &[f32],
    d_q: &mut [f32],
    n_q: u32,
    n_k: u32,
    scale: f32,
    causal: u32,
    heads_per_row: u32,
    #[comptime] d: usize,
    #[comptime] tile: usize,
) {
    let head = CUBE_POS_Y as usize;
    let (nq, nk) = (n_q as usize, n_k as usize);
    let offset = nk - nq;
    let pad_base = (head / heads_per_row as usize) * nk;
    let first = CUBE_POS_X as usize * CUBE_DIM_X as usize;
    let row = first + UNIT_POS_X as usize;
    let active = row < nq;
    let mut k_tile = Shared::<[f32]>::new_slice(comptime!(tile * d));
    let mut v_tile = Shared::<[f32]>::new_slice(comptime!(tile * d));
    let mut pad_tile = Shared::<[f32]>::new_slice(tile);
    let mut q_row = Array::<f32>::new(d);
    let mut do_row = Array::<f32>::new(d);
    let mut acc = Array::<f32>::new(d);
    load_row(q, head * nq + row, active, &mut q_row, d);
    load_row(d_out, head * nq + row, active, &mut do_row, d);
    zero_row(&mut acc, d);
    let mut row_lse = 0.0f32;
    let mut row_delta = 0.0f32;
    if active {
        row_lse = lse[head * nq + row];
        row_delta = delta[head * nq + row];
    }
    let keys = keys_seen(first, nq, nk, offset, causal);
    let mut start = 0usize;
    while start < keys {
        load_tile(k, &mut k_tile, head, start, nk, d, tile);
        load_tile(v, &mut v_tile, head, start, nk, d, tile);
        load_column(padding, &mut pad_tile, pad_base, start, nk, tile);
        sync_cube();
        if active {
            for r in 0..tile {
                // A padding key's score is a constant: it adds nothing to dq.
                if visible(row, start + r, nk, offset, causal) && pad_tile[r] == 0.0 {
                    let mut s = 0.0f32;
                    let mut dp = 0.0f32;
                    for c in 0..d {
                        s += q_row[c] * k_tile[r * d + c];
                        dp += do_row[c] * v_tile[r * d + c];
                    }
                    let p = (s * scale - row_lse).exp();
                    let ds = p * (dp - row_delta);
                    for c in 0..d {
                        acc[c] += ds * k_tile[r * d + c];
                    }
                }
            }
        }
        sync_cube();
        start += tile;
    }
    if active {
        for c in 0..d {
            d_q[(head * nq + row) * d + c] = acc[c] * scale;
        }
    }
}

/// Key and value gradients: each unit keeps its key and value rows and their gradients in
/// registers and streams the queries, their output gradients, log-sum-exps and deltas through
/// shared memory, summing over the queries in order.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn key_value_grad_kernel(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    lse: &[f32],
    delta: &[f32],
    d_out: &[f32],
    padding: &[f32],
    d_k: &mut [f32],
    d_v: &mut [f32],
    n_q: u32,
    n_k: u32,
    scale: f32,
    causal: u32,
    heads_per_row: u32,
    pad_score: f32,
    #[comptime] d: usize,
    #[comptime] tile: usize,
) {
    let head = CUBE_POS_Y as usize;
    let (nq, nk) = (n_q as usize, n_k as usize);
    let offset = nk - nq;
    let first = CUBE_POS_X as usize * CUBE_DIM_X as usize;
    let row = first + UNIT_POS_X as usize;
    let active = row < nk;
    let mut q_tile = Shared::<[f32]>::new_slice(comptime!(tile * d));
    let mut do_tile = Shared::<[f32]>::new_slice(comptime!(tile * d));
    let mut lse_tile = Shared::<[f32]>::new_slice(tile);
    let mut delta_tile = Shared::<[f32]>::new_slice(tile);
    let mut k_row = Array::<f32>::new(d);
    let mut v_row = Array::<f32>::new(d);
    let mut dk = Array::<f32>::new(d);
    let mut dv = Array::<f32>::new(d);
    load_row(k, head * nk + row, active, &mut k_row, d);
    load_row(v, head * nk + row, active, &mut v_row, d);
    zero_row(&mut dk, d);
    zero_row(&mut dv, d);
    let mut pad = 0.0f32;
    if active {
        pad = padding[(head / heads_per_row as usize) * nk + row];
    }
    // The first query that sees any key of this cube.
    let mut start = 0usize;
    if causal == 1 && first > offset {
        start = ((first - offset) / tile) * tile;
    }
    while start < nq {
        load_tile(q, &mut q_tile, head, start, nq, d, tile);
        load_tile(d_out, &mut do_tile, head, start, nq, d, tile);
        load_column(lse, &mut lse_tile, head * nq, start, nq, tile);
        load_column(delta, &mut delta_tile, head * nq, start, nq, tile);
        sync_cube();
        if active {
            for r in 0..tile {
                let query = start + r;
                if query < nq && visible(query, row, nk, offset, causal) {
                    let mut s = 0.0f32;
                    let mut dp = 0.0f32;
                    for c in 0..d {
                        s += q_tile[r * d + c] * k_row[c];
                        dp += do_tile[r * d + c] * v_row[c];
                    }
                    let mut score = s * scale;
                    if pad != 0.0 {
                        score = pad_score;
                    }
                    let p = (score - lse_tile[r]).exp();
                    let mut ds = p * (dp - delta_tile[r]);
                    if pad != 0.0 {
                        // A padding key's score is a constant: no gradient to k.
                        ds = 0.0;
                    }
                    for c in 0..d {
                        dv[c] += p * do_tile[r * d + c];
                        dk[c] += ds * q_tile[r * d + c];
                    }
                }
            }
        }
        sync_cube();
        start += tile;
    }
    if active {
        let base = (head * nk + row) * d;
        for c in 0..d {
            d_k[base + c] = dk[c] * scale;
            d_v[base + c] = dv[c];
        }
    }
}

/// The most rows of `width` f32 values (and `extra` more per row) that fit in the device's
/// shared memory `tensors` times, a power of two up to [`MAX_TILE`].
fn tile_rows(like: &CubeTensor, tensors: usize, width: usize, extra: usize) -> usize {
    let shared = like.client.properties().hardware.max_shared_memory_size;
    let per_row = (tensors * width + extra) * std::mem::size_of::<f32>();
    let fits = shared / per_row.max(1);
    assert!(
        fits >= 1,
        "flashover-kernels: attention rows of {width} values do not fit in {shared} bytes of \
         shared memory"
    );
    let mut tile = 1;
    while tile * 2 <= fits.min(MAX_TILE) {
        tile *= 2;
    }
    tile
}

/// Cubes of [`ROWS`] units: `rows` over x, `heads` over y.
fn grid(rows: usize, heads: usize) -> (CubeCount, CubeDim) {
    let x = rows.div_ceil(ROWS).max(1) as u32;
    (
        CubeCount::Static(x, heads.max(1) as u32, 1),
        CubeDim::new_1d(ROWS as u32),
    )
}

/// Which keys the queries see: causal or not, and the padding (`[rows, n_k]`, 1 where a key
/// is padding) whose keys score `pad_score`.
pub(crate) struct Mask {
    pub padding: CubeTensor,
    pub causal: bool,
    pub pad_score: f32,
}

impl Mask {
    /// The padding as f32, and how many heads (consecutive, from head 0) share one of its
    /// rows.
    fn padding_rows(self, heads: usize) -> (CubeTensor, u32) {
        let padding = f32_contiguous(self.padding, "attention's key padding");
        let rows = padding.shape()[0].max(1);
        (padding, (heads / rows).max(1) as u32)
    }
}

pub(crate) fn forward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    mask: Mask,
    scale: f32,
) -> (CubeTensor, CubeTensor) {
    let (q, k, v) = (
        f32_contiguous(q, "attention's q"),
        f32_contiguous(k, "attention's k"),
        f32_contiguous(v, "attention's v"),
    );
    let (heads, n_q, d, n_k) = (q.shape()[0], q.shape()[1], q.shape()[2], k.shape()[1]);
    let (causal, pad_score) = (mask.causal, mask.pad_score);
    let (padding, heads_per_row) = mask.padding_rows(heads);
    let out = empty(&q, q.shape());
    let lse = empty(&q, Shape::new([heads, n_q]));
    let tile = tile_rows(&q, 2, d, 1);
    let (count, dim) = grid(n_q, heads);
    forward_kernel::launch(
        &q.client,
        count,
        dim,
        buffer(&q),
        buffer(&k),
        buffer(&v),
        buffer(&padding),
        buffer(&out),
        buffer(&lse),
        n_q as u32,
        n_k as u32,
        scale,
        causal as u32,
        heads_per_row,
        pad_score,
        d,
        tile,
    );
    crate::attention::count_launch();
    (out, lse)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    lse: CubeTensor,
    delta: CubeTensor,
    d_out: CubeTensor,
    mask: Mask,
    scale: f32,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let (q, k, v) = (
        f32_contiguous(q, "attention's q"),
        f32_contiguous(k, "attention's k"),
        f32_contiguous(v, "attention's v"),
    );
    let (lse, delta, d_out) = (
        f32_contiguous(lse, "attention's lse"),
        f32_contiguous(delta, "attention's delta"),
        f32_contiguous(d_out, "attention's d_out"),
    );
    let (heads, n_q, d, n_k) = (q.shape()[0], q.shape()[1], q.shape()[2], k.shape()[1]);
    let (causal, pad_score) = (mask.causal, mask.pad_score);
    let (padding, heads_per_row) = mask.padding_rows(heads);
    let d_q = empty(&q, q.shape());
    let d_k = empty(&k, k.shape());
    let d_v = empty(&v, v.shape());
    let tile = tile_rows(&q, 2, d, 1);
    let (count, dim) = grid(n_q, heads);
    query_grad_kernel::launch(
        &q.client,
        count,
        dim,
        buffer(&q),
        buffer(&k),
        buffer(&v),
        buffer(&lse),
        buffer(&delta),
        buffer(&d_out),
        buffer(&padding),
        buffer(&d_q),
        n_q as u32,
        n_k as u32,
        scale,
        causal as u32,
        heads_per_row,
        d,
        tile,
    );
    let tile = tile_rows(&q, 2, d, 2);
    let (count, dim) = grid(n_k, heads);
    key_value_grad_kernel::launch(
        &q.client,
        count,
        dim,
        buffer(&q),
        buffer(&k),
        buffer(&v),
        buffer(&lse),
        buffer(&delta),
        buffer(&d_out),
        buffer(&padding),
        buffer(&d_k),
        buffer(&d_v),
        n_q as u32,
        n_k as u32,
        scale,
        causal as u32,
        heads_per_row,
        pad_score,
        d,
        tile,
    );
    crate::attention::count_launch();
    (d_q, d_k, d_v)
}
