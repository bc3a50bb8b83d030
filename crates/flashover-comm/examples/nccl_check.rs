//! Every collective of the NCCL engine on CUDA device memory, world size 1 (one GPU): for the
//! GPU machine (`scripts/gpu_check.sh`). Exits non-zero on the first wrong result.

use flashover_comm::{CommunicatorExt, NcclWorld, ReduceOp};
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
    g.barrier().unwrap();
    println!("nccl_check: every collective correct on one GPU (world size 1)");
}
