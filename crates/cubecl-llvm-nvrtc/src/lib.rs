//! Flashover's stand-in for `cubecl-llvm 0.11.3`: the items `cubecl-cuda 0.11.3` names from it,
//! with no LLVM behind them. `cubecl-cuda` compiles kernels with NVRTC when its `cpp` feature is
//! on (Flashover's `cuda` feature turns it on), so nothing here runs on that path except
//! [`nvptx::ptx_version::PtxVersion::for_driver`]; asking for the LLVM backend anyway gets
//! [`PlironCompiler::compile`]'s error, which says why and how to get the real crate.
//! See the workspace `Cargo.toml` (`[patch.crates-io]`).

use cubecl_core::ir::nvidia::SmArch;
use cubecl_environment::backtrace::BackTrace;
use cubecl_runtime::compiler::CompilationError;
use cubecl_runtime::kernel::BufferIOAttr;

pub mod nvptx {
    //! The PTX side of the LLVM backend: only its version table is used outside it.
    pub mod ptx_version {
        //! The PTX ISA version a driver loads.
        use core::fmt;

        /// A PTX ISA version as the NVPTX target feature spells it (8.7 is `87`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct PtxVersion(u32);

        impl PtxVersion {
            /// The newest version a CUDA driver of version `driver` (as `cuDriverGetVersion`
            /// reports it: 12.8 is `12080`) loads; `None` below CUDA 10.0. The table is CUDA's
            /// release notes' (the first driver of each PTX ISA version). `cubecl-cuda` keys
            /// its kernel cache on it, so it answers as the real crate does.
            pub fn for_driver(driver: i32) -> Option<Self> {
                const FIRST_DRIVER_OF: &[(i32, u32)] = &[
                    (13030, 93),
                    (13020, 92),
                    (13010, 91),
                    (13000, 90),
                    (12090, 88),
                    (12080, 87),
                    (12050, 85),
                    (12040, 84),
                    (12030, 83),
                    (12020, 82),
                    (12010, 81),
                    (12000, 80),
                    (11080, 78),
                    (11070, 77),
                    (11060, 76),
                    (11050, 75),
                    (11040, 74),
                    (11030, 73),
                    (11020, 72),
                    (11010, 71),
                    (11000, 70),
                    (10020, 65),
                    (10010, 64),
                    (10000, 63),
                ];
                FIRST_DRIVER_OF
                    .iter()
                    .find(|(first, _)| driver >= *first)
                    .map(|(_, ptx)| PtxVersion(*ptx))
            }
        }

        impl fmt::Display for PtxVersion {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "ptx{}", self.0)
            }
        }
    }
}

pub mod shared {
    //! What the LLVM backend shares between its targets.
    pub mod lowered_features {
        //! Narrowing a device's advertised features to what LLVM lowers.
        use cubecl_core::ir::DeviceProperties;

        /// The GPU target a device's features are narrowed for.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum GpuTarget {
            /// NVIDIA PTX.
            Nvptx,
        }

        /// `cubecl-cuda` calls this only when its LLVM backend is selected, which this
        /// stand-in cannot compile with: the device keeps what NVRTC advertises.
        pub fn restrict_features(_props: &mut DeviceProperties, _target: GpuTarget) {}
    }
}

/// The LLVM targets (only NVPTX is named by `cubecl-cuda`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LlvmTarget {
    /// NVIDIA PTX.
    #[default]
    Nvptx,
}

/// The pliron/LLVM kernel compiler, which this stand-in does not have.
#[derive(Clone, Debug, Default)]
pub struct PlironCompiler {
    /// The target it would compile for.
    pub target: LlvmTarget,
}

/// The LLVM backend's options, as `cubecl-cuda` fills them.
#[derive(Clone, Debug, Default)]
pub struct PlironOptions {
    /// An AMD architecture (always `None` from `cubecl-cuda`).
    pub arch: Option<()>,
    /// The NVIDIA architecture.
    pub sm_arch: Option<SmArch>,
    /// The PTX version to emit.
    pub ptx_version: Option<nvptx::ptx_version::PtxVersion>,
    /// Scalars in the kernel parameter block.
    pub grid_constants: bool,
}

/// A PTX module the LLVM backend would have produced.
#[derive(Clone, Debug)]
pub struct NvptxModule {
    /// NUL-terminated PTX.
    pub ptx: Vec<core::ffi::c_char>,
    /// The kernel's entry point.
    pub entrypoint: String,
    /// Its IR, for logs and cache keys.
    pub ir: String,
    /// Shared memory per launch, in bytes.
    pub shared_memory_size: usize,
    /// Buffer access modes in binding order.
    pub io: Vec<BufferIOAttr>,
}

/// What the LLVM backend compiles to.
#[derive(Clone, Debug)]
pub enum PlironArtifact {
    /// A PTX module.
    NvptxCode(NvptxModule),
}

impl PlironCompiler {
    /// The language tag of what it compiles to (LLVM IR).
    pub fn lang_tag(&self) -> &'static str {
        "llvm"
    }

    /// Always refused: this build has no LLVM. `cubecl-cuda` reaches this only when its LLVM
    /// backend was selected, i.e. its `cpp` feature is off.
    pub fn compile<K>(
        &mut self,
        _kernel: K,
        _options: &PlironOptions,
    ) -> Result<PlironArtifact, CompilationError> {
        Err(CompilationError::Generic {
            reason: "this build's cubecl-llvm is Flashover's stand-in, which has no LLVM: \
                     turn on cubecl-cuda's `cpp` feature (NVRTC, as Flashover's `cuda` feature \
                     does), or remove the workspace's [patch.crates-io] entry for cubecl-llvm \
                     where its LLVM bundle can be downloaded"
                .to_string(),
            backtrace: BackTrace::capture(),
        })
    }
}
