# syntax=docker/dockerfile:1
#
# istio-llm-filter/gateway: Istio's proxy with the LLM filter's .so added.
#
#   docker build -f deploy/images/gateway.Dockerfile -t istio-llm-filter/gateway:0.1.0 .
#
# Version pairing (docs/operations.md): the .so is built against the Envoy Go
# SDK pinned in go.mod (github.com/envoyproxy/envoy v1.36.x) and must be loaded
# by an Envoy of the same minor release. Istio 1.28.x ships Envoy 1.36.x, so
# the base is istio/proxyv2:1.28.x, and it must equal the control plane's
# Istio release. Upgrading Istio means bumping the SDK in go.mod and this FROM
# together; the check in the last stage refuses a mismatched pair.
#
# glibc: proxyv2 (default flavour) is Ubuntu 24.04, glibc 2.39; the
# distroless flavour is Wolfi, newer. The builder is Debian 12 (glibc 2.36),
# so the .so never asks for a newer glibc than the proxy has; the first stage
# checks that too. Do not build on a newer distribution than the proxy.

FROM golang:1.26.8-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# The image must run on any node of the cluster: a portable level, not
# -march=native. The filter has little C of its own; this keeps the flags
# identical to the worker image's.
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
 && go build -trimpath -tags envoy -buildmode=c-shared \
      -o /out/llm-filter.so ./filter/cmd/llm-filter
# Envoy dlsym()s a fixed list of envoyGo* entry points and refuses the
# library if one is missing; a build that lost the registration (wrong tag,
# wrong package) must fail here, not at listener load time in production.
# The script holds the list for the pinned Envoy release.
RUN ./scripts/check-filter-so.sh /out/llm-filter.so
# The highest glibc symbol version the .so needs must not exceed the proxy's.
RUN need=$(objdump -T /out/llm-filter.so | grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -n1) \
 && printf '%s\n' "$need" GLIBC_2.39 | sort -V -C \
 || { echo "llm-filter.so needs $need, newer than proxyv2's glibc 2.39" >&2; exit 1; }

FROM istio/proxyv2:1.28.3
# Refuse a base whose Envoy is not the SDK's release line (1.36).
RUN /usr/local/bin/envoy --version | grep -Eq '/1\.36\.[0-9]+' \
 || { /usr/local/bin/envoy --version >&2; echo "proxyv2 does not ship Envoy 1.36" >&2; exit 1; }
COPY --from=build /out/llm-filter.so /usr/local/lib/istio-llm-filter/llm-filter.so
# istio-proxy, the user the gateway injection template runs the proxy as.
USER 1337:1337
