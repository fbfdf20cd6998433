// Command gateway runs the LLM filter without Envoy: the standalone host
// (filter/standalone) serves the OpenAI API on `listen`, runs the very filter
// Envoy loads from the .so on every request, and proxies to the pod it picks.
//
//	go run ./filter/cmd/gateway --config gateway.yaml
//
// The file (filter/gatewayfile, shared with the endpoint picker filter/cmd/epp)
// holds `listen:` and the filter's document under `filter:`
// (docs/configuration.md), plus optional `log_level` (debug|info|warn|error) and
// `default_cluster` (a static cluster for requests the filter does not route).
// /metrics (Prometheus) and /healthz are answered by the gateway itself.
package main

import (
	"context"
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
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewayfile"
	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewaymetrics"
	"github.com/istio-llm-filter/istio-llm-filter/filter/llmfilter"
	"github.com/istio-llm-filter/istio-llm-filter/filter/standalone"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stderr, nil); err != nil {
		fmt.Fprintln(os.Stderr, "gateway:", err)
		os.Exit(1)
	}
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
	fc, cfg, err := gatewayfile.Load(*path)
	if err != nil {
		return err
	}
	level, _ := fc.Level() // checked by Load
	logger := slog.New(slog.NewTextHandler(logOut, &slog.HandlerOptions{Level: level}))

	reg, pm, err := gatewaymetrics.NewHostRegistry(cfg)
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

	// The static lists are the gateway's clusters. The filter names the
	// routed cluster in x-llm-cluster, as Envoy's route reads it
	// (cluster_header): the request goes only to a member of that cluster,
	// and a request the filter did not route goes to default_cluster.
	fallback, member := staticClusters(cfg.Endpoints.Static, fc.DefaultCluster, outlier.Ejected)
	// eject counts one failure of a pod not ejected yet (a failed
	// connection is reported at once and again when its stream ends).
	eject := func(host, msg string) {
		if !outlier.Ejected(host) {
			outlier.Failed(host)
			logger.Warn(msg, "upstream", host)
		}
	}
	host, err := standalone.New(standalone.Options{
		ClusterHeader:  headers.Cluster,
		Fallback:       fallback,
		Member:         member,
		Factory:        llmfilter.Factory,
		Config:         conf,
		MaxRequestBody: int64(cfg.MaxBodyBytes),
		Logger:         logger,
		ConnectRetries: *fc.ConnectRetries,
		// Ejected at the failed connection, not at the stream's end: the
		// requests routed meanwhile, and this one's retry, avoid the pod.
		ConnectFailed: func(host string) { eject(host, "upstream ejected after a failed connection") },
		Observe: func(o standalone.Outcome) {
			requests.WithLabelValues(strconv.Itoa(o.Status), strconv.FormatBool(o.Local)).Inc()
			duration.Observe(o.Duration.Seconds())
			switch {
			case o.Upstream == "":
			case o.UpstreamFailed:
				eject(o.Upstream, "upstream ejected after a failed request")
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

// staticClusters is the route and the clusters of the standalone gateway:
// fallback picks a pod of the request's cluster (default_cluster when the
// filter named none) round robin, like a cluster's load balancer, skipping
// pods ejected (outlier detection) unless all are, as Envoy's panic
// threshold does; member tells whether a pod belongs to the cluster. An
// unknown cluster has no members, so its requests get 503 like Envoy's
// cluster_not_found. member is nil without static lists (every host is then
// a member).
func staticClusters(static map[string][]string, def string, ejected func(string) bool) (func(*http.Request, string) string, func(string, string) bool) {
	if len(static) == 0 {
		return nil, nil
	}
	members := map[string]map[string]bool{}
	next := map[string]*atomic.Uint64{}
	for c, pods := range static {
		members[c] = map[string]bool{}
		for _, p := range pods {
			members[c][p] = true
		}
		next[c] = new(atomic.Uint64)
	}
	fallback := func(_ *http.Request, cluster string) string {
		if cluster == "" {
			cluster = def
		}
		pods := static[cluster]
		if len(pods) == 0 {
			return ""
		}
		first := next[cluster].Add(1) - 1
		for i := range uint64(len(pods)) {
			if p := pods[(first+i)%uint64(len(pods))]; ejected == nil || !ejected(p) {
				return p
			}
		}
		return pods[first%uint64(len(pods))]
	}
	member := func(cluster, host string) bool {
		if cluster == "" {
			cluster = def
		}
		return members[cluster][host]
	}
	return fallback, member
}
