#!/usr/bin/env bash
# TTFT of this worker against Ollama v0.11.4 serving the same generated GGUF
# (the bench preset), side by side in one run (docs/benchmarks.md). Not part
# of `make test`.
#
# It builds Ollama from the module go.mod pins (copied out of the module
# cache into var/ollama-src, a module of its own, because its command needs
# dependencies this module does not), and optionally this worker as of an
# older commit (BEFORE=<commit>, built from `git archive` in var/). The
# servers run at the same time but bench/cmd/ttftcmp sends to one at a
# time, so they never compete for the CPU, and it reports each server's CPU
# seconds per round beside the TTFTs (with THREADS=1 and WORKER_ARGS /
# BEFORE_ARGS="--threads 1" those are the work done, whatever else loads
# the machine).
#
#   scripts/bench-ollama.sh [ttftcmp flags, e.g. --rounds 2 --scenarios shared]
#
# Environment: THREADS (Ollama's num_thread, default 2: the worker finds its
# own), OLLAMA_PARALLEL (space-separated OLLAMA_NUM_PARALLEL values, one
# Ollama server each; default "1 4": Ollama's default and one slot per
# user), BEFORE (a commit of this repository to compare with as well),
# WORKER_ARGS (extra flags for the worker), BEFORE_ARGS (for the older one;
# e.g. a longer --request-timeout for both on a loaded machine).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/cgo-env.sh
threads=${THREADS:-2}
parallel=${OLLAMA_PARALLEL:-1 4}
model=$PWD/var/models/bench.gguf
mkdir -p var bin

[ -f "$model" ] || go run ./worker/cmd/mkmodel --preset bench --out "$model"
if [ ! -x bin/ollama ]; then
	src=$(go list -m -f '{{.Dir}}' github.com/ollama/ollama)
	rm -rf var/ollama-src && cp -r "$src" var/ollama-src && chmod -R u+w var/ollama-src
	(cd var/ollama-src && go build -ldflags "-X github.com/ollama/ollama/version.Version=$(basename "$src" | cut -d@ -f2 | tr -d v)" -o ../../bin/ollama .)
fi
go build -o bin/worker ./worker/cmd/worker
go build -o bin/ttftcmp ./bench/cmd/ttftcmp
if [ -n "${BEFORE:-}" ]; then
	rm -rf var/before && mkdir -p var/before
	git archive "$BEFORE" | tar -x -C var/before
	(cd var/before && go build -o ../../bin/worker-before ./worker/cmd/worker)
fi

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
wait_up() { # url
	for _ in $(seq 1 600); do curl -sf "$1" >/dev/null && return 0; sleep 0.2; done
	echo "bench-ollama: $1 never answered" >&2; return 1
}

targets=()
# shellcheck disable=SC2086
bin/worker --model "$model" --listen 127.0.0.1:9181 --model-name bench ${WORKER_ARGS:-} >var/bench-ollama-worker.log 2>&1 &
pids+=($!)
wait_up http://127.0.0.1:9181/healthz
targets+=(--target worker=http://127.0.0.1:9181=bench --pid "worker=${pids[-1]}")
if [ -n "${BEFORE:-}" ]; then
	# shellcheck disable=SC2086
	bin/worker-before --model "$model" --listen 127.0.0.1:9182 --model-name bench ${BEFORE_ARGS:-} >var/bench-ollama-before.log 2>&1 &
	pids+=($!)
	wait_up http://127.0.0.1:9182/healthz
	targets+=(--target "before=http://127.0.0.1:9182=bench" --pid "before=${pids[-1]}")
fi

cat >var/Modelfile <<EOF
FROM $model
PARAMETER num_thread $threads
PARAMETER num_ctx 8192
EOF
port=11481
for p in $parallel; do
	host=127.0.0.1:$port
	OLLAMA_HOST=$host OLLAMA_MODELS=$PWD/var/ollama-models OLLAMA_NUM_PARALLEL=$p OLLAMA_KEEP_ALIVE=1h \
		bin/ollama serve >"var/bench-ollama-p$p.log" 2>&1 &
	pids+=($!)
	wait_up "http://$host/api/version"
	OLLAMA_HOST=$host bin/ollama create bench -f var/Modelfile >/dev/null 2>&1
	targets+=(--target "ollama-p$p=http://$host=bench" --pid "ollama-p$p=${pids[-1]}")
	port=$((port + 1))
done

echo "bench-ollama: $(OLLAMA_HOST=127.0.0.1:11481 bin/ollama -v 2>&1 | tail -1); worker threads: $(grep -o 'threads=[0-9]*' var/bench-ollama-worker.log | head -1)" >&2
bin/ttftcmp "${targets[@]}" "$@"
