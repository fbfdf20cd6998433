# syntax=docker/dockerfile:1
#
# istio-llm-filter/metadata-center: pure Go (gin, go-redis), built static.
# The runtime base is a pinned Debian slim rather than distroless, whose only
# tags are moving ones (pin it by digest in your registry if you prefer it).
#
#   docker build -f deploy/images/metadata-center.Dockerfile -t istio-llm-filter/metadata-center:0.1.0 .

FROM golang:1.26.8-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ENV CGO_ENABLED=0
RUN go build -trimpath -o /out/metadata-center ./metadata-center/cmd/metadata-center

FROM debian:12.12-slim
COPY --from=build /out/metadata-center /usr/local/bin/metadata-center
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/metadata-center"]
