# istio-llm-filter — every command README and CI use goes through here.
#
# llama.cpp (vendored by ollama's cgo package) must be built with the host's
# vector instructions: its own flags are plain -O3, which made prefill ~20x
# slower here. Container images override LLMF_MARCH with a portable level.
# Without AMX: on CPUs that have it, -march=native makes ggml-cpu call an AMX
# buffer type whose source ollama's cgo package does not compile (link error).
# scripts/cgo-env.sh and internal/testutil/cgoenv hold the same flags for
# scripts and tests run outside make.
LLMF_MARCH ?= native
LLMF_CGO_FLAGS := -O3 -march=$(LLMF_MARCH) -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
export CGO_CFLAGS   := $(LLMF_CGO_FLAGS)
export CGO_CXXFLAGS := $(LLMF_CGO_FLAGS)

GO       ?= go
BIN      := bin
MODEL    ?= var/models/tiny.gguf
BENCH_MODEL ?= var/models/bench.gguf

.PHONY: run test vet fmt-check model build filter-so envoyhost bench bench-llama chaos soak clean

## run: the main job — metadata center, workers and the standalone gateway on a generated model
run:
	./scripts/run-local.sh

## test: everything CI runs (installs redis-server if missing, starts a private one)
test:
	./scripts/test.sh

vet:
	$(GO) vet ./...

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

## model: the deterministic tiny llama GGUF used by tests and the local stack
model: $(MODEL)
$(MODEL):
	@mkdir -p $(dir $@)
	$(GO) run ./worker/cmd/mkmodel --out $@

build:
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/ ./metadata-center/cmd/metadata-center ./worker/cmd/worker ./filter/cmd/gateway ./filter/cmd/epp ./bench/cmd/vllmsim

## filter-so: the .so Envoy loads (envoy.filters.http.golang)
filter-so:
	@mkdir -p $(BIN)
	$(GO) build -tags envoy -buildmode=c-shared -o $(BIN)/llm-filter.so ./filter/cmd/llm-filter

## envoyhost: the C host that runs the .so with Envoy's golang-filter semantics (envoyhost/, docs/envoy-filter.md)
# api.h comes from the pinned envoy module (downloaded here on a fresh clone),
# so the host's C declarations are the ones the .so was built against.
envoyhost: $(BIN)/envoyhost
$(BIN)/envoyhost: envoyhost/chost/host.c go.mod
	@mkdir -p $(BIN)
	@dir=$$($(GO) mod download -json github.com/envoyproxy/envoy | sed -n 's/^.*"Dir": "\(.*\)",$$/\1/p'); \
	test -n "$$dir" || { echo "envoyhost: cannot locate the envoy module" >&2; exit 1; }; \
	echo "$(CC) ... -I$$dir/contrib/golang/common/go/api -o $@ $<"; \
	$(CC) -std=gnu11 -O2 -g -Wall -Wextra -Werror -Wno-unused-parameter -pthread \
		-I$$dir/contrib/golang/common/go/api -rdynamic -o $@ $< -ldl

## bench: every routing policy side by side on 8 simulated workers (docs/benchmarks.md)
bench: build
	$(GO) run ./bench/cmd/bench --engine sim --workers 8 --rate 2 --kv-cells 8192 --out bench/out/sim

## bench-llama: the same on 3 real llama.cpp workers (0.6 CPU each) with the bench-preset model (~90 min)
bench-llama: build $(BENCH_MODEL)
	./scripts/bench-llama.sh $(BENCH_MODEL) bench/out/llama

## chaos: the fault schedule of docs/operations.md under steady load on real processes (~4 min; docs/operations.md); fails when an aim is missed
chaos: build $(MODEL)
	$(GO) run ./bench/cmd/chaos --model $(MODEL) --out bench/out/chaos

## soak: the chaos topology under steady load for SOAK_DURATION, every process sampled; fails when something grows without bound
SOAK_DURATION ?= 30m
soak: build $(MODEL)
	$(GO) run ./bench/cmd/chaos --soak --duration $(SOAK_DURATION) --model $(MODEL) --out bench/out/soak

$(BENCH_MODEL):
	@mkdir -p $(dir $@)
	$(GO) run ./worker/cmd/mkmodel --preset bench --out $@

clean:
	rm -rf $(BIN) var
