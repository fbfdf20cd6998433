#!/usr/bin/env bash
# README's main command (`make run`): the whole system on one machine, no mesh.
# Builds everything, generates the tiny model, starts the metadata center
# (embedded store; STORE=redis REDIS_ADDR=... for Redis), three llama.cpp
# workers and the standalone gateway, prints how to call it, and stops
# everything on Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/cgo-env.sh

GATEWAY=${GATEWAY:-127.0.0.1:8000}
MC=${MC:-127.0.0.1:8080}
WORKER_PORTS=${WORKER_PORTS:-"9001 9002 9003"}
STORE=${STORE:-memory}
REDIS_ADDR=${REDIS_ADDR:-127.0.0.1:6379}
MODEL=${MODEL:-var/models/tiny.gguf}
MODEL_NAME=${MODEL_NAME:-tiny}
ENGINE=${ENGINE:-llama}
CLUSTER="outbound|8000||tiny-pool.local"
RUN=var/run
mkdir -p bin "$RUN"

echo "== building (first build of llama.cpp takes a few minutes)"
go build -o bin/ ./metadata-center/cmd/metadata-center ./worker/cmd/worker ./filter/cmd/gateway
[ -f "$MODEL" ] || { echo "== generating $MODEL"; make -s model MODEL="$MODEL"; }

pids=()
stop() {
  trap - EXIT INT TERM
  echo; echo "== stopping"
  kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
}
interrupted=""
trap stop EXIT
trap 'interrupted=1; stop' INT TERM

wait_http() { # url name
  for _ in $(seq 1 300); do
    curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
    sleep 0.2
  done
  echo "$2 did not come up at $1 (logs in $RUN/)" >&2; exit 1
}

./bin/metadata-center --listen "$MC" --store "$STORE" --redis-addr "$REDIS_ADDR" >"$RUN/metadata-center.log" 2>&1 &
pids+=($!)
wait_http "http://$MC/healthz" "metadata center"

hosts=()
for port in $WORKER_PORTS; do
  ./bin/worker --model "$MODEL" --model-name "$MODEL_NAME" --listen "127.0.0.1:$port" --engine "$ENGINE" \
    --metadata-center "http://$MC" --advertise-host "127.0.0.1:$port" --cluster "$CLUSTER" \
    >"$RUN/worker-$port.log" 2>&1 &
  pids+=($!)
  hosts+=("127.0.0.1:$port")
done
for h in "${hosts[@]}"; do wait_http "http://$h/healthz" "worker $h"; done

cfg="$RUN/gateway.yaml"
{
  echo "listen: $GATEWAY"
  echo "filter:"
  echo "  protocol: openai"
  echo "  metadata_center: {address: http://$MC}"
  echo "  model_mapping_rule:"
  echo "    $MODEL_NAME:"
  echo "      - {cluster: \"$CLUSTER\", backend: llamacpp}"
  echo "  lb_mapping_rule:"
  echo "    default: {policy: ${POLICY:-cache_aware}}"
  echo "  endpoints:"
  echo "    static:"
  echo "      \"$CLUSTER\": [$(IFS=,; echo "${hosts[*]}")]"
} >"$cfg"
./bin/gateway --config "$cfg" >"$RUN/gateway.log" 2>&1 &
pids+=($!)
wait_http "http://$GATEWAY/healthz" "gateway"

cat <<EOM

istio-llm-filter is up (logs in $RUN/):
  gateway          http://$GATEWAY   (OpenAI API; policy ${POLICY:-cache_aware})
  metadata center  http://$MC   (store: $STORE)
  workers          ${hosts[*]}   (engine: $ENGINE, model: $MODEL)

Try:
  curl -s http://$GATEWAY/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model":"$MODEL_NAME","messages":[{"role":"user","content":"Hello"}],"max_tokens":16}'

Ctrl-C stops everything.
EOM
# Returns when any component ends: on Ctrl-C they all stop cleanly (status
# 0); a non-zero status means one of them failed on its own.
status=0
wait -n "${pids[@]}" || status=$?
if [ "$status" -ne 0 ] && [ -z "$interrupted" ]; then
  echo "a component exited with status $status; see $RUN/*.log" >&2
fi
