#!/usr/bin/env bash
# For a machine with an NVIDIA GPU, its driver and NCCL (libnccl.so; add the symlink to
# libnccl.so.2 if only that exists): the NCCL engine through every collective, on staged host
# buffers and in place on device memory (world size 1); the wgpu training suite (every strategy
# on the GPU's Vulkan adapter against Flex); then the reference model on the GPU through wgpu at
# f32 and in reduced precision (bf16 where the adapter has it, else f16), with the report's step
# time and tokens/s for docs/benchmarks.md; then the same through Burn's CUDA backend (NVRTC:
# needs libnvrtc.so, e.g. from the CUDA toolkit or `pip install nvidia-cuda-nvrtc-cu12`).
# Not run by CI (no GPU there).
set -euo pipefail
cd "$(dirname "$0")/.."

cargo run --release -p flashover-comm --features nccl --example nccl_check
cargo test --release --features wgpu --test wgpu_training
cargo test --release --workspace --features wgpu --test kernels
cargo run --release --features wgpu -- bench kernels --device wgpu
for precision in f32 bf16 f16; do
  # bf16 is refused with a clear message where the adapter lacks it; keep going.
  cargo run --release --features wgpu -- train --device wgpu --mesh dp=1 --steps 50 \
    --precision "$precision" || echo "gpu_check: --precision $precision not run (see above)"
done
for precision in f32 bf16; do
  cargo run --release --features cuda,nccl -- train --device cuda --mesh dp=1 --steps 50 \
    --precision "$precision"
done
