#!/usr/bin/env bash
# The README's test command: every test of the workspace, on Flex and on the wgpu CPU adapter
# (Mesa lavapipe). Installs lavapipe first where it is missing and apt-get is usable as root.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1 || ! ldconfig -p | grep -q 'libvulkan.so.1'; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends mesa-vulkan-drivers libvulkan1
  else
    echo "The wgpu tests need Mesa's Vulkan CPU driver: install mesa-vulkan-drivers and libvulkan1." >&2
    exit 1
  fi
fi

# The MPI engine's checks need OpenMPI and libclang (for the bindings).
if ! command -v mpirun >/dev/null 2>&1 || ! ldconfig -p | grep -q 'libclang'; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends libopenmpi-dev openmpi-bin libclang-dev clang pkg-config
  else
    echo "The MPI checks need OpenMPI and libclang: install libopenmpi-dev openmpi-bin libclang-dev clang." >&2
    exit 1
  fi
fi

# Mesa's Vulkan loader wants a runtime directory; headless machines often have none.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
# One feature set for the tests, the examples and the MPI checks' binaries (one build of Burn):
# wgpu, and Burn's CUDA backend and the NCCL engine, which build offline and so are built and
# linked here too. Without a GPU they refuse by name (tests `nccl_engine`, `launch`). The tests
# choose their devices; Burn's own default device, which would be CUDA in such a build, is
# only used by Burn's `ModuleOptimizer::load_record` (resume tests): BURN_DEVICE puts it on
# Flex, which every build has.
export FLASHOVER_TEST_FEATURES=wgpu,cuda,nccl,flashover-runtime/nccl
export BURN_DEVICE=flex
cargo test --workspace --features "$FLASHOVER_TEST_FEATURES" "$@"

# burn-train's Learner on a mesh (feature `learner`: burn-train turns on Flex's SIMD and rayon
# kernels, so this is a build of its own, without wgpu).
cargo test -p flashover --features learner --test learner
cargo run --quiet --features learner --example learner_parallel | grep -v 'ProgressSnapshot'

# The MPI engine, one rank per process under mpirun.
scripts/mpi_check.sh

# Examples run as a user would run them (same features as the tests: no second build;
# multi_process needs MPI and runs in scripts/mpi_check.sh).
for example in ddp_own_model zero3_own_model parallelize_gpt2 parallelize_seq2seq parallelize_classifier \
    parallelize_burn_transformer checkpoint_reshard \
    tensor_parallel pipeline \
    moe_expert_parallel context_parallel_long_sequence activation_checkpointing mixed_precision; do
  cargo run --quiet --features "$FLASHOVER_TEST_FEATURES" --example "$example"
done
