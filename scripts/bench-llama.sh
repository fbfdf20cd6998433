#!/usr/bin/env bash
# Every routing policy on 3 real llama.cpp workers (one thread each) with the
# bench-preset model: one bench run per workload, because real compute needs
# per-workload sizes and arrival rates that keep the fleet busy but not
# swamped (round_robin at roughly 60% of capacity once caches are warm).
# At the end the five runs are merged into one report and chart in OUTDIR.
# Each worker is capped at WORKER_CPUS (default 0.6) CPUs with a cgroup quota,
# so that a pod has its own compute as it would on an accelerator; without it
# three pods split two cores and an idle pod costs nothing. WORKER_CPUS=0
# runs them uncapped (needed where /sys/fs/cgroup is read-only).
# Usage: scripts/bench-llama.sh MODEL OUTDIR   (make bench-llama)
set -euo pipefail
. "$(dirname "$0")/cgo-env.sh"
model=${1:?model}
out=${2:?output directory}
bench=(go run ./bench/cmd/bench --engine llama --workers 3 --model "$model" --worker-args "--threads 1" --worker-cpus "${WORKER_CPUS:-0.6}")
"${bench[@]}" --workloads shared-prefix --rate 1 --out "$out/shared-prefix"
"${bench[@]}" --workloads multi-turn --sessions 12 --turns 8 --rate 0.5 --out "$out/multi-turn"
"${bench[@]}" --workloads no-sharing --requests 64 --rate 0.5 --out "$out/no-sharing"
"${bench[@]}" --workloads hot-prompt --requests 64 --rate 0.5 --out "$out/hot-prompt"
# KV caches too small for the working set: 6 system prompts x 3 users on 4096 cells per pod.
"${bench[@]}" --workloads kv-pressure --kv-cells 4096 --systems 6 --users 3 --turns 4 --rate 0.5 --out "$out/kv-pressure"
"${bench[@]}" --merge "$out/shared-prefix,$out/multi-turn,$out/no-sharing,$out/hot-prompt,$out/kv-pressure" --out "$out"
echo "results: $out/report.md (CDFs in $out/*/)"
