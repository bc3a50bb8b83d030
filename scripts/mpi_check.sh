#!/usr/bin/env bash
# The MPI engine under mpirun: every collective against the sequential reference at 2 and 4
# processes, then a rank that dies and a rank that stalls must end the job non-zero, fast.
# Needs OpenMPI (libopenmpi-dev openmpi-bin) and libclang (clang libclang-dev) to build.
set -euo pipefail
cd "$(dirname "$0")/.."
# The features of scripts/test.sh's build (with mpi), so Burn is built once for both.
features="mpi,${FLASHOVER_TEST_FEATURES:-wgpu,cuda,nccl,flashover-runtime/nccl}"
export BURN_DEVICE="${BURN_DEVICE:-flex}"  # as in scripts/test.sh

cargo build --quiet -p flashover-comm --features mpi --example mpi_check
check="${CARGO_TARGET_DIR:-target}/debug/examples/mpi_check"
run() { mpirun --oversubscribe --allow-run-as-root "$@"; }

run -np 2 "$check"
run -np 4 "$check"

# Training: one rank per process gives the thread launcher's losses and gradient norms bit for
# bit (DDP + TP, ZeRO-3/HSDP, DDP + pipeline, expert parallel: tokens by MPI all-to-all,
# context parallel: ring attention's exchanges from a helper thread).
cargo build --quiet --features "$features" --bin flashover
flashover="${CARGO_TARGET_DIR:-target}/debug/flashover"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
numbers() { grep -o '"\(loss\|grad_norm\)":[^,]*' "$1"; }
for job in "--mesh dp=2,tp=2" "--mesh dp=2,fsdp=2 --zero 3" "--mesh dp=2,pp=2 --micro-batches 2" \
           "--mesh dp=2,ep=2 --moe --experts 4 --capacity-factor 1.25 --replicate-hot 1" \
           "--mesh dp=2,cp=2"; do
  # shellcheck disable=SC2086
  run -np 4 "$flashover" train $job --steps 6 --log-jsonl "$scratch/mpi.jsonl" >/dev/null
  # shellcheck disable=SC2086
  "$flashover" train $job --steps 6 --log-jsonl "$scratch/threads.jsonl" >/dev/null
  if ! diff <(numbers "$scratch/mpi.jsonl") <(numbers "$scratch/threads.jsonl") >/dev/null \
     || [ "$(numbers "$scratch/mpi.jsonl" | wc -l)" != 12 ]; then
    echo "mpi_check: train $job under mpirun differs from the thread launcher" >&2; exit 1
  fi
  echo "mpi_check: train $job: 6 steps, losses and gradient norms equal the threads' bit for bit"
done

# Four mesh axes, sixteen processes (the seed's data x tensor x pipeline x context topology).
job="--mesh dp=2,tp=2,pp=2,cp=2 --micro-batches 2 --untie-embeddings"
# shellcheck disable=SC2086
run -np 16 "$flashover" train $job --steps 4 --log-jsonl "$scratch/mpi.jsonl" >/dev/null
# shellcheck disable=SC2086
"$flashover" train $job --steps 4 --log-jsonl "$scratch/threads.jsonl" >/dev/null
if ! diff <(numbers "$scratch/mpi.jsonl") <(numbers "$scratch/threads.jsonl") >/dev/null \
   || [ "$(numbers "$scratch/mpi.jsonl" | wc -l)" != 8 ]; then
  echo "mpi_check: train $job under mpirun -np 16 differs from the thread launcher" >&2; exit 1
fi
echo "mpi_check: train $job: 16 processes, 4 steps, losses and gradient norms equal the threads' bit for bit"

# burn-train's Learner, one rank per process: the learner example's fsdp=2,tp=2 and dp=2,pp=2 runs.
cargo build --quiet --features mpi,learner --example learner_parallel
learner="${CARGO_TARGET_DIR:-target}/debug/examples/learner_parallel"
run -np 4 "$learner" | grep -q "^match" || { echo "mpi_check: learner_parallel under mpirun -np 4 failed" >&2; exit 1; }
echo "mpi_check: examples/learner_parallel: the Learner at fsdp=2,tp=2 and dp=2,pp=2 under mpirun -np 4 matches one device"

# flashover launch: N processes through mpirun, output tagged with the rank.
out=$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "$flashover" launch -n 2 -- train --mesh dp=2 --steps 3)
grep -q '\[1,0\]<stdout>:.*final loss' <<<"$out" || { echo "mpi_check: launch: no final report from rank 0:" >&2; echo "$out" >&2; exit 1; }
echo "mpi_check: launch -n 2 -- train --mesh dp=2: ran, rank 0 reported"

# Elastic: rank 1 of four processes is killed as step 5 starts; the launcher restarts the job
# on the three survivors (dp=3) from the step-4 checkpoint, whose losses and gradient norms
# then equal an uninterrupted run on dp=3 resumed from that checkpoint, bit for bit.
ckpt="$scratch/elastic"
out=$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 300 "$flashover" launch -n 4 \
  --engine mpi --elastic -- train --mesh dp=2,tp=2 --steps 8 --save-every 2 --ckpt-dir "$ckpt" \
  --global-batch 12 --kill 1@5 --log-jsonl "$scratch/elastic.jsonl" 2>&1) \
  || { echo "mpi_check: elastic launch failed:" >&2; echo "$out" >&2; exit 1; }
grep -q '^elastic restart: rank 1 failed (fault drill: rank 1 killed at the start of step 5).*dp=2,tp=2 -> dp=3; resuming from step 4' <<<"$out" \
  || { echo "mpi_check: elastic launch: no restart onto dp=3 from step 4:" >&2; echo "$out" >&2; exit 1; }
"$flashover" train --mesh dp=3 --steps 8 --global-batch 12 --resume "$ckpt/step-00000004" \
  --log-jsonl "$scratch/straight.jsonl" >/dev/null
if ! diff <(numbers "$scratch/elastic.jsonl") <(numbers "$scratch/straight.jsonl") >/dev/null \
   || [ "$(numbers "$scratch/elastic.jsonl" | wc -l)" != 8 ]; then
  echo "mpi_check: elastic launch: the survivors' steps differ from a resumed run on dp=3" >&2; exit 1
fi
echo "mpi_check: launch --elastic: rank killed at step 5, restarted on dp=3 from step 4, bit for bit"

# The multi_process example: the same script as threads and under mpirun.
cargo build --quiet --features "$features" --example multi_process
example="${CARGO_TARGET_DIR:-target}/debug/examples/multi_process"
"$example" | grep -q "^match" || { echo "mpi_check: multi_process as threads failed" >&2; exit 1; }
run -np 2 "$example" | grep -q "^match" || { echo "mpi_check: multi_process under mpirun failed" >&2; exit 1; }
echo "mpi_check: examples/multi_process matches one rank as threads and under mpirun -np 2"

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
