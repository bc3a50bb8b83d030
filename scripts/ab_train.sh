#!/usr/bin/env bash
# A/B throughput of two `flashover` binaries (say the one before a change and the one after),
# run alternately on the same machine: for each layout, ROUNDS rounds of `train` with binary A
# then binary B, each a fresh run of STEPS steps of the main job's model. Prints a Markdown
# table of median tokens/s over each run's steps after the first, the medians over rounds, and
# B/A. Ratios measured side by side are what survives a noisy machine.
#
#   scripts/ab_train.sh OLD_BINARY NEW_BINARY [ROUNDS] [STEPS]
set -euo pipefail
a=${1:?usage: ab_train.sh OLD_BINARY NEW_BINARY [ROUNDS] [STEPS]}
b=${2:?usage: ab_train.sh OLD_BINARY NEW_BINARY [ROUNDS] [STEPS]}
rounds=${3:-3}
steps=${4:-40}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$work}"

layouts=(
  "dp=2"
  "fsdp=2 --zero 1"
  "fsdp=2 --zero 2"
  "fsdp=2 --zero 3"
  "tp=2"
  "dp=2,tp=2"
  "pp=2 --micro-batches 4"
  "fsdp=2,tp=2 --zero 3"
)
# AB_LAYOUTS="dp=2;fsdp=2 --zero 3" measures those instead.
if [ -n "${AB_LAYOUTS:-}" ]; then
  IFS=';' read -r -a layouts <<< "$AB_LAYOUTS"
fi

# Median tokens/s of a run's steps after the first, from its JSONL log.
median_tokens() {
  python3 - "$1" <<'EOF'
import json, statistics, sys
steps = [json.loads(line) for line in open(sys.argv[1])]
print(statistics.median(s["tokens_per_s"] for s in steps[1:]))
EOF
}

echo "| layout | A tokens/s (rounds) | B tokens/s (rounds) | B / A (medians) |"
echo "|---|---|---|---:|"
for layout in "${layouts[@]}"; do
  mesh=${layout%% *}
  rest=${layout#"$mesh"}
  ra=(); rb=()
  for round in $(seq "$rounds"); do
    for side in a b; do
      bin=$a; [ "$side" = b ] && bin=$b
      log="$work/$side-$round.jsonl"
      # shellcheck disable=SC2086
      "$bin" train --mesh "$mesh" $rest --steps "$steps" --log-jsonl "$log" > /dev/null
      if [ "$side" = a ]; then ra+=("$(median_tokens "$log")"); else rb+=("$(median_tokens "$log")"); fi
    done
  done
  python3 - "$layout" "${ra[*]}" "${rb[*]}" <<'EOF'
import statistics, sys
layout, a, b = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
fmt = lambda xs: " / ".join(f"{x:,.0f}" for x in xs)
print(f"| `{layout}` | {fmt(a)} | {fmt(b)} | {statistics.median(b) / statistics.median(a):.2f} |")
EOF
done
