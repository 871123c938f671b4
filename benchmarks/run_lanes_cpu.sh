#!/usr/bin/env bash
# Regenerates benchmarks/results/lanes_cpu.md: the vmap engine against the
# loop engine and FedJAX's jit backend for the FEMNIST CNN at 10 clients per
# round on XLA:CPU, at 2 (auto), 1, 4 and 10 lanes, 8 rounds on fresh
# cohorts each, one process per lane count; the runs merged into one file.
#   FEDLITE_DATA_DIR=/path/to/data bash benchmarks/run_lanes_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
for lanes in auto 1 4 10; do
  python benchmarks/bench_rounds.py --models=femnist \
    --engines=loop,vmap,fedjax_jit --cohorts=10 --rounds=8 --no-isolate \
    --lanes_per_device="$lanes" --output="$tmp/lanes_$lanes.md"
done
python benchmarks/bench_rounds.py \
  --merge="$tmp/lanes_auto.md,$tmp/lanes_1.md,$tmp/lanes_4.md,$tmp/lanes_10.md" \
  --output=benchmarks/results/lanes_cpu.md
# The file names the runs' commands; their temporary folder as <tmp>.
sed -i "s#$tmp#<tmp>#g" benchmarks/results/lanes_cpu.md
rm -rf "$tmp"
