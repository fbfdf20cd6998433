//go:build envoy

package main

import (
	"log/slog"
	"os"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
	envoyhttp "github.com/envoyproxy/envoy/contrib/golang/filters/http/source/go/pkg/http"

	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/filter/llmfilter"
)

// init runs when Envoy dlopens the library. The registry lives here, in the
// process's one main package, so every config Envoy parses (one per xDS
// push) shares one admin poller instead of starting its own.
func init() {
	logger := slog.New(llmfilter.NewEnvoyLogHandler(envoyLog, api.GetLogLevel))
	slog.SetDefault(logger)
	parser := llmfilter.NewParser(llmfilter.ParserOptions{
		Registry:     endpoints.NewRegistry(logger),
		DefaultAdmin: true,
		Logger:       logger,
		Histograms:   defineHistogram,
		// One JSON line per request on stdout, next to Envoy's own access
		// log: Istio runs the proxy at log level warning, which drops
		// info lines of Envoy's log, and a request is not a warning.
		AccessLog: slog.New(slog.NewJSONHandler(os.Stdout, nil)),
	})
	envoyhttp.RegisterHttpFilterFactoryAndConfigParser(llmfilter.Name, llmfilter.Factory, parser)
}

func envoyLog(level api.LogType, msg string) {
	switch level {
	case api.Trace:
		api.LogTrace(msg)
	case api.Debug:
		api.LogDebug(msg)
	case api.Info:
		api.LogInfo(msg)
	case api.Warn:
		api.LogWarn(msg)
	default:
		api.LogError(msg)
	}
}
