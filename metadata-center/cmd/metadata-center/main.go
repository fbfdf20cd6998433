// Command metadata-center serves the metadata-center API v1 (load leases
// and the prefix-cache index) on an embedded in-memory store or on Redis.
//
//	metadata-center --listen 127.0.0.1:8080 --store memory
//	metadata-center --listen 0.0.0.0:8080 --store redis --redis-addr redis:6379 --auth-token T
//	metadata-center --store redis --redis-cluster --redis-addr redis-0:6379,redis-1:6379
//	metadata-center --tls-cert-file tls.crt --tls-key-file tls.key --auth-token-file /etc/mc-auth/token \
//	    --store redis --redis-addr redis.example:6380 --redis-tls --redis-tls-ca-file ca.crt \
//	    --redis-username mc --redis-password-file /etc/redis-auth/password
//
// It stops gracefully on SIGTERM or SIGINT: in-flight requests finish,
// then the store is closed.
package main

import (
	"context"
	"crypto/tls"
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

	"github.com/istio-llm-filter/istio-llm-filter/internal/secretfile"
	"github.com/istio-llm-filter/istio-llm-filter/internal/tracing"
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
	redisUsername, redisPasswordFile        string
	redisTLS                                bool
	redisTLSCAFile, redisTLSServerName      string
	authToken, authTokenFile                string
	authTokenGrace                          time.Duration
	tlsCertFile, tlsKeyFile                 string
	reloadInterval                          time.Duration
	leaseTTL, cacheTTL                      time.Duration
	maxEntries                              int
	maxBodyBytes                            int64
	storeTimeout, shutdownTimeout, touchInt time.Duration
	signalMaxAge                            time.Duration
	scrapeConfig                            string
	scrapeInterval, scrapeTimeout           time.Duration
	tracing                                 tracing.Options
}

func parse(args []string, stderr io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("metadata-center", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.listen, "listen", "127.0.0.1:8080", "address to serve the API on")
	fs.StringVar(&c.storeKind, "store", "memory", "store: memory (embedded, one replica) or redis (shared by replicas)")
	fs.StringVar(&c.redisAddr, "redis-addr", "127.0.0.1:6379", "redis-server host:port (--store redis); with --redis-cluster a comma-separated seed list")
	fs.BoolVar(&c.redisCluster, "redis-cluster", false, "--redis-addr names nodes of a Redis Cluster (the rest are discovered)")
	fs.StringVar(&c.redisUsername, "redis-username", "", "Redis ACL user (empty: the default user)")
	fs.StringVar(&c.redisPassword, "redis-password", os.Getenv(envRedisPassword), "Redis password (default $"+envRedisPassword+")")
	fs.StringVar(&c.redisPasswordFile, "redis-password-file", "", "file holding the Redis password, read again at each new connection once it changed (instead of --redis-password)")
	fs.BoolVar(&c.redisTLS, "redis-tls", false, "talk TLS to Redis (a managed Redis with in-transit encryption)")
	fs.StringVar(&c.redisTLSCAFile, "redis-tls-ca-file", "", "PEM CA certificates Redis's certificate is verified against (implies --redis-tls; empty: the system's roots)")
	fs.StringVar(&c.redisTLSServerName, "redis-tls-server-name", "", "name Redis's certificate must carry (implies --redis-tls; empty: the host of --redis-addr)")
	fs.IntVar(&c.redisDB, "redis-db", 0, "Redis database number")
	fs.StringVar(&c.redisPrefix, "redis-key-prefix", redisstore.DefaultKeyPrefix, "prefix of every Redis key (share one Redis between deployments)")
	fs.DurationVar(&c.redisDialTimeout, "redis-dial-timeout", redisstore.DefaultDialTimeout, "Redis connect timeout")
	fs.DurationVar(&c.redisIOTimeout, "redis-io-timeout", redisstore.DefaultIOTimeout, "Redis read/write timeout")
	fs.StringVar(&c.authToken, "auth-token", os.Getenv(envAuthToken), "bearer token required on every call but the probes and /metrics (default $"+envAuthToken+"; empty: no auth)")
	fs.StringVar(&c.authTokenFile, "auth-token-file", "", "file listing the accepted bearer tokens one per line, re-read when it changes (instead of --auth-token; absent or empty file: no auth)")
	fs.DurationVar(&c.authTokenGrace, "auth-token-grace", 2*time.Minute, "after --auth-token-file changes, the tokens it held before stay accepted this long")
	fs.StringVar(&c.tlsCertFile, "tls-cert-file", "", "PEM certificate (chain) to serve HTTPS with, re-read when it changes (with --tls-key-file; empty: plain HTTP)")
	fs.StringVar(&c.tlsKeyFile, "tls-key-file", "", "PEM private key of --tls-cert-file")
	fs.DurationVar(&c.reloadInterval, "reload-interval", secretfile.DefaultEvery, "how often the token, password and certificate files are looked at for changes")
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
	c.tracing.RegisterFlags(fs)
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if err := c.tracing.Validate(); err != nil {
		return c, fmt.Errorf("--otlp-endpoint/--trace-sample-ratio: %w", err)
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
	if c.authToken != "" && c.authTokenFile != "" {
		return c, errors.New("--auth-token and --auth-token-file: set one")
	}
	if c.redisPasswordFile != "" && c.redisPassword != "" {
		return c, errors.New("--redis-password and --redis-password-file: set one")
	}
	if (c.tlsCertFile == "") != (c.tlsKeyFile == "") {
		return c, errors.New("--tls-cert-file and --tls-key-file go together")
	}
	c.redisTLS = c.redisTLS || c.redisTLSCAFile != "" || c.redisTLSServerName != ""
	return c, nil
}

func newStore(c config, log *slog.Logger) (store.Store, error) {
	if c.storeKind == "redis" {
		o := redisstore.Options{
			Addr: c.redisAddr, Cluster: c.redisCluster, Username: c.redisUsername, Password: c.redisPassword,
			DB: c.redisDB, KeyPrefix: c.redisPrefix,
			LeaseTTL: c.leaseTTL, CacheTTL: c.cacheTTL, TouchInterval: c.touchInt, SignalMaxAge: c.signalMaxAge,
			DialTimeout: c.redisDialTimeout, IOTimeout: c.redisIOTimeout,
		}
		if c.redisPasswordFile != "" {
			pw, err := secretfile.Password(c.redisPasswordFile, secretfile.Options[string]{Every: c.reloadInterval,
				OnChange: func(_, _ string) {
					log.Info("redis password file changed; new connections use it", "file", c.redisPasswordFile)
				},
				OnError: func(err error) { log.Warn("redis password file not taken; keeping the last one", "err", err) },
			})
			if err != nil {
				return nil, fmt.Errorf("--redis-password-file: %w", err)
			}
			user := c.redisUsername
			o.Credentials = func() (string, string) { return user, pw.Get() }
		}
		if c.redisTLS {
			tc, err := secretfile.ClientTLS(c.redisTLSCAFile, c.redisTLSServerName, false)
			if err != nil {
				return nil, fmt.Errorf("--redis-tls-ca-file: %w", err)
			}
			o.TLS = tc
		}
		return redisstore.New(o)
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

	tokens, err := authTokens(c, log)
	if err != nil {
		return err
	}
	var serverTLS *tls.Config
	if c.tlsCertFile != "" {
		serverTLS, err = secretfile.ServerTLS(c.tlsCertFile, c.tlsKeyFile, secretfile.Options[*tls.Certificate]{Every: c.reloadInterval,
			OnChange: func(_, _ *tls.Certificate) {
				log.Info("TLS certificate changed; new connections get it", "file", c.tlsCertFile)
			},
			OnError: func(err error) { log.Warn("TLS certificate not taken; keeping the last one", "err", err) },
		})
		if err != nil {
			return fmt.Errorf("--tls-cert-file: %w", err)
		}
	}
	st, err := newStore(c, log)
	if err != nil {
		return err
	}
	defer st.Close()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	// The pods to scrape: those --scrape-config lists and those gateways
	// announce (docs/metadata-center.md, "Pod signals").
	discovered := podsignals.NewDiscovered()
	so := server.Options{
		AuthToken: c.authToken, Logger: log, Registry: reg,
		MaxBodyBytes: c.maxBodyBytes, StoreTimeout: c.storeTimeout,
		Discovered: discovered,
	}
	if tokens != nil {
		so.Tokens = tokens
	}
	c.tracing.Service = "llm-metadata-center"
	tp, err := tracing.New(c.tracing)
	if err != nil {
		return err
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), tracing.ShutdownTimeout)
		defer cancel()
		_ = tp.Shutdown(ctx)
	}()
	if tp.Enabled() {
		so.Tracer = tp
	}
	srv := server.New(st, so)

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
	if serverTLS != nil {
		ln = tls.NewListener(ln, serverTLS)
	}
	hs := &http.Server{
		Handler:           srv.Handler(),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	log.Info("metadata center listening", "addr", ln.Addr().String(), "store", c.storeKind, "tls", serverTLS != nil,
		"auth", c.authToken != "" || tokens != nil && tokens.Enabled(), "lease_ttl", c.leaseTTL.String(), "cache_ttl", c.cacheTTL.String())
	if c.storeKind == "redis" {
		log.Info("using redis", "addr", c.redisAddr, "cluster", c.redisCluster, "key_prefix", c.redisPrefix,
			"tls", c.redisTLS, "username", c.redisUsername)
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

// authTokens watches --auth-token-file; nil without it.
func authTokens(c config, log *slog.Logger) (*secretfile.Tokens, error) {
	if c.authTokenFile == "" {
		return nil, nil
	}
	t, err := secretfile.ServerTokens(c.authTokenFile, c.authTokenGrace, secretfile.Options[[]string]{Every: c.reloadInterval,
		OnChange: func(old, cur []string) {
			log.Info("auth token file changed", "file", c.authTokenFile, "tokens", len(cur),
				"previous_accepted_for", c.authTokenGrace.String())
			if len(cur) == 0 {
				log.Warn("auth token file holds no token: authentication is off", "file", c.authTokenFile)
			}
		},
		OnError: func(err error) { log.Warn("auth token file not taken; keeping the last tokens", "err", err) },
	})
	if err != nil {
		return nil, fmt.Errorf("--auth-token-file: %w", err)
	}
	if !t.Enabled() {
		log.Warn("auth token file absent or empty: authentication is off until it holds a token", "file", c.authTokenFile)
	}
	return t, nil
}
