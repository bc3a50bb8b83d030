//! Benchmarks behind `flashover bench`. Figures go to `docs/benchmarks.md` with the command that
//! produced them; ratios are measured side by side in one run because these machines are noisy.
//! Each runner returns records the `flashover bench` subcommands print as tables; the tests
//! below run each on a small job. They live in the binary, not the library: a user of the
//! library needs none of them.

pub mod attention;
pub mod calibrate;
pub mod checkpoint;
pub mod comm;
pub mod context;
pub mod kernels;
pub mod memory;
pub mod moe;
pub mod overlap;
pub mod pipeline;
pub mod recompute;
pub mod train;
pub mod units;
pub mod working_memory;

/// Samples per rank of a global batch of `batch` over `ranks` ranks, or why the command line's
/// `flag` (`--dps`, `--fsdps`) cannot split it.
fn share_of(flag: &str, ranks: usize, batch: usize) -> Result<usize, String> {
    if ranks == 0 || !batch.is_multiple_of(ranks) {
        return Err(format!(
            "{flag} {ranks}: the global batch of {batch} must split evenly over the ranks"
        ));
    }
    Ok(batch / ranks)
}

/// `ways` ways of running a step measured side by side: `rounds + 1` rounds of `steps` steps
/// of each way, the order rotated every round so that no way always follows another, the
/// first round a discarded warm-up. Per way, what `step(way)` measured.
fn alternate<M, E>(
    ways: usize,
    rounds: usize,
    steps: usize,
    mut step: impl FnMut(usize) -> Result<M, E>,
) -> Result<Vec<Vec<M>>, E> {
    let mut measured: Vec<Vec<M>> = (0..ways).map(|_| vec![]).collect();
    for round in 0..rounds + 1 {
        for k in 0..ways {
            let way = (round + k) % ways;
            for _ in 0..steps {
                let m = step(way)?;
                if round > 0 {
                    measured[way].push(m);
                }
            }
        }
    }
    Ok(measured)
}

/// The median of `values` (NaN when there are none).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_collective_and_calibration_measurements_run() {
        use crate::bench::{calibrate, comm, working_memory};
        use flashover::OpKind;
        use flashover::train::TrainConfig;
        use std::time::Duration;

        // Message sizes of `bench comm`, and one all-reduce of 4 KiB over two rank threads.
        assert_eq!(comm::sizes(4096, 65536), vec![4096, 16384, 65536]);
        assert!(comm::time_collective(OpKind::AllReduce, 2, 4096, Duration::from_millis(20)) > 0.0);
        assert!(comm::memcpy_gbps(1 << 16, Duration::from_millis(20)) > 0.0);
        // The matrix-product rate `bench plan` calibrates the planner with.
        assert!(calibrate::matmul_rate(32, 0.01) > 0.0);
        // Heap measurements need the counting allocator, which the `flashover` binary installs.
        let mut job = TrainConfig::default();
        job.run.steps = 2;
        let measured = working_memory::measure(&job);
        assert_eq!(measured.is_ok(), flashover::heap::counting());
    }

    #[test]
    fn every_benchmark_runs_on_a_small_job() {
        use crate::bench::{
            checkpoint, comm, context, memory, moe, overlap, pipeline, recompute, train, units,
        };
        use flashover::OpKind;
        use flashover::train::TrainConfig;
        use std::time::Duration;

        let mut job = TrainConfig::default();
        job.model.preset = "tiny".into();
        job.run.steps = 2;
        job.run.global_batch = 4;
        let zero3 = memory::run(&job, &[3], &[2]).unwrap();
        assert!(zero3[0].measured_state > 0);
        let throughput = train::run(&job, &[1], &[], &[], 1).unwrap();
        assert!(!throughput.is_empty());
        assert!(train::plain_burn_step_s(&job).unwrap() > 0.0);
        // Per read, then in units: one all-gather per block and one for the rest.
        let gathers = units::run(&job, &[2], 1, 1).unwrap();
        assert!(gathers[1].all_gathers < gathers[0].all_gathers);
        // A loop's buckets reduced after backward, then during it.
        let overlap = overlap::run(&job, &[2], 1, 1).unwrap();
        assert!(overlap[1].overlap && overlap[1].buckets > 0);
        let mut deep = job.clone();
        deep.model.n_layers = Some(2);
        deep.model.tie_embeddings = false;
        let bubbles = pipeline::run(&deep, &[2], &[2], &["1f1b".to_string()]).unwrap();
        assert_eq!(bubbles.len(), 1);
        let mut experts = job.clone();
        experts.moe.experts = 4;
        assert_eq!(moe::run(&experts, &[2], &[0.0]).unwrap().len(), 1);
        let saves = checkpoint::run(
            &std::env::temp_dir().join("flashover-doc-bench"),
            1 << 16,
            2,
            1,
        );
        assert!(saves.unwrap()[0].save_gbs > 0.0);
        let config = comm::CommBenchConfig {
            worlds: vec![2],
            ops: vec![OpKind::AllReduce],
            min_bytes: 4096,
            max_bytes: 4096,
            target: Duration::from_millis(10),
            flight: true,
            tensors: true,
        };
        let mut records = 0;
        comm::run(&config, |_| records += 1);
        assert_eq!(
            records,
            1 + 4,
            "memcpy, then the collective on buffers without and with the recorder, and on tensors \
             handed over and still held"
        );
        // The memory benchmarks need the counting allocator the `flashover` binary installs.
        let counting = flashover::heap::counting();
        assert_eq!(context::run(&job, &[8], &[2]).is_ok(), counting);
        assert_eq!(
            recompute::run(&job, &[(32, 2)], &["full".into()]).is_ok(),
            counting
        );
        let calibration = crate::bench::calibrate::run(&job, &[("dp=1".into(), 0)]);
        assert_eq!(calibration.is_ok(), counting);
        // Fused kernels against their unfused operations (on Flex both sides are the reference;
        // `--device wgpu` runs the kernels).
        let kernels = crate::bench::kernels::run(&burn::tensor::Device::flex(), 1).unwrap();
        assert!(kernels.iter().all(|r| r.fused_s > 0.0 && r.unfused_s > 0.0));
        // Attention both ways at one length (on Flex the fused op is its reference).
        let f32 = burn::tensor::DType::F32;
        let flex = burn::tensor::Device::flex();
        let attention = crate::bench::attention::run(&flex, &[8], 2, 4, f32, 1).unwrap();
        let ways: Vec<&str> = attention.iter().map(|r| r.way.as_str()).collect();
        assert_eq!(ways, ["fused", "burn"]);
        assert!(attention.iter().all(|r| r.step_s > 0.0));
    }
}
