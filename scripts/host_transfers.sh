#!/usr/bin/env bash
# Host transfers per step of `flashover train` (its summary's "host transfers per step" lines)
# for the layouts docs/benchmarks.md tabulates, 10 steps of the main job's model each.
#
#   scripts/host_transfers.sh [BINARY]     (default: target/release/flashover)
set -euo pipefail
bin=${1:-target/release/flashover}
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
for layout in "dp=2" "fsdp=2 --zero 1" "fsdp=2 --zero 2" "fsdp=2 --zero 3" "tp=2" \
  "pp=2 --micro-batches 4" "fsdp=2,tp=2 --zero 3" "fsdp=2,tp=2,pp=2 --zero 3"; do
  echo "== $layout"
  # shellcheck disable=SC2086 # the layout is several arguments
  "$bin" train --mesh $layout --steps 10 2>&1 |
    sed -n '/host transfers per step/,/per rank/p' | grep -v "per rank\|host transfers"
done
