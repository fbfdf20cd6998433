# syntax=docker/dockerfile:1
#
# istio-llm-filter/epp: the endpoint picker (filter/cmd/epp), the gateway's
# decision as an ext_proc gRPC service for any Gateway API Inference
# Extension gateway (Istio's InferencePool support, Envoy Gateway, kgateway)
# on the stock proxy image. Pure Go, built static; no Envoy SDK, so it does
# not depend on the gateway's Envoy release.
#
#   docker build -f deploy/images/epp.Dockerfile -t istio-llm-filter/epp:0.1.0 .

FROM golang:1.26.8-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ENV CGO_ENABLED=0
RUN go build -trimpath -o /out/epp ./filter/cmd/epp

FROM debian:12.12-slim
COPY --from=build /out/epp /usr/local/bin/epp
USER 65532:65532
# 9002: ext_proc and gRPC health (the Inference Extension's default port);
# 9090: /metrics and /healthz.
EXPOSE 9002 9090
ENTRYPOINT ["/usr/local/bin/epp"]
