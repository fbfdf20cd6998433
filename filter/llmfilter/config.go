// Package llmfilter is the Envoy Go HTTP filter (docs/envoy-filter.md): it buffers the
// request, asks filter/routing where to send it, pins it there with
// SetUpstreamOverrideHost, and reports the request's lifecycle (started,
// first token, cache saved, done) back to filter/lifecycle. The same filter object
// runs inside Envoy (filter/cmd/llm-filter) and in the standalone gateway
// (filter/standalone, filter/cmd/gateway).
//
// Only contrib/golang/common/go/api is imported from Envoy: the cgo shim is
// linked by filter/cmd/llm-filter alone, so this package is testable.
package llmfilter

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"sync"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/config/envoyconfig"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/filter/lifecycle"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/internal/tracing"
	mcapi "github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// Name is the plugin_name the EnvoyFilter refers to.
const Name = "llm-filter"

// ParserOptions are the process-wide things every parsed config shares.
type ParserOptions struct {
	// Registry shares one Envoy-admin poller per admin address among all
	// configs (each xDS push parses a new one). Required for envoy_admin.
	Registry *endpoints.Registry
	// DefaultAdmin polls Envoy's admin at its default address when the
	// config names no endpoint source at all: right inside Envoy, wrong in
	// the standalone gateway.
	DefaultAdmin bool
	// Outlier, if set, hides hosts whose connections failed (the standalone
	// gateway's passive health check; inside Envoy, the admin poller already
	// drops hosts Envoy's own outlier detection ejected).
	Outlier    *endpoints.Outlier
	Logger     *slog.Logger
	HTTPClient *http.Client // metadata-center client; nil: routing.MetadataCenter's default
	// Registerer, if set, gets the balancer's per-stage latency histogram
	// (the standalone gateway's registry; inside Envoy there is none).
	Registerer prometheus.Registerer
	// Histograms defines Envoy histograms (the .so's main package); nil:
	// the Envoy side records no histograms.
	Histograms HistogramDefiner
	// AccessLog receives one record per request ("completed"); nil: Logger.
	AccessLog *slog.Logger
}

// Parser is the api.StreamFilterConfigParser of the plugin.
type Parser struct {
	opts ParserOptions
}

var _ api.StreamFilterConfigParser = (*Parser)(nil)

// NewParser returns a parser; see ParserOptions.
func NewParser(opts ParserOptions) *Parser {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Registry == nil {
		opts.Registry = endpoints.NewRegistry(opts.Logger)
	}
	if opts.AccessLog == nil {
		opts.AccessLog = opts.Logger
	}
	return &Parser{opts: opts}
}

// Parse builds a Config from Envoy's plugin_config. callbacks is nil for
// route-level configs.
func (p *Parser) Parse(a *anypb.Any, callbacks api.ConfigCallbackHandler) (any, error) {
	cfg, err := envoyconfig.Parse(a)
	if err != nil {
		return nil, err
	}
	var m Metrics
	if callbacks != nil {
		m = newEnvoyMetrics(callbacks, cfg, p.opts.Histograms)
	}
	return p.Build(cfg, m)
}

// Merge lets a route-level config replace the listener-level one wholesale:
// merging model rules key by key would make a route's config depend on
// listener settings its author cannot see.
//
// Envoy stores the merge result under its own id and destroys it on its own
// schedule (re-merging when the listener config changes), while the child
// config lives on; so the result is a view that shares the child's decider and reporter
// and whose Destroy leaves it alone.
func (p *Parser) Merge(parent, child any) any {
	cc, ok := child.(*Config)
	if !ok {
		if child == nil {
			return parent
		}
		return child
	}
	if pc, ok := parent.(*Config); ok {
		cc.metrics.adopt(pc.metrics)
	}
	return &Config{cfg: cc.cfg, router: cc.router, life: cc.life, metrics: cc.metrics, log: cc.log, access: cc.access, tracer: cc.tracer, borrowed: true}
}

// Config is one parsed plugin config with its decider and lifecycle reporter. Envoy calls Destroy when
// the config is replaced or removed.
type Config struct {
	cfg     *config.Config
	router  *routing.Decider
	life    *lifecycle.Reporter
	metrics *metricsRef
	log     *slog.Logger
	access  *slog.Logger
	release func()
	tracer  *tracing.Provider
	once    sync.Once
	// borrowed: a Merge view; the config it came from owns the decider and reporter.
	borrowed bool
}

var _ api.Config = (*Config)(nil)

// Build creates the decider and reporter for an already parsed config; m may be nil. The
// standalone gateway calls it with Prometheus metrics.
func (p *Parser) Build(cfg *config.Config, m Metrics) (*Config, error) {
	src, release, err := p.source(cfg)
	if err != nil {
		return nil, err
	}
	if p.opts.Outlier != nil {
		src = p.opts.Outlier.Wrap(src)
	}
	ref := newMetricsRef(m)
	mc, err := routing.MetadataCenter(cfg, p.opts.HTTPClient)
	if err != nil {
		release()
		return nil, err
	}
	ro := routing.Options{Endpoints: src, Metrics: ref, Logger: p.opts.Logger, Registerer: p.opts.Registerer}
	lo := lifecycle.Options{Metrics: ref, Logger: p.opts.Logger}
	if mc != nil {
		ro.Querier, lo.Updater = mc, mc // one client: one connection pool
	}
	router, err := routing.New(cfg, ro)
	if err != nil {
		release()
		return nil, err
	}
	lo.Tracker, lo.Checker = router.Tracker(), router.Balancer()
	life, err := lifecycle.New(cfg, lo)
	if err != nil {
		release()
		return nil, err
	}
	if mc != nil {
		// The metadata center scrapes the signals of the pods we route to
		// (docs/metadata-center.md, "Pod signals").
		stop := endpoints.StartAnnouncer(endpoints.AnnouncerOptions{Source: src, Clusters: cfg.ScrapedClusters(), Logger: p.opts.Logger,
			Announce: func(ctx context.Context, cluster, backend string, hosts []string) error {
				return mc.AnnouncePods(ctx, mcapi.PodsAnnouncement{Cluster: cluster, Backend: backend, Hosts: hosts})
			}})
		releaseSource := release
		release = func() { stop(); releaseSource() }
	}
	tp, err := tracing.New(tracing.Options{Endpoint: cfg.Tracing.OTLPEndpoint, SampleRatio: cfg.Tracing.SampleRatio, Service: TracingService})
	if err != nil {
		life.Close()
		release()
		return nil, err
	}
	return &Config{cfg: cfg, router: router, life: life, metrics: ref, log: p.opts.Logger, access: p.opts.AccessLog, release: release, tracer: tp}, nil
}

func (p *Parser) source(cfg *config.Config) (endpoints.Source, func(), error) {
	noop := func() {}
	var pinned *endpoints.Static
	if len(cfg.Endpoints.Static) > 0 {
		s, err := endpoints.NewStaticLabelled(cfg.Endpoints.Static, cfg.Endpoints.StaticLabels)
		if err != nil {
			return nil, nil, fmt.Errorf("endpoints.static: %w", err)
		}
		pinned = s
	}
	admin := cfg.Endpoints.EnvoyAdmin
	if admin == nil && pinned == nil && p.opts.DefaultAdmin {
		admin = &config.EnvoyAdmin{Address: endpoints.DefaultAdminAddress, Refresh: endpoints.DefaultAdminRefresh}
	}
	if admin == nil {
		return endpoints.Layered{Pinned: pinned}, noop, nil
	}
	poller, release, err := p.opts.Registry.Acquire(admin.Address, admin.Refresh)
	if err != nil {
		return nil, nil, fmt.Errorf("endpoints.envoy_admin: %w", err)
	}
	return endpoints.Layered{Pinned: pinned, Dynamic: poller}, release, nil
}

// Destroy is Envoy's: the config was replaced or removed. It returns at
// once — Envoy calls it on its main thread or on the worker that dropped the
// last stream of the config — after stopping every use of the config's
// Envoy metrics (their handle has already expired: any call would panic).
// The queued metadata-center updates drain on a goroutine of their own,
// within the reporter's drain bound, so no lease is left behind.
func (c *Config) Destroy() {
	if c.borrowed {
		return
	}
	c.once.Do(func() {
		c.metrics.close()
		go c.shutdown()
	})
}

// Close is Destroy for hosts that want to wait for the drain (the
// standalone gateway at exit).
func (c *Config) Close() {
	if c.borrowed {
		return
	}
	c.once.Do(func() {
		c.metrics.close()
		c.shutdown()
	})
}

func (c *Config) shutdown() {
	defer func() {
		if e := recover(); e != nil {
			c.log.Error("llm-filter: panic while closing a config", "panic", e)
		}
	}()
	c.life.Close()
	c.release()
	// The exporter's goroutines end with the config: spans not sent yet
	// get ShutdownTimeout.
	ctx, cancel := context.WithTimeout(context.Background(), tracing.ShutdownTimeout)
	defer cancel()
	if err := c.tracer.Shutdown(ctx); err != nil {
		c.log.Warn("llm-filter: tracing shutdown", "err", err)
	}
}

// TracingService is the gateway's service.name in its spans.
const TracingService = "llm-gateway"

// Factory is the api.StreamFilterFactory of the plugin.
func Factory(c any, callbacks api.FilterCallbackHandler) api.StreamFilter {
	conf, ok := c.(*Config)
	if !ok {
		// Envoy hands whatever Parse returned; anything else is a wiring bug,
		// and passing traffic through unrouted is safer than crashing Envoy.
		slog.Error("llm-filter: unexpected config type; passing requests through", "type", fmt.Sprintf("%T", c))
		return &api.PassThroughStreamFilter{}
	}
	return newFilter(conf, callbacks)
}
