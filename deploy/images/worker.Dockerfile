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
# builder's), so it targets x86-64-v3 (AVX2, FMA: every x86 server since
# 2013-2015). Override LLMF_MARCH for older fleets (x86-64-v2) at a large
# speed cost.

FROM golang:1.26.8-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG LLMF_MARCH=x86-64-v3
ENV CGO_ENABLED=1 \
    GOAMD64=v3 \
    CGO_CFLAGS="-O3 -march=${LLMF_MARCH}" \
    CGO_CXXFLAGS="-O3 -march=${LLMF_MARCH}"
RUN go build -trimpath -o /out/ ./worker/cmd/worker ./worker/cmd/mkmodel

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
