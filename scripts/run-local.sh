#!/usr/bin/env bash
# README's main command (`make run`): starts the local stack and stops it all on Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
export CGO_CFLAGS="${CGO_CFLAGS:--O3 -march=native}" CGO_CXXFLAGS="${CGO_CXXFLAGS:--O3 -march=native}"
MC_LISTEN=${MC_LISTEN:-127.0.0.1:8080}
mkdir -p bin
go build -o bin/ ./metadata-center/cmd/metadata-center
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT INT TERM
./bin/metadata-center --listen "$MC_LISTEN" --store "${STORE:-memory}" &
pids+=($!)
echo "metadata center on http://$MC_LISTEN (Ctrl-C stops everything)"
wait
