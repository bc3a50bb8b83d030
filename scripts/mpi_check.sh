#!/usr/bin/env bash
# The MPI engine under mpirun: every collective against the sequential reference at 2 and 4
# processes, then a rank that dies and a rank that stalls must end the job non-zero, fast.
# Needs OpenMPI (libopenmpi-dev openmpi-bin) and libclang (clang libclang-dev) to build.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --quiet -p flashover-comm --features mpi --example mpi_check
check="${CARGO_TARGET_DIR:-target}/debug/examples/mpi_check"
run() { mpirun --oversubscribe --allow-run-as-root "$@"; }

run -np 2 "$check"
run -np 4 "$check"

# Failure must not hang: a dying rank and a stalled rank (5 s deadline) both end the job.
expect_failure() {
  local what="$1" pattern="$2"; shift 2
  local out start=$SECONDS
  if out=$(timeout 60 mpirun --oversubscribe --allow-run-as-root "$@" 2>&1); then
    echo "mpi_check: $what: the job succeeded but must fail" >&2; exit 1
  fi
  if (( SECONDS - start >= 30 )); then
    echo "mpi_check: $what: took $((SECONDS - start)) s (must end within 30 s)" >&2; exit 1
  fi
  if ! grep -q "$pattern" <<<"$out"; then
    echo "mpi_check: $what: missing \"$pattern\" in:" >&2; echo "$out" >&2; exit 1
  fi
  echo "mpi_check: $what: failed as it must, in $((SECONDS - start)) s"
}
expect_failure "a rank exits mid-run" "exiting on purpose" -np 2 "$check" --die 1
expect_failure "a rank stalls past the deadline" "timed out after 5s" -np 2 "$check" --stall 1
