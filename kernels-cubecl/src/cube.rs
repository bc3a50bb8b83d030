//! The CubeCL kernels and their launches on Burn's CubeCL tensors (f32, made contiguous).

use crate::adamw::AdamWScalars;
use crate::bucket::PACK_GROUP;
use burn::backend::TensorMetadata;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

const UNITS: usize = 256;

/// Online-softmax merge: one unit per output element.
// Kernel code: the cube macro translates `%`, not `is_multiple_of`.
#[allow(clippy::manual_is_multiple_of)]
#[cube(launch)]
fn merge_kernel(
    out_a: &[f32],
    lse_a: &[f32],
    out_b: &[f32],
    lse_b: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    width: u32,
) {
    let pos = ABSOLUTE_POS;
    if pos < out.len() {
        let w = width as usize;
        let row = pos / w;
        let a = lse_a[row];
        let b = lse_b[row];
        let mut m = a;
        if b > a {
            m = b;
        }
        let wa = (a - m).exp();
        let wb = (b - m).exp();
        let s = wa + wb;
        out[pos] = out_a[pos] * (wa / s) + out_b[pos] * (wb / s);
        if pos % w == 0 {
            lse[row] = m + s.ln();
        }
    }
}

/// AdamW: one unit per element; the scalars are `[b1, b2, f1, f2, c1, c2, eps, decay, lr]`.
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn adamw_kernel(
    params: &[f32],
    grads: &[f32],
    moment_1: &[f32],
    moment_2: &[f32],
    scalars: &[f32],
    new_params: &mut [f32],
    new_moment_1: &mut [f32],
    new_moment_2: &mut [f32],
    decays: u32,
) {
    let i = ABSOLUTE_POS;
    if i < params.len() {
        let g = grads[i];
        let m = moment_1[i] * scalars[0] + g * scalars[2];
        let v = moment_2[i] * scalars[1] + (g * g) * scalars[3];
        new_moment_1[i] = m;
        new_moment_2[i] = v;
        let delta = (m / scalars[4]) / ((v / scalars[5]).sqrt() + scalars[6]);
        let mut x = params[i];
        if decays == 1 {
            x *= scalars[7];
        }
        new_params[i] = x - delta * scalars[8];
    }
}

/// Cross-entropy pieces: one unit per row, two passes over its `width` logits.
#[cube(launch)]
fn cross_entropy_kernel(
    logits: &[f32],
    targets: &[f32],
    max_out: &mut [f32],
    sum_out: &mut [f32],
    target_out: &mut [f32],
    width: u32,
) {
    let row = ABSOLUTE_POS;
    if row < max_out.len() {
        let w = width as usize;
        let start = row * w;
        let mut m = logits[start];
        for j in 1..w {
            let x = logits[start + j];
            if x > m {
                m = x;
            }
        }
        let mut s = 0.0f32;
        for j in 0..w {
            s += (logits[start + j] - m).exp();
        }
        max_out[row] = m;
        sum_out[row] = s;
        let t = targets[row];
        let mut picked = 0.0f32;
        if t >= 0.0 {
            picked = logits[start + t as usize];
        }
        target_out[row] = picked;
    }
}

/// Row gather: one unit per output element.
#[cube(launch)]
fn permute_kernel(tokens: &[f32], order: &[f32], out: &mut [f32], width: u32) {
    let pos = ABSOLUTE_POS;
    if pos < out.len() {
        let w = width as usize;
        let source = order[pos / w] as usize;
        out[pos] = tokens[source * w + pos % w];
    }
}

/// Weighted gather back: one unit per output element, `k` choices each.
#[cube(launch)]
fn unpermute_kernel(
    outputs: &[f32],
    positions: &[f32],
    weights: &[f32],
    out: &mut [f32],
    width: u32,
    k: u32,
) {
    let pos = ABSOLUTE_POS;
    if pos < out.len() {
        let w = width as usize;
        let kk = k as usize;
        let token = pos / w;
        let col = pos % w;
        let mut acc = 0.0f32;
        for j in 0..kk {
            let p = positions[token * kk + j];
            if p >= 0.0 {
                acc += weights[token * kk + j] * outputs[(p as usize) * w + col];
            }
        }
        out[pos] = acc;
    }
}

pub(crate) fn f32_contiguous(t: CubeTensor, what: &str) -> CubeTensor {
    assert_eq!(
        t.dtype,
        DType::F32,
        "flashover-kernels: {what} must be f32 (got {:?})",
        t.dtype
    );
    into_contiguous(t)
}

pub(crate) fn buffer(t: &CubeTensor) -> BufferArg {
    let len = t.shape().num_elements();
    // SAFETY: the handle is a contiguous f32 buffer of `len` elements (f32_contiguous).
    unsafe { BufferArg::from_raw_parts(t.handle.clone(), len) }
}

pub(crate) fn empty(like: &CubeTensor, shape: Shape) -> CubeTensor {
    let bytes = shape.num_elements() * std::mem::size_of::<f32>();
    let handle = like.client.empty(bytes.max(4));
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        shape,
        handle,
        DType::F32,
    )
}

/// Enough cubes of `UNITS` for `n` units, spread over the grid's dimensions (one dimension
/// holds at most 65535 cubes on wgpu).
fn cubes(client: &Client, n: usize) -> CubeCount {
    cubecl::calculate_cube_count_elemwise(client, n.max(1), CubeDim::new_1d(UNITS as u32))
}

pub(crate) fn merge_partials(
    out_a: CubeTensor,
    lse_a: CubeTensor,
    out_b: CubeTensor,
    lse_b: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let (out_a, out_b) = (
        f32_contiguous(out_a, "out_a"),
        f32_contiguous(out_b, "out_b"),
    );
    let (lse_a, lse_b) = (
        f32_contiguous(lse_a, "lse_a"),
        f32_contiguous(lse_b, "lse_b"),
    );
    let shape = out_a.shape();
    let (rows, width) = (shape[0], shape[1]);
    let out = empty(&out_a, shape.clone());
    let lse = empty(&out_a, Shape::new([rows]));
    merge_kernel::launch(
        &out_a.client,
        cubes(&out_a.client, rows * width),
        CubeDim::new_1d(UNITS as u32),
        buffer(&out_a),
        buffer(&lse_a),
        buffer(&out_b),
        buffer(&lse_b),
        buffer(&out),
        buffer(&lse),
        width as u32,
    );
    (out, lse)
}

pub(crate) fn adamw_step(
    params: CubeTensor,
    grads: CubeTensor,
    moment_1: CubeTensor,
    moment_2: CubeTensor,
    s: AdamWScalars,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let params = f32_contiguous(params, "params");
    let moment_1 = f32_contiguous(moment_1, "moment_1");
    let moment_2 = f32_contiguous(moment_2, "moment_2");
    let grads = f32_contiguous(grads, "grads");
    let shape = params.shape();
    let outputs = [0, 1, 2].map(|_| empty(&params, shape.clone()));
    let [f1, f2, c1, c2, decay] = s.derived();
    let values = [s.beta_1, s.beta_2, f1, f2, c1, c2, s.epsilon, decay, s.lr];
    let scalars = params.client.create_from_slice(f32::as_bytes(&values));
    let n = params.shape().num_elements();
    adamw_kernel::launch(
        &params.client,
        cubes(&params.client, n),
        CubeDim::new_1d(UNITS as u32),
        buffer(&params),
        buffer(&grads),
        buffer(&moment_1),
        buffer(&moment_2),
        // SAFETY: nine f32 values just written.
        unsafe { BufferArg::from_raw_parts(scalars, values.len()) },
        buffer(&outputs[0]),
        buffer(&outputs[1]),
        buffer(&outputs[2]),
        (s.lr as f64 * s.weight_decay as f64 != 0.0) as u32,
    );
    crate::adamw::count_launch();
    let [p, m, v] = outputs;
    (p, m, v)
}

pub(crate) fn cross_entropy_pieces(
    logits: CubeTensor,
    targets: CubeTensor,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let logits = f32_contiguous(logits, "logits");
    let targets = f32_contiguous(targets, "targets");
    let shape = logits.shape();
    let (rows, width) = (shape[0], shape[1]);
    let max = empty(&logits, Shape::new([rows]));
    let sum = empty(&logits, Shape::new([rows]));
    let target = empty(&logits, Shape::new([rows]));
    cross_entropy_kernel::launch(
        &logits.client,
        cubes(&logits.client, rows),
        CubeDim::new_1d(UNITS as u32),
        buffer(&logits),
        buffer(&targets),
        buffer(&max),
        buffer(&sum),
        buffer(&target),
        width as u32,
    );
    (max, sum, target)
}

pub(crate) fn permute_rows(tokens: CubeTensor, order: CubeTensor) -> CubeTensor {
    let tokens = f32_contiguous(tokens, "tokens");
    let order = f32_contiguous(order, "order");
    let (n, width) = (order.shape()[0], tokens.shape()[1]);
    let out = empty(&tokens, Shape::new([n, width]));
    permute_kernel::launch(
        &tokens.client,
        cubes(&tokens.client, n * width),
        CubeDim::new_1d(UNITS as u32),
        buffer(&tokens),
        buffer(&order),
        buffer(&out),
        width as u32,
    );
    out
}

pub(crate) fn unpermute_rows(
    outputs: CubeTensor,
    positions: CubeTensor,
    weights: CubeTensor,
) -> CubeTensor {
    let outputs = f32_contiguous(outputs, "outputs");
    let positions = f32_contiguous(positions, "positions");
    let weights = f32_contiguous(weights, "weights");
    let (tokens, k) = (positions.shape()[0], positions.shape()[1]);
    let width = outputs.shape()[1];
    let out = empty(&outputs, Shape::new([tokens, width]));
    unpermute_kernel::launch(
        &outputs.client,
        cubes(&outputs.client, tokens * width),
        CubeDim::new_1d(UNITS as u32),
        buffer(&outputs),
        buffer(&positions),
        buffer(&weights),
        buffer(&out),
        width as u32,
        k as u32,
    );
    out
}

/// Bucket pack: up to four sources into `out[base..base + end_d]`, times `scale[0]`; segment
/// `k` covers `[end_{k-1}, end_k)` (unused sources are empty segments).
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn pack_kernel(
    a: &[f32],
    b: &[f32],
    c: &[f32],
    d: &[f32],
    scale: &[f32],
    out: &mut [f32],
    base: u32,
    end_a: u32,
    end_b: u32,
    end_c: u32,
    end_d: u32,
) {
    let i = ABSOLUTE_POS;
    let (ea, eb, ec, ed) = (
        end_a as usize,
        end_b as usize,
        end_c as usize,
        end_d as usize,
    );
    let o = base as usize + i;
    let s = scale[0];
    if i < ea {
        out[o] = a[i] * s;
    } else if i < eb {
        out[o] = b[i - ea] * s;
    } else if i < ec {
        out[o] = c[i - eb] * s;
    } else if i < ed {
        out[o] = d[i - ec] * s;
    }
}

/// Bucket unpack: `out[i] = flat[start + i] * scale[0]`.
#[cube(launch)]
fn unpack_kernel(flat: &[f32], scale: &[f32], out: &mut [f32], start: u32) {
    let i = ABSOLUTE_POS;
    if i < out.len() {
        out[i] = flat[start as usize + i] * scale[0];
    }
}

fn scale_buffer(like: &CubeTensor, scale: f32) -> BufferArg {
    let handle = like.client.create_from_slice(f32::as_bytes(&[scale]));
    // SAFETY: one f32 just written.
    unsafe { BufferArg::from_raw_parts(handle, 1) }
}

pub(crate) fn pack_scaled(parts: Vec<CubeTensor>, scale: f32) -> CubeTensor {
    let parts: Vec<CubeTensor> = parts
        .into_iter()
        .map(|p| f32_contiguous(p, "pack_scaled parts"))
        .collect();
    let lens: Vec<usize> = parts.iter().map(|p| p.shape().num_elements()).collect();
    let total: usize = lens.iter().sum();
    let out = empty(&parts[0], Shape::new([total]));
    let mut base = 0;
    for (group, group_lens) in parts.chunks(PACK_GROUP).zip(lens.chunks(PACK_GROUP)) {
        // Segment ends within the group; missing sources repeat the first with an empty range.
        let mut ends = [0usize; PACK_GROUP];
        let mut at = 0;
        for (k, end) in ends.iter_mut().enumerate() {
            at += group_lens.get(k).copied().unwrap_or(0);
            *end = at;
        }
        let source = |k: usize| buffer(group.get(k).unwrap_or(&group[0]));
        pack_kernel::launch(
            &out.client,
            cubes(&out.client, at),
            CubeDim::new_1d(UNITS as u32),
            source(0),
            source(1),
            source(2),
            source(3),
            scale_buffer(&out, scale),
            buffer(&out),
            base as u32,
            ends[0] as u32,
            ends[1] as u32,
            ends[2] as u32,
            ends[3] as u32,
        );
        crate::bucket::count_launches(1);
        base += at;
    }
    out
}

pub(crate) fn unpack_scaled(flat: CubeTensor, lens: &[usize], scale: f32) -> Vec<CubeTensor> {
    let flat = f32_contiguous(flat, "unpack_scaled flat");
    let mut start = 0;
    lens.iter()
        .map(|&len| {
            let out = empty(&flat, Shape::new([len]));
            unpack_kernel::launch(
                &flat.client,
                cubes(&flat.client, len),
                CubeDim::new_1d(UNITS as u32),
                buffer(&flat),
                scale_buffer(&flat, scale),
                buffer(&out),
                start as u32,
            );
            crate::bucket::count_launches(1);
            start += len;
            out
        })
        .collect()
}
