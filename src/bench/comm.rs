//! `flashover bench comm`: every collective at sizes from 4 KiB to 256 MiB, with algorithm and
//! bus bandwidth by nccl-tests' conventions, next to single-thread memcpy measured in the same run.

use burn::tensor::{Device, Tensor};
use flashover_comm::{
    Communicator, CommunicatorExt, FlightRecorder, Group, OpKind, ReduceOp, ThreadWorld,
    bus_bandwidth_factor,
};
use flashover_runtime::TensorCollectives;
use serde::Serialize;
use std::time::{Duration, Instant};

/// The operations `bench comm` measures.
pub const OPS: [OpKind; 5] = [
    OpKind::AllReduce,
    OpKind::ReduceScatter,
    OpKind::AllGather,
    OpKind::Broadcast,
    OpKind::AllToAll,
];

/// What to measure.
#[derive(Debug, Clone)]
pub struct CommBenchConfig {
    /// World sizes.
    pub worlds: Vec<usize>,
    /// Operations.
    pub ops: Vec<OpKind>,
    /// Smallest message in bytes (nccl-tests "size": the larger per-rank buffer).
    pub min_bytes: usize,
    /// Largest message in bytes; sizes step by 4x.
    pub max_bytes: usize,
    /// Wall time to aim for per measurement.
    pub target: Duration,
    /// Also time each thread-engine measurement with the flight recorder on.
    pub flight: bool,
    /// Also time each thread-engine measurement on Flex tensors ([`TensorCollectives`]).
    pub tensors: bool,
}

impl Default for CommBenchConfig {
    fn default() -> Self {
        CommBenchConfig {
            worlds: vec![2, 4],
            ops: OPS.to_vec(),
            min_bytes: 4 << 10,
            max_bytes: 256 << 20,
            target: Duration::from_millis(200),
            flight: false,
            tensors: false,
        }
    }
}

/// One measurement, serialised as one JSON line.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum Record {
    /// A collective.
    Collective {
        /// Operation name (`all_reduce`, ...).
        op: &'static str,
        /// Engine (`thread` or `mpi`).
        backend: &'static str,
        /// Number of ranks.
        world: usize,
        /// Message size in bytes.
        bytes: usize,
        /// Seconds per call (slowest rank).
        time_s: f64,
        /// `bytes / time_s` in GB/s (1e9).
        algbw_gbps: f64,
        /// Algorithm bandwidth times the op's bus factor.
        busbw_gbps: f64,
    },
    /// The physical reference: one thread copying `bytes`.
    Memcpy {
        /// Always `memcpy`.
        op: &'static str,
        /// Bytes copied.
        bytes: usize,
        /// GB/s.
        gbps: f64,
    },
}

/// Message sizes from `min` to `max` bytes, stepping by 4x.
pub fn sizes(min: usize, max: usize) -> Vec<usize> {
    let mut out = vec![];
    let mut s = min.max(4);
    while s <= max {
        out.push(s);
        s *= 4;
    }
    out
}

/// Iterations that fill roughly `target` given one call took `once`.
fn iterations(once: Duration, target: Duration) -> usize {
    let once = once.as_secs_f64().max(1e-7);
    ((target.as_secs_f64() / once) as usize).clamp(2, 2000)
}

/// Single-thread memcpy bandwidth for `bytes`, in GB/s.
pub fn memcpy_gbps(bytes: usize, target: Duration) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let t = Instant::now();
    dst.copy_from_slice(&src);
    let iters = iterations(t.elapsed(), target);
    let t = Instant::now();
    for _ in 0..iters {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    bytes as f64 * iters as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// How the thread engine's calls are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// On reused `f32` buffers (nccl-tests' way).
    Raw,
    /// On reused buffers, each call seen by a flight recorder.
    Flight,
    /// On Flex tensors through [`TensorCollectives`], handed over by value.
    Tensor,
    /// The same, on tensors another value still holds (a parameter the model keeps, a
    /// gradient a bucket still holds): the call may not reuse their buffers.
    SharedTensor,
}

impl Variant {
    fn backend(self) -> &'static str {
        match self {
            Variant::Raw => "thread",
            Variant::Flight => "thread+flight",
            Variant::Tensor => "thread+tensor",
            Variant::SharedTensor => "thread+shared-tensor",
        }
    }
}

/// Runs `op` on a message of `bytes` on `world` thread ranks; returns seconds per call.
#[cfg(test)]
pub fn time_collective(op: OpKind, world: usize, bytes: usize, target: Duration) -> f64 {
    time_thread_collective(op, world, bytes, target, Variant::Raw)
}

/// [`time_collective`], made the `variant` way.
fn time_thread_collective(
    op: OpKind,
    world: usize,
    bytes: usize,
    target: Duration,
    variant: Variant,
) -> f64 {
    let times: Vec<f64> = std::thread::scope(|s| {
        let handles: Vec<_> = ThreadWorld::new(world)
            .build()
            .into_iter()
            .enumerate()
            .map(|(rank, c)| {
                s.spawn(move || {
                    let mut group = Group::new(std::sync::Arc::new(c));
                    if variant == Variant::Flight {
                        group = group.recorded(FlightRecorder::new(rank, 256));
                    }
                    match variant {
                        Variant::Tensor | Variant::SharedTensor => {
                            let shared = variant == Variant::SharedTensor;
                            let device = Device::flex();
                            time_tensor_on_rank(&*group, op, bytes, target, &device, shared)
                        }
                        _ => time_on_rank(&*group, op, bytes, target),
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("bench rank"))
            .collect()
    });
    times.into_iter().fold(0.0, f64::max)
}

fn time_on_rank(c: &dyn Communicator, op: OpKind, bytes: usize, target: Duration) -> f64 {
    let n = c.size();
    let elems = bytes / 4;
    // Buffers sized by nccl-tests' conventions: `bytes` is the larger per-rank buffer.
    let (send_len, recv_len) = match op {
        OpKind::ReduceScatter => (elems / n * n, elems / n),
        OpKind::AllGather => (elems / n, elems / n * n),
        OpKind::AllToAll => (elems / n * n, elems / n * n),
        _ => (elems, elems),
    };
    let mut send = vec![1.0f32; send_len];
    let mut recv = vec![0.0f32; recv_len];
    let counts = vec![send_len / n; n];
    let mut call = || match op {
        OpKind::AllReduce => c.all_reduce(&mut send, ReduceOp::Sum),
        OpKind::ReduceScatter => c.reduce_scatter(&send, &mut recv, ReduceOp::Sum),
        OpKind::AllGather => c.all_gather(&send, &mut recv),
        OpKind::Broadcast => c.broadcast(&mut send, 0),
        OpKind::AllToAll => c.all_to_all_v(&send, &counts, &mut recv, &counts),
        other => unreachable!("{other} is not benchmarked"),
    };
    // Warm-up, then agree on an iteration count (rank 0's estimate) so every rank calls alike.
    let t = Instant::now();
    call().expect("warm-up");
    let mut iters = [iterations(t.elapsed(), target) as u64];
    c.broadcast(&mut iters, 0).expect("agree on iterations");
    c.barrier().expect("start barrier");
    let t = Instant::now();
    for _ in 0..iters[0] {
        call().expect("collective");
    }
    c.barrier().expect("end barrier");
    t.elapsed().as_secs_f64() / iters[0] as f64
}

/// [`time_on_rank`] through [`TensorCollectives`] on tensors of `device`, as a strategy calls
/// them: each call is handed a fresh tensor (as a gradient or shard is handed over; made, and
/// the result dropped, outside the timed region, with a barrier between) and returns a new one,
/// its device synchronised before the clock stops. All-to-all moves equal blocks of rows, as
/// the raw bench's equal counts do. `shared`: a clone of each input is kept until the call
/// returns (another value still holds the tensor).
fn time_tensor_on_rank(
    c: &dyn Communicator,
    op: OpKind,
    bytes: usize,
    target: Duration,
    device: &Device,
    shared: bool,
) -> f64 {
    let n = c.size();
    let elems = bytes / 4;
    let send_len = match op {
        OpKind::ReduceScatter => elems / n * n,
        OpKind::AllGather => elems / n,
        OpKind::AllToAll => elems / n * n,
        _ => elems,
    };
    let blocks = vec![send_len / n; n];
    let timed = |iters: u64| -> f64 {
        let mut total = 0.0;
        for _ in 0..iters {
            let input = Tensor::<1>::ones([send_len], device);
            let held = shared.then(|| input.clone());
            device.sync().expect("device");
            c.barrier().expect("barrier");
            let t = Instant::now();
            let out = match op {
                OpKind::AllReduce => c.all_reduce_tensor(input, ReduceOp::Sum),
                OpKind::ReduceScatter => c.reduce_scatter_tensor(input, 0, ReduceOp::Sum),
                OpKind::AllGather => c.all_gather_tensor(input, 0),
                OpKind::Broadcast => c.broadcast_tensor(input, 0),
                OpKind::AllToAll => c.all_to_all_tensor(input, &blocks, &blocks),
                other => unreachable!("{other} has no tensor form"),
            }
            .expect("collective");
            device.sync().expect("device");
            total += t.elapsed().as_secs_f64();
            drop((out, held));
        }
        total
    };
    // Warm-up, then agree on an iteration count (rank 0's estimate) so every rank calls alike.
    let once = timed(1);
    let mut iters = [iterations(Duration::from_secs_f64(once), target) as u64];
    c.broadcast(&mut iters, 0).expect("agree on iterations");
    // The slowest rank's time is the call's time.
    let mut per_call = [timed(iters[0]) / iters[0] as f64];
    c.all_reduce(&mut per_call, ReduceOp::Max)
        .expect("slowest rank");
    per_call[0]
}

/// The benchmark on the MPI engine, one rank per process (run under `mpirun`): the world is
/// MPI's; only world rank 0 emits. Each figure is the slowest rank's time.
#[cfg(feature = "mpi")]
pub fn run_mpi(config: &CommBenchConfig, mut emit: impl FnMut(&Record)) -> Result<(), String> {
    let env = flashover_comm::MpiWorld::init().map_err(|e| e.to_string())?;
    let world = env.group(Duration::from_secs(600));
    let n = world.size();
    let leader = world.rank() == 0;
    for bytes in sizes(config.min_bytes, config.max_bytes) {
        if leader {
            emit(&Record::Memcpy {
                op: "memcpy",
                bytes,
                gbps: memcpy_gbps(bytes, config.target),
            });
        }
    }
    for &op in &config.ops {
        for bytes in sizes(config.min_bytes, config.max_bytes) {
            let mut time_s = [time_on_rank(&*world, op, bytes, config.target)];
            world
                .all_reduce(&mut time_s, ReduceOp::Max)
                .map_err(|e| e.to_string())?;
            let algbw = bytes as f64 / time_s[0] / 1e9;
            if leader {
                emit(&Record::Collective {
                    op: op.name(),
                    backend: "mpi",
                    world: n,
                    bytes,
                    time_s: time_s[0],
                    algbw_gbps: algbw,
                    busbw_gbps: algbw * bus_bandwidth_factor(op, n),
                });
            }
        }
    }
    Ok(())
}

/// The benchmark on the NCCL engine over `world` (one rank per process, each on its GPU
/// `device`; only rank 0 emits; each figure the slowest rank's time): byte-level calls on host
/// buffers, which the engine copies through its GPU (backend `nccl`), and with `tensors`, Burn
/// CUDA tensors through [`TensorCollectives`], which hands their device buffers to NCCL
/// (`nccl+tensor`). At world size 1 the thread engine follows on the same CUDA tensors
/// (`thread+tensor`: staged through host memory, as every engine but NCCL does), so the cost of
/// staging is measured side by side.
#[cfg(all(feature = "nccl", feature = "cuda"))]
pub fn run_nccl(
    config: &CommBenchConfig,
    world: &dyn Communicator,
    device: &Device,
    mut emit: impl FnMut(&Record),
) -> Result<(), String> {
    let n = world.size();
    let leader = world.rank() == 0;
    let slowest = |time_s: f64| -> Result<f64, String> {
        let mut t = [time_s];
        world
            .all_reduce(&mut t, ReduceOp::Max)
            .map_err(|e| e.to_string())?;
        Ok(t[0])
    };
    let staged = (n == 1 && config.tensors).then(|| {
        Group::new(std::sync::Arc::new(
            ThreadWorld::new(1).build().pop().expect("a world of one"),
        ))
    });
    for &op in &config.ops {
        for bytes in sizes(config.min_bytes, config.max_bytes) {
            let mut timed = vec![(
                "nccl",
                slowest(time_on_rank(world, op, bytes, config.target))?,
            )];
            if config.tensors {
                let on_device = time_tensor_on_rank(world, op, bytes, config.target, device, false);
                timed.push(("nccl+tensor", slowest(on_device)?));
            }
            if let Some(staged) = &staged {
                let through_host =
                    time_tensor_on_rank(&**staged, op, bytes, config.target, device, false);
                timed.push(("thread+tensor", through_host));
            }
            for (backend, time_s) in timed {
                let algbw = bytes as f64 / time_s / 1e9;
                if leader {
                    emit(&Record::Collective {
                        op: op.name(),
                        backend,
                        world: n,
                        bytes,
                        time_s,
                        algbw_gbps: algbw,
                        busbw_gbps: algbw * bus_bandwidth_factor(op, n),
                    });
                }
            }
        }
    }
    Ok(())
}

/// Runs the whole benchmark, calling `emit` after each measurement.
pub fn run(config: &CommBenchConfig, mut emit: impl FnMut(&Record)) {
    for bytes in sizes(config.min_bytes, config.max_bytes) {
        emit(&Record::Memcpy {
            op: "memcpy",
            bytes,
            gbps: memcpy_gbps(bytes, config.target),
        });
    }
    for &world in &config.worlds {
        for &op in &config.ops {
            for bytes in sizes(config.min_bytes, config.max_bytes) {
                let mut variants = vec![Variant::Raw];
                if config.flight {
                    variants.push(Variant::Flight);
                }
                if config.tensors {
                    variants.extend([Variant::Tensor, Variant::SharedTensor]);
                }
                for variant in variants {
                    let time_s = time_thread_collective(op, world, bytes, config.target, variant);
                    let algbw = bytes as f64 / time_s / 1e9;
                    emit(&Record::Collective {
                        op: op.name(),
                        backend: variant.backend(),
                        world,
                        bytes,
                        time_s,
                        algbw_gbps: algbw,
                        busbw_gbps: algbw * bus_bandwidth_factor(op, world),
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_step_by_four_from_4k_to_256m() {
        let s = sizes(4 << 10, 256 << 20);
        assert_eq!(s.first(), Some(&4096));
        assert_eq!(s.last(), Some(&(256 << 20)));
        assert_eq!(s.len(), 9);
    }

    #[test]
    fn every_op_runs_at_a_small_size() {
        for op in OPS {
            let t = time_collective(op, 3, 48 << 10, Duration::from_millis(5));
            assert!(t > 0.0 && t.is_finite(), "{op}: {t}");
            for variant in [Variant::Tensor, Variant::SharedTensor] {
                let t = time_thread_collective(op, 3, 48 << 10, Duration::from_millis(5), variant);
                assert!(t > 0.0 && t.is_finite(), "{op} on {variant:?}: {t}");
            }
        }
    }
}
