//! Every collective of the NCCL engine (and a batch of a send and a receive) on CUDA device
//! memory, world size 1 (one GPU); then, on a machine with several GPUs, every operation at
//! world size = the number of GPUs, one rank thread per GPU, against the sequential reference
//! (`flashover_comm::conformance`). For the GPU machine (`scripts/gpu_check.sh`). Exits non-zero
//! on the first wrong result.

use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut};
use flashover_comm::conformance::{Match, exercise_world};
use flashover_comm::{
    BlobExchange, CommunicatorExt, DType, DeviceTransfer, Group, NcclWorld, ReduceOp, Transfer,
};
use std::time::Duration;

fn main() {
    if let Err(e) = NcclWorld::available() {
        eprintln!("nccl_check: {e}");
        std::process::exit(2);
    }
    let g = NcclWorld::group(0, 1, 0, Duration::from_secs(60), |id| Ok(vec![id.to_vec()]))
        .expect("NCCL world of one");
    let x: Vec<f32> = (0..1001).map(|i| i as f32 * 0.5).collect();
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
        let mut y = x.clone();
        g.all_reduce(&mut y, op).unwrap();
        assert_eq!(y, x, "all_reduce {op:?} over one rank is the identity");
    }
    let mut r = vec![0f32; 1001];
    g.reduce_scatter(&x, &mut r, ReduceOp::Sum).unwrap();
    assert_eq!(r, x, "reduce_scatter");
    assert_eq!(g.all_gather_vec(&x).unwrap(), x, "all_gather");
    let mut b = x.clone();
    g.broadcast(&mut b, 0).unwrap();
    assert_eq!(b, x, "broadcast");
    let mut a = vec![0f32; 1001];
    g.all_to_all_v(&x, &[1001], &mut a, &[1001]).unwrap();
    assert_eq!(a, x, "all_to_all_v");
    let mut ints: Vec<i64> = (0..64).collect();
    g.all_reduce(&mut ints, ReduceOp::Sum).unwrap();
    assert_eq!(ints, (0..64).collect::<Vec<i64>>(), "i64 all_reduce");
    let mut halves: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let expected = halves.clone();
    g.all_reduce(&mut halves, ReduceOp::Sum).unwrap();
    assert_eq!(halves, expected, "bf16 all_reduce");
    // Send and receive to oneself: NCCL completes them only as one group, as a batch runs.
    let mut back = vec![0u8; 4 * 1001];
    let sent: &[u8] = bytemuck::cast_slice(&x);
    g.exchange_bytes(&mut [
        Transfer::Send {
            buf: sent,
            dtype: DType::F32,
            dst: 0,
        },
        Transfer::Recv {
            buf: &mut back,
            dtype: DType::F32,
            src: 0,
        },
    ])
    .unwrap();
    assert_eq!(back, sent, "exchange_bytes with oneself");
    device_memory_in_place(&g, &x);
    g.barrier().unwrap();
    println!("nccl_check: every collective correct on one GPU (world size 1)");
    let gpus = CudaContext::device_count().unwrap_or(1).max(1) as usize;
    if gpus >= 2 {
        every_gpu(gpus);
    } else {
        println!("nccl_check: one GPU: the check at world size > 1 needs two or more");
    }
}

/// [`exercise_world`] at world size `n`, one rank thread per GPU: every collective against the
/// sequential reference (to f32 rounding: NCCL reduces in an order of its own), on the world
/// and on its even and odd ranks.
fn every_gpu(n: usize) {
    let blobs = BlobExchange::new(n);
    let timeout = Duration::from_secs(120);
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..n)
            .map(|rank| {
                let blobs = &blobs;
                s.spawn(move || {
                    let exchange = |mine: &[u8]| blobs.all_gather(rank, Ok(mine), timeout);
                    let world = NcclWorld::group(rank, n, rank, timeout, exchange)
                        .map_err(|e| format!("rank {rank} joining: {e}"))?;
                    exercise_world(&world, Match::Within(1e-5))
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, result) in results.into_iter().enumerate() {
        if let Err(e) = result {
            eprintln!("nccl_check: rank {rank} at world size {n}: {e}");
            std::process::exit(1);
        }
    }
    println!("nccl_check: every collective correct at world size {n}, one rank per GPU");
}

/// The device-pointer path Burn's CUDA tensors take: memory the engine does not own (here
/// allocated by cudarc directly), reduced and broadcast in place.
fn device_memory_in_place(g: &Group, x: &[f32]) {
    let device = g
        .device_collectives()
        .expect("the NCCL engine has device collectives");
    let ctx = CudaContext::new(device.device_ordinal()).expect("CUDA context");
    let stream = ctx.default_stream();
    let mut buf = stream.clone_htod(x).expect("upload");
    stream.synchronize().expect("upload done");
    {
        let (ptr, _written) = buf.device_ptr_mut(&stream);
        // SAFETY: `buf` holds `x.len()` f32 on this GPU, its upload is complete, and nothing
        // else touches it until the calls return.
        unsafe {
            device
                .all_reduce_device(ptr, x.len(), DType::F32, ReduceOp::Sum)
                .unwrap();
            device
                .broadcast_device(ptr, x.len(), DType::F32, 0)
                .unwrap();
        }
    }
    let back = stream.clone_dtoh(&buf).expect("download");
    assert_eq!(
        back, x,
        "in-place device all_reduce and broadcast over one rank"
    );
    // The out-of-place operations, into memory the check allocated itself (so its address is
    // certainly right): at world size 1 each one copies `x` into `out`.
    let n = x.len();
    let rows = [n];
    type Op<'a> = (
        &'a str,
        Box<dyn Fn(u64, u64) -> flashover_comm::CommResult<()> + 'a>,
    );
    let ops: [Op; 4] = [
        (
            "all_gather_device",
            // SAFETY (all four): `send` and `out` hold `n` f32 each on this GPU, written
            // and synchronised before the call, untouched until it returns.
            Box::new(|s, o| unsafe { device.all_gather_device(s, o, n, DType::F32) }),
        ),
        (
            "reduce_scatter_device",
            Box::new(|s, o| unsafe {
                device.reduce_scatter_device(s, o, n, DType::F32, ReduceOp::Sum)
            }),
        ),
        (
            "all_to_all_v_device",
            Box::new(|s, o| unsafe { device.all_to_all_v_device(s, &rows, o, &rows, DType::F32) }),
        ),
        (
            "exchange_device",
            Box::new(|s, o| unsafe {
                let to_self = |ptr, send| DeviceTransfer {
                    ptr,
                    count: n,
                    dtype: DType::F32,
                    peer: 0,
                    send,
                };
                device.exchange_device(&[to_self(s, true), to_self(o, false)])
            }),
        ),
    ];
    for (what, op) in ops {
        let send = stream.clone_htod(x).expect("upload");
        let mut out = stream.alloc_zeros::<f32>(n).expect("alloc");
        stream.synchronize().expect("upload done");
        {
            let (s, _read) = send.device_ptr(&stream);
            let (o, _written) = out.device_ptr_mut(&stream);
            op(s, o).unwrap();
        }
        assert_eq!(stream.clone_dtoh(&out).expect("download"), x, "{what}");
    }
}
