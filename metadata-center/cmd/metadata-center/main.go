// Command metadata-center serves the metadata-center API v1 (load leases
// and the prefix-cache index) on an embedded in-memory store or on Redis.
//
//	metadata-center --listen 127.0.0.1:8080 --store memory
//	metadata-center --listen 0.0.0.0:8080 --store redis --redis-addr redis:6379 --auth-token T
//	metadata-center --store redis --redis-cluster --redis-addr redis-0:6379,redis-1:6379
//
// It stops gracefully on SIGTERM or SIGINT: in-flight requests finish,
// then the store is closed.
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
	"syscall"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/podsignals"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
)

// Environment variables that stand in for flags carrying secrets, so
// they need not appear in a process list or a manifest's args.
const (
	envAuthToken     = "LLMF_MC_AUTH_TOKEN"
	envRedisPassword = "LLMF_MC_REDIS_PASSWORD"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stderr, nil); err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "metadata-center:", err)
		}
		os.Exit(2)
	}
}

type config struct {
	listen, storeKind, logLevel             string
	redisAddr, redisPassword, redisPrefix   string
	redisDB                                 int
	redisCluster                            bool
	redisDialTimeout, redisIOTimeout        time.Duration
	authToken                               string
	leaseTTL, cacheTTL                      time.Duration
	maxEntries                              int
	maxBodyBytes                            int64
	storeTimeout, shutdownTimeout, touchInt time.Duration
	signalMaxAge                            time.Duration
	scrapeConfig                            string
	scrapeInterval, scrapeTimeout           time.Duration
}

func parse(args []string, stderr io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("metadata-center", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.listen, "listen", "127.0.0.1:8080", "address to serve the API on")
	fs.StringVar(&c.storeKind, "store", "memory", "store: memory (embedded, one replica) or redis (shared by replicas)")
	fs.StringVar(&c.redisAddr, "redis-addr", "127.0.0.1:6379", "redis-server host:port (--store redis); with --redis-cluster a comma-separated seed list")
	fs.BoolVar(&c.redisCluster, "redis-cluster", false, "--redis-addr names nodes of a Redis Cluster (the rest are discovered)")
	fs.StringVar(&c.redisPassword, "redis-password", os.Getenv(envRedisPassword), "Redis password (default $"+envRedisPassword+")")
	fs.IntVar(&c.redisDB, "redis-db", 0, "Redis database number")
	fs.StringVar(&c.redisPrefix, "redis-key-prefix", redisstore.DefaultKeyPrefix, "prefix of every Redis key (share one Redis between deployments)")
	fs.DurationVar(&c.redisDialTimeout, "redis-dial-timeout", redisstore.DefaultDialTimeout, "Redis connect timeout")
	fs.DurationVar(&c.redisIOTimeout, "redis-io-timeout", redisstore.DefaultIOTimeout, "Redis read/write timeout")
	fs.StringVar(&c.authToken, "auth-token", os.Getenv(envAuthToken), "bearer token required on every call but the probes and /metrics (default $"+envAuthToken+"; empty: no auth)")
	fs.DurationVar(&c.leaseTTL, "lease-ttl", store.DefaultLeaseTTL, "lifetime of a request lease that is never deleted (dead gateway)")
	fs.DurationVar(&c.cacheTTL, "cache-ttl", store.DefaultCacheTTL, "lifetime of a cache index entry since its last save or hit")
	fs.DurationVar(&c.touchInt, "cache-touch-interval", time.Second, "hits refresh an entry's TTL at most this often")
	fs.DurationVar(&c.signalMaxAge, "signal-max-age", store.DefaultSignalMaxAge, "pods' reports (pushed or scraped) older than this are not answered")
	fs.StringVar(&c.scrapeConfig, "scrape-config", "", "the scrape configuration file: per routing cluster its backend (vllm, sglang or llamacpp) and pods, whose /metrics are scraped for pod signals (podsignals.Config), besides the pods gateways announce")
	fs.DurationVar(&c.scrapeInterval, "scrape-interval", podsignals.DefaultInterval, "how often third-party pods' /metrics are scraped")
	fs.DurationVar(&c.scrapeTimeout, "scrape-timeout", 0, "bound on one scrape (0: the interval)")
	fs.IntVar(&c.maxEntries, "max-entries", memstore.DefaultMaxEntries, "LRU cap on cache index entries (--store memory)")
	fs.Int64Var(&c.maxBodyBytes, "max-body-bytes", server.DefaultMaxBodyBytes, "largest request body accepted")
	fs.DurationVar(&c.storeTimeout, "store-timeout", server.DefaultStoreTimeout, "bound on each store call; past it the call answers 503")
	fs.DurationVar(&c.shutdownTimeout, "shutdown-timeout", 10*time.Second, "how long in-flight requests may take to finish on SIGTERM")
	fs.StringVar(&c.logLevel, "log-level", "info", "debug, info, warn or error")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if c.storeKind != "memory" && c.storeKind != "redis" {
		return c, fmt.Errorf("--store %q: want memory or redis", c.storeKind)
	}
	if c.redisCluster && c.storeKind != "redis" {
		return c, errors.New("--redis-cluster needs --store redis")
	}
	if c.redisCluster && c.redisDB != 0 {
		return c, errors.New("--redis-db: a Redis Cluster has only database 0")
	}
	return c, nil
}

func newStore(c config) (store.Store, error) {
	if c.storeKind == "redis" {
		return redisstore.New(redisstore.Options{
			Addr: c.redisAddr, Cluster: c.redisCluster, Password: c.redisPassword, DB: c.redisDB, KeyPrefix: c.redisPrefix,
			LeaseTTL: c.leaseTTL, CacheTTL: c.cacheTTL, TouchInterval: c.touchInt, SignalMaxAge: c.signalMaxAge,
			DialTimeout: c.redisDialTimeout, IOTimeout: c.redisIOTimeout,
		})
	}
	return memstore.New(memstore.Options{
		LeaseTTL: c.leaseTTL, CacheTTL: c.cacheTTL, TouchInterval: c.touchInt, MaxEntries: c.maxEntries,
		SignalMaxAge: c.signalMaxAge,
	}), nil
}

// run serves until ctx is done, then shuts down gracefully. onListen, if
// set, learns the bound address (tests listen on port 0).
func run(ctx context.Context, args []string, stderr io.Writer, onListen func(net.Addr)) error {
	c, err := parse(args, stderr)
	if err != nil {
		return err
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.logLevel)); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	log := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level}))
	gin.SetMode(gin.ReleaseMode)

	st, err := newStore(c)
	if err != nil {
		return err
	}
	defer st.Close()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	// The pods to scrape: those --scrape-config lists and those gateways
	// announce (docs/metadata-center.md, "Pod signals").
	discovered := podsignals.NewDiscovered()
	srv := server.New(st, server.Options{
		AuthToken: c.authToken, Logger: log, Registry: reg,
		MaxBodyBytes: c.maxBodyBytes, StoreTimeout: c.storeTimeout,
		Discovered: discovered,
	})

	var static []podsignals.Target
	if c.scrapeConfig != "" {
		doc, err := os.ReadFile(c.scrapeConfig)
		if err != nil {
			return fmt.Errorf("--scrape-config: %w", err)
		}
		static, err = podsignals.ParseTargets(doc)
		if err != nil {
			return fmt.Errorf("--scrape-config %s: %w", c.scrapeConfig, err)
		}
	}
	sc, err := podsignals.New(podsignals.Options{Store: st.Parts().Signals,
		Targets:  &podsignals.Fleet{Static: static, Discovered: discovered, Registry: st.Parts().Registry, Timeout: c.storeTimeout, Logger: log},
		Interval: c.scrapeInterval, Timeout: c.scrapeTimeout, Logger: log, Registerer: reg})
	if err != nil {
		return err
	}
	scrapeCtx, stopScrape := context.WithCancel(ctx)
	scraped := make(chan struct{})
	go func() { sc.Run(scrapeCtx); close(scraped) }()
	defer func() { stopScrape(); <-scraped }()
	log.Info("scraping pods' /metrics for their signals", "listed_pods", len(static), "interval", c.scrapeInterval.String())

	ln, err := net.Listen("tcp", c.listen)
	if err != nil {
		return err
	}
	hs := &http.Server{
		Handler:           srv.Handler(),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	log.Info("metadata center listening", "addr", ln.Addr().String(), "store", c.storeKind,
		"auth", c.authToken != "", "lease_ttl", c.leaseTTL.String(), "cache_ttl", c.cacheTTL.String())
	if c.storeKind == "redis" {
		log.Info("using redis", "addr", c.redisAddr, "cluster", c.redisCluster, "key_prefix", c.redisPrefix)
		pctx, cancel := context.WithTimeout(ctx, c.storeTimeout)
		if err := st.Parts().Health.Ping(pctx); err != nil {
			// Not fatal: /readyz reports it and the client reconnects by itself.
			log.Warn("redis not reachable yet", "err", err)
		}
		cancel()
	}
	if onListen != nil {
		onListen(ln.Addr())
	}

	served := make(chan error, 1)
	go func() { served <- hs.Serve(ln) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	log.Info("shutting down", "grace", c.shutdownTimeout.String())
	sctx, cancel := context.WithTimeout(context.Background(), c.shutdownTimeout)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil {
		return fmt.Errorf("shutdown: %w", err)
	}
	if err := <-served; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	log.Info("stopped")
	return nil
}
