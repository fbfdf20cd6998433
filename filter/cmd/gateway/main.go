// Command gateway runs the LLM filter without Envoy: the standalone host
// (filter/standalone) serves the OpenAI API on `listen`, runs the very filter
// Envoy loads from the .so on every request, and proxies to the pod it picks.
//
//	go run ./filter/cmd/gateway --config gateway.yaml
//
// The file holds `listen:` and the filter's document under `filter:`
// (DESIGN §9), plus optional `log_level` (debug|info|warn|error) and
// `default_cluster` (a static cluster for requests the filter does not route).
// /metrics (Prometheus) and /healthz are answered by the gateway itself.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"sigs.k8s.io/yaml"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/filter/llmfilter"
	"github.com/istio-llm-filter/istio-llm-filter/filter/standalone"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stderr, nil); err != nil {
		fmt.Fprintln(os.Stderr, "gateway:", err)
		os.Exit(1)
	}
}

// fileConfig is the gateway's YAML file.
type fileConfig struct {
	Listen   string `json:"listen"`
	LogLevel string `json:"log_level"`
	// DefaultCluster names a cluster of filter.endpoints.static whose pods
	// take, round robin, the requests the filter does not route (no body:
	// GET /v1/models, health checks), as the route's cluster would in Envoy.
	DefaultCluster string          `json:"default_cluster"`
	Filter         json.RawMessage `json:"filter"`
}

func loadConfig(path string) (*fileConfig, *config.Config, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, err
	}
	j, err := yaml.YAMLToJSON(raw)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: not valid YAML: %w", path, err)
	}
	var fc fileConfig
	dec := json.NewDecoder(bytes.NewReader(j))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&fc); err != nil {
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	if fc.Listen == "" {
		fc.Listen = "127.0.0.1:8000"
	}
	if len(fc.Filter) == 0 || string(fc.Filter) == "null" {
		return nil, nil, fmt.Errorf("%s: filter: missing", path)
	}
	cfg, err := config.Parse(fc.Filter)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: filter.%w", path, err)
	}
	if fc.DefaultCluster != "" {
		if _, ok := cfg.Endpoints.Static[fc.DefaultCluster]; !ok {
			return nil, nil, fmt.Errorf("%s: default_cluster: %q is not listed under filter.endpoints.static", path, fc.DefaultCluster)
		}
	}
	return &fc, cfg, nil
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if s == "" {
		return slog.LevelInfo, nil
	}
	err := l.UnmarshalText([]byte(s))
	return l, err
}

// run serves until ctx ends. ready, if not nil, receives the bound address.
func run(ctx context.Context, args []string, logOut io.Writer, ready chan<- net.Addr) error {
	fs := flag.NewFlagSet("gateway", flag.ContinueOnError)
	fs.SetOutput(logOut)
	path := fs.String("config", "", "gateway YAML file (listen:, filter:)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *path == "" {
		return errors.New("--config FILE is required")
	}
	fc, cfg, err := loadConfig(*path)
	if err != nil {
		return err
	}
	level, err := parseLevel(fc.LogLevel)
	if err != nil {
		return fmt.Errorf("log_level: %w", err)
	}
	logger := slog.New(slog.NewTextHandler(logOut, &slog.HandlerOptions{Level: level}))

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	pm, err := llmfilter.NewPromMetrics(reg)
	if err != nil {
		return err
	}
	requests := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "llm_gateway_requests_total", Help: "Requests by status code and whether the gateway answered itself.",
	}, []string{"code", "local"})
	duration := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "llm_gateway_request_duration_seconds", Help: "Request duration until the last response byte.",
		Buckets: prometheus.ExponentialBuckets(0.005, 2, 14),
	})
	reg.MustRegister(requests, duration)

	// Static pod lists have no health checks: eject a pod whose connection
	// failed, as Envoy's outlier detection would, so a dead worker stops
	// being chosen until it answers again.
	outlier := endpoints.NewOutlier(endpoints.OutlierOptions{})
	parser := llmfilter.NewParser(llmfilter.ParserOptions{Registry: endpoints.NewRegistry(logger), Outlier: outlier, Logger: logger, Registerer: reg})
	conf, err := parser.Build(cfg, pm)
	if err != nil {
		return err
	}
	defer conf.Close()

	var fallback func(*http.Request) string
	if fc.DefaultCluster != "" {
		pods := cfg.Endpoints.Static[fc.DefaultCluster]
		var next atomic.Uint64
		fallback = func(*http.Request) string {
			if len(pods) == 0 {
				return ""
			}
			return pods[(next.Add(1)-1)%uint64(len(pods))]
		}
	}
	// The pods the gateway knows form its clusters: like Envoy it sends a
	// request only to a member, whatever host the filter names.
	var member func(*http.Request, string) bool
	if len(cfg.Endpoints.Static) > 0 {
		members := map[string]bool{}
		for _, pods := range cfg.Endpoints.Static {
			for _, p := range pods {
				members[p] = true
			}
		}
		member = func(_ *http.Request, host string) bool { return members[host] }
	}
	host, err := standalone.New(standalone.Options{
		Fallback:       fallback,
		Member:         member,
		Factory:        llmfilter.Factory,
		Config:         conf,
		MaxRequestBody: int64(cfg.MaxBodyBytes),
		Logger:         logger,
		Observe: func(o standalone.Outcome) {
			requests.WithLabelValues(strconv.Itoa(o.Status), strconv.FormatBool(o.Local)).Inc()
			duration.Observe(o.Duration.Seconds())
			switch {
			case o.Upstream == "":
			case o.UpstreamFailed:
				outlier.Failed(o.Upstream)
				logger.Warn("upstream ejected after a failed connection", "upstream", o.Upstream)
			case !o.Local:
				outlier.Succeeded(o.Upstream)
			}
		},
	})
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	mux.Handle("/", host)

	ln, err := net.Listen("tcp", fc.Listen)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(logger.Handler(), slog.LevelWarn)}
	logger.Info("gateway listening", "addr", ln.Addr().String(), "metadata_center", cfg.MetadataCenter.Address)
	if ready != nil {
		ready <- ln.Addr()
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	shutCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutCtx); err != nil {
		return err
	}
	return nil
}
