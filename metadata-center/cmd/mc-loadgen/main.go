// Command mc-loadgen is the load run: POST /v1/route/query at a
// fixed concurrency over loopback, reporting throughput and latency
// quantiles. It is bounded in requests and in time, prints progress, and
// refuses non-loopback targets.
//
// Against a running metadata center:
//
//	mc-loadgen --addr http://127.0.0.1:8080 --concurrency 64 --requests 200000 --duration 30s
//
// Or side by side on both stores, each served in process on a loopback port:
//
//	mc-loadgen --stores memory,redis --redis-addr 127.0.0.1:6379
//	mc-loadgen --stores redis-cluster --redis-addr 127.0.0.1:7000,127.0.0.1:7001
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
	"strings"
	"syscall"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/internal/routeload"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(os.Stderr, "mc-loadgen:", err)
		}
		os.Exit(1)
	}
}

type config struct {
	addr, token, stores, redisAddr, redisPrefix string
	concurrency, requests, hosts, blocks        int
	duration, warmup, progress                  time.Duration
	populate                                    bool
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c config
	fs := flag.NewFlagSet("mc-loadgen", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.addr, "addr", "", "base URL of a running metadata center (loopback only); empty: serve --stores in process")
	fs.StringVar(&c.token, "token", os.Getenv("LLMF_MC_AUTH_TOKEN"), "bearer token for --addr")
	fs.StringVar(&c.stores, "stores", "memory", "without --addr: comma-separated stores to measure in turn (memory, redis, redis-cluster)")
	fs.StringVar(&c.redisAddr, "redis-addr", "127.0.0.1:6379", "redis-server for --stores redis; seed list (comma-separated) for --stores redis-cluster")
	fs.StringVar(&c.redisPrefix, "redis-key-prefix", fmt.Sprintf("mc-loadgen-%d", os.Getpid()), "key prefix for --stores redis (its keys are left to expire)")
	fs.IntVar(&c.concurrency, "concurrency", 64, "closed-loop workers")
	fs.IntVar(&c.requests, "requests", 200000, "stop after this many requests (0: no count bound)")
	fs.DurationVar(&c.duration, "duration", 30*time.Second, "stop after this long (0: no time bound)")
	fs.DurationVar(&c.warmup, "warmup", 2*time.Second, "unmeasured run before each measurement")
	fs.DurationVar(&c.progress, "progress", 2*time.Second, "progress line interval (0: none)")
	fs.IntVar(&c.hosts, "hosts", 64, "hosts in the scenario")
	fs.IntVar(&c.blocks, "blocks", 64, "hashes per prompt")
	fs.BoolVar(&c.populate, "populate", true, "fill the index and leases before measuring")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if c.requests <= 0 && c.duration <= 0 {
		return errors.New("give --requests or --duration: the run must be bounded")
	}
	sc := routeload.Default()
	sc.Hosts, sc.Blocks = c.hosts, c.blocks
	if sc.SharedBlocks > sc.Blocks {
		sc.SharedBlocks = sc.Blocks
	}

	if c.addr != "" {
		if err := routeload.Loopback(c.addr); err != nil {
			return fmt.Errorf("--addr: %w", err)
		}
		return measure(ctx, stdout, c, sc, c.addr, "external")
	}
	gin.SetMode(gin.ReleaseMode)
	for _, kind := range strings.Split(c.stores, ",") {
		if err := serveAndMeasure(ctx, stdout, c, sc, strings.TrimSpace(kind)); err != nil {
			return err
		}
	}
	return nil
}

func serveAndMeasure(ctx context.Context, stdout io.Writer, c config, sc routeload.Scenario, kind string) error {
	var st store.Store
	switch kind {
	case "memory":
		st = memstore.New(memstore.Options{})
	case "redis", "redis-cluster":
		rs, err := redisstore.New(redisstore.Options{Addr: c.redisAddr, KeyPrefix: c.redisPrefix, Cluster: kind == "redis-cluster"})
		if err != nil {
			return err
		}
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err = rs.Ping(pctx)
		cancel()
		if err != nil {
			return fmt.Errorf("--stores %s: %w", kind, err)
		}
		st = rs
	default:
		return fmt.Errorf("--stores: unknown store %q", kind)
	}
	defer st.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	hs := &http.Server{
		Handler:           server.New(st, server.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}).Handler(),
		ReadHeaderTimeout: 5 * time.Second,
	}
	go func() { _ = hs.Serve(ln) }()
	defer hs.Close()
	return measure(ctx, stdout, c, sc, "http://"+ln.Addr().String(), kind)
}

func measure(ctx context.Context, stdout io.Writer, c config, sc routeload.Scenario, base, label string) error {
	cl := routeload.NewClient(base, c.token, c.concurrency)
	if c.populate {
		if err := sc.PopulateHTTP(ctx, cl); err != nil {
			return fmt.Errorf("populate: %w", err)
		}
	}
	if c.warmup > 0 {
		if _, err := sc.Run(ctx, cl, routeload.RunConfig{Concurrency: c.concurrency, Duration: c.warmup}); err != nil {
			return err
		}
	}
	fmt.Fprintf(stdout, "%s: POST /v1/route/query, %d hosts, %d-block prompts, concurrency %d, bound %d requests / %v\n",
		label, sc.Hosts, sc.Blocks, c.concurrency, c.requests, c.duration)
	res, err := sc.Run(ctx, cl, routeload.RunConfig{
		Concurrency: c.concurrency, Requests: c.requests, Duration: c.duration, ProgressGap: c.progress,
		Progress: func(done int64, el time.Duration) {
			fmt.Fprintf(stdout, "  %s: %d requests in %.1fs (%.0f/s)\n", label, done, el.Seconds(), float64(done)/el.Seconds())
		},
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s: %d requests in %.2fs: %.0f req/s, p50 %s, p90 %s, p99 %s, max %s, errors %d\n",
		label, res.Requests, res.Elapsed.Seconds(), res.Throughput(),
		ms(res.Quantile(.5)), ms(res.Quantile(.9)), ms(res.Quantile(.99)), ms(res.Quantile(1)), res.Errors)
	if res.Errors > 0 {
		return fmt.Errorf("%s: %d errors, first: %v", label, res.Errors, res.FirstErr)
	}
	return nil
}

func ms(d time.Duration) string { return fmt.Sprintf("%.3fms", float64(d)/float64(time.Millisecond)) }
