# syntax=docker/dockerfile:1
#
# istio-llm-filter/worker: the llama.cpp OpenAI worker, plus mkmodel (the
# deterministic tiny-model generator the default deployment's init container
# runs, so the stack needs no model download).
#
#   docker build -f deploy/images/worker.Dockerfile -t istio-llm-filter/worker:0.1.0 .
#
# llama.cpp is compiled here through cgo (ollama's vendored copy). Its own
# flags are plain -O3, which without vector instructions made prefill ~20x
# slower; the image cannot use -march=native (it runs on other CPUs than the
# builder's), so it takes the level as a build argument (LLMF_MARCH below):
#
#   docker build --build-arg LLMF_MARCH=x86-64-v3 -f deploy/images/worker.Dockerfile ...
#   docker buildx build --platform linux/arm64 -f deploy/images/worker.Dockerfile ...

FROM golang:1.26.8-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# LLMF_MARCH: the instruction-set level the C/C++ code is compiled for
# (-march, through scripts/cgo-env.sh: the flags make and the tests use).
# Empty: the portable baseline of the target architecture, x86-64-v2 on
# amd64 (SSE4.2, POPCNT: any x86-64 server of the last 15 years) and
# armv8-a on arm64. A fleet known to have more can ask for it, e.g.
# --build-arg LLMF_MARCH=x86-64-v3 (AVX2, FMA: several times faster
# prefill). GOAMD64 follows an x86-64-vN level. arm64 images are built on
# arm64 (a native builder or emulation), not cross-compiled. deploy/'s tests
# check the flags each platform gets; the project itself is built and run
# on x86-64 only.
ARG TARGETARCH
ARG LLMF_MARCH=
ENV CGO_ENABLED=1
RUN march="${LLMF_MARCH:-$(if [ "$TARGETARCH" = arm64 ]; then echo armv8-a; else echo x86-64-v2; fi)}" \
 && case "$march" in x86-64-v[234]) export GOAMD64="v${march#x86-64-v}" ;; esac \
 && export LLMF_MARCH="$march" && . ./scripts/cgo-env.sh \
 && go build -trimpath -o /out/ ./worker/cmd/worker ./worker/cmd/mkmodel

# Same Debian release as the builder: the binary links glibc and libstdc++
# dynamically and needs no newer versions than these.
FROM debian:12.12-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends libstdc++6 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/worker /out/mkmodel /usr/local/bin/
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["/usr/local/bin/worker"]
