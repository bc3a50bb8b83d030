#!/usr/bin/env bash
# One prepared run for a machine with an NVIDIA GPU (not run by CI: no GPU there). Exit code is
# the number of failed checks (0: all passed). Every check runs even when an earlier one fails,
# each under a time limit, so one run shows everything:
#   1. the NCCL engine through every collective at world size 1, staged and in place on device
#      memory, and with two GPUs or more at world size = the number of GPUs against the
#      sequential reference (`nccl_check`); the tensor collectives on Burn CUDA tensors, on their GPU buffers
#      with no host staging (`cuda_collectives`); `bench comm --backend nccl --tensors`: those
#      collectives' time on CUDA tensors next to the same tensors staged through host memory;
#   2. Burn's CUDA backend (NVRTC): the reference model trained at f32 and bf16, then
#      `verify` (every layout against one rank, all ranks as threads on the one GPU) for data,
#      ZeRO-1/3, HSDP, tensor, pipeline (1F1B and zero-bubble) and context parallelism; with two
#      GPUs or more, data, ZeRO-3 and pipeline parallelism on NCCL, one GPU per rank; and a few
#      layouts again on the same GPU through wgpu/Vulkan (whose f32 matmuls are f32: CUDA's
#      are TF32, see `verify`);
#   3. a model that uses the GPU (examples/configs/gpu.toml: 0.82B parameters, sequences of 2048,
#      bf16 compute) through CUDA, and at f16 with 8 of its 16 blocks through wgpu/Vulkan
#      (Burn's wgpu has no bf16 there; see wgpu_large below): tokens/s, memory and MFU;
#   4. the CubeCL kernels against their plain-tensor references on wgpu.
#
# QUICK=1 (with FLASHOVER_BIN: prebuilt binaries, no build) runs only what fits in about eight
# minutes of one H100 or H200 and prints one table: causal attention forward+backward, the
# fused kernels against Burn's fallback, at seq 2048, 8192 and 32768 (16 heads of 128, bf16;
# time and memory kept for backward, a length that runs out of memory reported as failed);
# examples/configs/gpu.toml at bf16 with the kernels (`--kernels auto`: a GPU takes them,
# attention included) and without (`--kernels never`): tokens/s, MFU and memory; and the host
# reads per step of both runs.
#
# MFU = the last step's tokens/s x FLOPs per token / peak, with FLOPs per token = 6 x non-embedding parameters
# + 12 x layers x d_model x sequence length (forward and backward, attention scores and values),
# and the peak the GPU's dense bf16 rate (PEAK_TFLOPS, default 989: an H100/H200 SXM).
#
# Binaries: FLASHOVER_BIN=DIR takes `flashover`, `nccl_check` and `cuda_collectives` built elsewhere (a GPU machine
# without Rust), else they are built here with `--features wgpu,cuda,nccl`. Libraries: the CUDA
# driver's libcuda, NCCL and NVRTC (the `nvidia-nccl-cu13` and `nvidia-cuda-nvrtc` packages of
# the Python registry work; found under python3's `nvidia` package), and a Vulkan loader for wgpu.
# LOG_DIR=DIR keeps each check's output there; ONLY=REGEX runs only the checks it matches.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${LOG_DIR:-target/gpu_check}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
mkdir -p "$LOG_DIR"

if [[ -n "${QUICK:-}" && -z "${FLASHOVER_BIN:-}" ]]; then
  echo "gpu_check: QUICK=1 needs FLASHOVER_BIN (binaries built beforehand)"
  exit 1
fi
if [[ -n "${FLASHOVER_BIN:-}" ]]; then
  BIN=$FLASHOVER_BIN
else
  cargo build --release --workspace --features wgpu,cuda,nccl,flashover-runtime/nccl \
    --bin flashover --example nccl_check --example cuda_collectives || exit 1
  BIN=target/release
  cp target/release/examples/{nccl_check,cuda_collectives} "$BIN/" || exit 1
fi

# cudarc loads `libnccl.so` and `libnvrtc.so` by their plain names: link the versioned files
# of the Python packages (or a toolkit) under those names in one folder on the search path.
LIBS=target/gpu-libs
mkdir -p "$LIBS"
site=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null || true)
for lib in nccl nvrtc; do
  found=$(find ${site:+"$site/nvidia"} /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu \
    -name "lib$lib.so*" 2>/dev/null | grep -v builtins | sort | head -1)
  if [[ -n "$found" ]]; then
    ln -sf "$found" "$LIBS/lib$lib.so"
    export LD_LIBRARY_PATH="$(dirname "$found"):${LD_LIBRARY_PATH:-}"
  else
    echo "gpu_check: lib$lib.so not found (install nvidia-${lib/nvrtc/cuda-nvrtc}-cu13 with pip)"
  fi
done
export LD_LIBRARY_PATH="$PWD/$LIBS:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

failed=0
# check NAME SECONDS COMMAND...: runs it under a limit, keeps its output, counts a failure.
check() {
  local name=$1 limit=$2
  shift 2
  [[ -n "${ONLY:-}" && ! "$name" =~ $ONLY ]] && return
  local start=$SECONDS
  if timeout "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1; then
    echo "gpu_check: PASS $name ($((SECONDS - start)) s)"
  else
    echo "gpu_check: FAIL $name (exit $?, $((SECONDS - start)) s); its last lines:"
    tail -n 15 "$LOG_DIR/$name.log"
    failed=$((failed + 1))
  fi
}
# mfu NAME: the throughput line of a training log and its MFU (see the top of this file).
mfu() {
  [[ -f "$LOG_DIR/$1.log" ]] || return 0
  awk -v peak="$PEAK_TFLOPS" '
    /^model: d_model/ { d = $3; layers = $5; params = $(NF-5) }
    /^step / { for (i = 2; i <= NF; i++) if ($i == "tok/s") tps = $(i-1) }
    END {
      seq = 2048; nonembed = params - 64 * d
      flops = 6 * nonembed + 12 * layers * d * seq
      if (tps > 0) printf "  %s tokens/s, %.1f TFLOP/s, MFU %.2f%% of %s TFLOP/s\n", tps, tps * flops / 1e12, 100 * tps * flops / (peak * 1e12), peak
    }' "$LOG_DIR/$1.log"
  grep -A3 "memory per rank" "$LOG_DIR/$1.log" | tail -n 2
}

if [[ -n "${QUICK:-}" ]]; then
  check attention 240 "$BIN/flashover" bench attention --device cuda --seqs 2048,8192,32768 \
    --heads 16 --head-dim 128 --dtype bf16 --repeats 2
  grep "^|" "$LOG_DIR/attention.log" 2>/dev/null
  for kernels in auto never; do
    check "gpu_toml_kernels_$kernels" 150 "$BIN/flashover" train --config examples/configs/gpu.toml \
      --device cuda --kernels "$kernels"
    mfu "gpu_toml_kernels_$kernels"
    grep "host reads per step" "$LOG_DIR/gpu_toml_kernels_$kernels.log" 2>/dev/null
  done
  echo "gpu_check: $failed failed; logs in $LOG_DIR"
  exit "$failed"
fi

check nccl_check 180 "$BIN/nccl_check"
check cuda_collectives 60 "$BIN/cuda_collectives"
check nccl_bench 150 "$BIN/flashover" bench comm --backend nccl --tensors --min-bytes 1M \
  --max-bytes 256M --target-ms 100
grep -E "^all_reduce .* 67108864 " "$LOG_DIR/nccl_bench.log" 2>/dev/null
for precision in f32 bf16; do
  check "cuda_train_$precision" 180 "$BIN/flashover" train --device cuda --mesh dp=1 --steps 20 \
    --precision "$precision"
done
for layout in "dp=2" "fsdp=2 --zero 1" "fsdp=2 --zero 3" "dp=2,fsdp=2 --zero 3" "tp=2" \
  "pp=2 --micro-batches 2" "cp=2" "fsdp=2,tp=2,pp=2 --zero 3 --micro-batches 2" \
  "pp=2 --micro-batches 2 --pp-schedule zb-h1"; do
  # shellcheck disable=SC2086 # the layout is several arguments
  check "cuda_verify_${layout//[^a-z0-9]/_}" 180 "$BIN/flashover" verify --device cuda --steps 3 \
    --mesh $layout
done
# NCCL worlds of two ranks, one GPU each (ranks as threads): data parallel, and pipelines,
# whose sends and receives go as NCCL groups (never run before a machine with two GPUs).
gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
if ((gpus >= 2)); then
  for layout in "dp=2" "pp=2 --micro-batches 4" "pp=2 --micro-batches 4 --pp-schedule zb-h1" \
    "fsdp=2 --zero 3"; do
    # shellcheck disable=SC2086 # the layout is several arguments
    check "nccl_verify_${layout//[^a-z0-9]/_}" 180 "$BIN/flashover" verify --device cuda \
      --engine nccl --steps 3 --mesh $layout
  done
else
  echo "gpu_check: $gpus GPU(s): the NCCL worlds of two ranks (nccl_verify_*) need two"
fi
for layout in "dp=2" "tp=2" "fsdp=2,tp=2,pp=2 --zero 3 --micro-batches 2"; do
  # shellcheck disable=SC2086 # the layout is several arguments
  check "wgpu_verify_${layout//[^a-z0-9]/_}" 180 "$BIN/flashover" verify --device wgpu --steps 3 \
    --mesh $layout
done
check cuda_large 300 "$BIN/flashover" train --config examples/configs/gpu.toml --device cuda
mfu cuda_large
# Half the blocks on wgpu: the flat vector of all parameters (3.1 GiB at 16 blocks) is one
# buffer, over what wgpu lets one buffer hold there ("can't allocate buffer of size").
check wgpu_large 200 "$BIN/flashover" train --config examples/configs/gpu.toml --device wgpu \
  --precision f16 --n-layers 8
mfu wgpu_large
check wgpu_kernels 180 "$BIN/flashover" bench kernels --device wgpu --repeats 5
echo "gpu_check: $failed failed; logs in $LOG_DIR"
exit "$failed"
