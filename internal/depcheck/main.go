package main

import (
	_ "github.com/cncf/xds/go/xds/type/v3"
	_ "github.com/envoyproxy/envoy/contrib/golang/common/go/api"
	_ "github.com/gin-gonic/gin"
	_ "github.com/google/uuid"
	_ "github.com/ollama/ollama/fs/ggml"
	_ "github.com/ollama/ollama/llama"
	_ "github.com/openai/openai-go"
	_ "github.com/prometheus/client_golang/prometheus"
	_ "github.com/redis/go-redis/v9"
	_ "github.com/spaolacci/murmur3"
	_ "sigs.k8s.io/yaml"
)

func main() {}
