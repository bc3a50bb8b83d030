#!/usr/bin/env bash
# For a machine with an NVIDIA GPU, its driver and NCCL (libnccl.so; add the symlink to
# libnccl.so.2 if only that exists): the NCCL engine through every collective on device memory
# (world size 1), then the reference model training on the GPU through wgpu (Vulkan), with the
# report's step time and tokens/s for docs/benchmarks.md. Not run by CI (no GPU there).
set -euo pipefail
cd "$(dirname "$0")/.."

cargo run --release -p flashover-comm --features nccl --example nccl_check
cargo run --release --features wgpu -- train --device wgpu --steps 50
