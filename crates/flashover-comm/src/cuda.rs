//! Whether this machine can run CUDA work, asked before anything loads CUDA: cudarc loads the
//! driver and NVRTC on first use and panics (on whichever thread gets there first) when one is
//! missing. These checks only try to open the libraries and ask the driver, and their errors
//! say what is missing and how to get it.

/// Why a CUDA device cannot be used here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaUnavailable {
    /// No loadable `libcuda.so`.
    #[error(
        "the CUDA driver library (libcuda.so) cannot be loaded: this machine has no NVIDIA \
         driver, or LD_LIBRARY_PATH does not reach it"
    )]
    NoDriver,
    /// No loadable `libnvrtc.so` (Burn's CUDA kernels are compiled by NVRTC at run time).
    #[error(
        "the NVRTC library (libnvrtc.so), which compiles Burn's CUDA kernels, cannot be loaded: \
         install the CUDA toolkit, or `pip install nvidia-cuda-nvrtc-cu12` and add its lib \
         directory to LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    /// The driver loaded but did not start or answer.
    #[error("the CUDA driver {0}")]
    Driver(String),
    /// Fewer GPUs than the rank's index.
    #[error(
        "local rank {local_rank} takes GPU {local_rank}, but this machine has {gpus} \
         (one rank per GPU: run at most {gpus} ranks per node)"
    )]
    NoSuchGpu {
        /// The rank's index on its node.
        local_rank: usize,
        /// GPUs the driver sees.
        gpus: usize,
    },
}

/// The driver library loads.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the shared library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Checks that GPU `local_rank` can run Burn's CUDA backend: the driver and NVRTC load, the
/// driver starts, and the GPU exists.
pub fn check_gpu(local_rank: usize) -> Result<(), CudaUnavailable> {
    use cudarc::driver::result as driver;
    if !driver_present() {
        return Err(CudaUnavailable::NoDriver);
    }
    // SAFETY: only tries to open the shared library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaUnavailable::NoNvrtc);
    }
    driver::init().map_err(|e| CudaUnavailable::Driver(format!("did not start: {e:?}")))?;
    let gpus = driver::device::get_count()
        .map_err(|e| CudaUnavailable::Driver(format!("cannot count GPUs: {e:?}")))?;
    let gpus = usize::try_from(gpus).unwrap_or(0);
    if local_rank >= gpus {
        return Err(CudaUnavailable::NoSuchGpu { local_rank, gpus });
    }
    Ok(())
}
