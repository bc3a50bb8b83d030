//! The NCCL engine where there may be no GPU: it builds, and without CUDA or NCCL it fails at
//! once with a message naming the missing library (never a crash). On a machine with both,
//! `scripts/gpu_check.sh` runs every collective on device memory.
#![cfg(feature = "nccl")]

use flashover_comm::{CommError, NcclWorld};
use std::time::Duration;

#[test]
fn without_the_libraries_the_error_names_what_is_missing() {
    match NcclWorld::available() {
        Ok(()) => {
            // A GPU machine: the engine starts (world of one, no exchange needed).
            let world =
                NcclWorld::group(0, 1, 0, Duration::from_secs(60), |id| Ok(vec![id.to_vec()]))
                    .unwrap();
            assert_eq!(world.size(), 1);
        }
        Err(CommError::Engine { engine, detail }) => {
            assert_eq!(engine, "nccl");
            assert!(detail.contains("cannot be loaded"), "{detail}");
            let err = NcclWorld::group(0, 1, 0, Duration::from_secs(1), |_| {
                panic!("must fail before exchanging ids")
            })
            .unwrap_err();
            assert!(err.to_string().contains("cannot be loaded"), "{err}");
        }
        Err(other) => panic!("unexpected error: {other}"),
    }
}

/// The check `--device cuda` makes before Burn loads CUDA (whose loader panics on another
/// thread): without a driver (CI), the refusal names libcuda; without NVRTC, libnvrtc; on a
/// GPU machine, GPU 0 passes and a rank beyond the GPUs is refused with their count.
#[test]
fn a_gpu_that_cannot_be_used_is_refused_naming_what_is_missing() {
    use flashover_comm::cuda::{CudaUnavailable, check_gpu, driver_present};
    match check_gpu(0) {
        Ok(()) => {
            let err = check_gpu(4096).unwrap_err();
            assert!(
                matches!(err, CudaUnavailable::NoSuchGpu { local_rank: 4096, gpus } if gpus > 0),
                "{err}"
            );
            assert!(err.to_string().contains("ranks per node"), "{err}");
        }
        Err(err @ CudaUnavailable::NoDriver) => {
            assert!(!driver_present());
            assert!(err.to_string().contains("libcuda.so"), "{err}");
        }
        Err(err @ CudaUnavailable::NoNvrtc) => {
            assert!(driver_present());
            assert!(err.to_string().contains("libnvrtc.so"), "{err}");
        }
        Err(other) => panic!("a driver that loads but does not answer: {other}"),
    }
}
