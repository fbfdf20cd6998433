package epp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	mcapi "github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewayfile"
	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewaymetrics"
	"github.com/istio-llm-filter/istio-llm-filter/filter/lifecycle"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/internal/tracing"
)

// BuildOptions are what Build takes besides the file.
type BuildOptions struct {
	Logger     *slog.Logger
	Metrics    gatewaymetrics.Recorder
	Registerer prometheus.Registerer // the balancer's stage histogram; nil: none
	// ConformanceHooks: see Options.ConformanceHooks.
	ConformanceHooks bool
	// IntN replaces the balancer's random source (tests).
	IntN func(int) int
	// Endpoints, if set, is where the pods come from (an InferencePool:
	// poolsource), with PoolName the cluster they answer to, which then
	// takes the requests without a body; filter.endpoints.static, if any,
	// still pins its clusters.
	Endpoints endpoints.Source
	PoolName  string
	// Tracer replaces the tracer of the file's filter.tracing (tests).
	Tracer trace.TracerProvider
}

// TracingService is the picker's service.name in its spans.
const TracingService = "llm-epp"

// Build makes the picker of a fleet file (filter/gatewayfile, the
// standalone gateway's format): its pods are filter.endpoints.static,
// default_cluster takes the requests without a body, and connect_retries
// is the number of fallback pods per request, filter.tracing its spans.
// close drains the lifecycle reports and flushes the spans.
func Build(fc *gatewayfile.File, cfg *config.Config, o BuildOptions) (s *Server, closeFn func(), err error) {
	if len(cfg.Endpoints.Static) == 0 && o.Endpoints == nil {
		return nil, nil, errors.New("filter.endpoints.static: the endpoint picker needs its pods listed (or an InferencePool)")
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	var pinned *endpoints.Static
	if len(cfg.Endpoints.Static) > 0 {
		if pinned, err = endpoints.NewStaticLabelled(cfg.Endpoints.Static, cfg.Endpoints.StaticLabels); err != nil {
			return nil, nil, fmt.Errorf("filter.endpoints.static: %w", err)
		}
	}
	// Static pod lists have no health checks, and a pool's readiness lags a
	// crash: a pod Envoy could not reach is ejected, as the standalone
	// gateway does.
	outlier := endpoints.NewOutlier(endpoints.OutlierOptions{})
	src := outlier.Wrap(endpoints.Layered{Pinned: pinned, Dynamic: o.Endpoints})
	mc, err := routing.MetadataCenter(cfg, nil)
	if err != nil {
		return nil, nil, err
	}
	ro := routing.Options{Endpoints: src, Metrics: o.Metrics, Logger: o.Logger, Registerer: o.Registerer, IntN: o.IntN}
	lo := lifecycle.Options{Metrics: o.Metrics, Logger: o.Logger}
	if mc != nil {
		ro.Querier, lo.Updater = mc, mc // one client: one connection pool
	}
	dec, err := routing.New(cfg, ro)
	if err != nil {
		return nil, nil, err
	}
	lo.Tracker, lo.Checker = dec.Tracker(), dec.Balancer()
	life, err := lifecycle.New(cfg, lo)
	if err != nil {
		return nil, nil, err
	}
	fallbacks := 1
	if fc != nil && fc.ConnectRetries != nil {
		fallbacks = *fc.ConnectRetries
	}
	def := o.PoolName
	if fc != nil && fc.DefaultCluster != "" {
		def = fc.DefaultCluster
	}
	closeTracer := func() {}
	if o.Tracer == nil {
		// The gateway's key and exporter (internal/tracing): one
		// configuration of tracing for the standalone gateway, the .so and
		// the picker.
		tp, err := tracing.New(tracing.Options{Endpoint: cfg.Tracing.OTLPEndpoint, SampleRatio: cfg.Tracing.SampleRatio, Service: TracingService})
		if err != nil {
			life.Close()
			return nil, nil, fmt.Errorf("filter.tracing: %w", err)
		}
		o.Tracer = tp
		closeTracer = func() {
			ctx, cancel := context.WithTimeout(context.Background(), tracing.ShutdownTimeout)
			defer cancel()
			if err := tp.Shutdown(ctx); err != nil {
				o.Logger.Warn("tracing shutdown", "err", err)
			}
		}
	}
	s, err = New(Options{Decider: dec, Reporter: life, Endpoints: src, Outlier: outlier, DefaultCluster: def,
		Fallbacks: fallbacks, ConformanceHooks: o.ConformanceHooks, Metrics: o.Metrics, Tracer: o.Tracer, Logger: o.Logger})
	if err != nil {
		life.Close()
		closeTracer()
		return nil, nil, err
	}
	closeAll := func() { life.Close(); closeTracer() }
	if mc != nil {
		// The metadata center scrapes the signals of the pods we route to
		// (docs/metadata-center.md, "Pod signals"), an InferencePool's too.
		stop := endpoints.StartAnnouncer(endpoints.AnnouncerOptions{Source: src, Clusters: cfg.ScrapedClusters(), Logger: o.Logger,
			Announce: func(ctx context.Context, cluster, backend string, hosts []string) error {
				return mc.AnnouncePods(ctx, mcapi.PodsAnnouncement{Cluster: cluster, Backend: backend, Hosts: hosts})
			}})
		closeAll = func() { stop(); life.Close(); closeTracer() }
	}
	return s, closeAll, nil
}
