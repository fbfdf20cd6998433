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
//
// Each measured run also reports CPU per query: this process's (the load
// client and, with --stores, the metadata center it serves) and, on the
// Redis stores, redis-server's own (INFO cpu, summed over every node of a
// cluster), so throughput on these shared cores can be turned into what a
// machine of one's own would do. --cpuprofile writes the measured runs'
// Go profile, --memprofile their allocations.
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
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/redis/go-redis/v9"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
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
	answer, accept                              string
	concurrency, requests, hosts, blocks        int
	duration, warmup, progress                  time.Duration
	populate                                    bool
	cpuProfile, memProfile                      string
	profile                                     *io.Writer // open cpuProfile until the first measured run takes it
	// redisCPU reads redis-server's CPU seconds so far (nil: not a Redis store).
	redisCPU func(context.Context) (float64, error)
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
	fs.StringVar(&c.answer, "answer", "compact", "route answer form to ask for: compact (what the filter's client asks for) or json")
	fs.IntVar(&c.hosts, "hosts", 64, "hosts in the scenario")
	fs.IntVar(&c.blocks, "blocks", 64, "hashes per prompt")
	fs.BoolVar(&c.populate, "populate", true, "fill the index and leases before measuring")
	fs.StringVar(&c.cpuProfile, "cpuprofile", "", "write a CPU profile of the measured runs (not populate or warm-up) to this file")
	fs.StringVar(&c.memProfile, "memprofile", "", "write the allocations of the whole run to this file (allocs profile, every 4 KiB sampled)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if c.cpuProfile != "" {
		f, err := os.Create(c.cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		var w io.Writer = f
		c.profile = &w
	}
	if c.memProfile != "" {
		runtime.MemProfileRate = 4096
		defer func() {
			if f, err := os.Create(c.memProfile); err == nil {
				_ = pprof.Lookup("allocs").WriteTo(f, 0)
				f.Close()
			}
		}()
	}
	if c.requests <= 0 && c.duration <= 0 {
		return errors.New("give --requests or --duration: the run must be bounded")
	}
	switch c.answer {
	case "compact":
		c.accept = api.MediaRouteCompact
	case "json":
	default:
		return fmt.Errorf("--answer: want compact or json, got %q", c.answer)
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
		rc := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: strings.Split(c.redisAddr, ","), IsClusterMode: kind == "redis-cluster"})
		defer rc.Close()
		c.redisCPU = func(ctx context.Context) (float64, error) { return redisCPU(ctx, rc) }
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
		if _, err := sc.Run(ctx, cl, routeload.RunConfig{Concurrency: c.concurrency, Duration: c.warmup, Accept: c.accept}); err != nil {
			return err
		}
	}
	fmt.Fprintf(stdout, "%s: POST /v1/route/query, %d hosts, %d-block prompts, concurrency %d, bound %d requests / %v\n",
		label, sc.Hosts, sc.Blocks, c.concurrency, c.requests, c.duration)
	load0 := loadAvg()
	cpu0, err := cpuNow(ctx, c)
	if err != nil {
		return err
	}
	if c.profile != nil && *c.profile != nil {
		if err := pprof.StartCPUProfile(*c.profile); err != nil {
			return err
		}
		*c.profile = nil // one profile per file: the first measured run
		defer pprof.StopCPUProfile()
	}
	res, err := sc.Run(ctx, cl, routeload.RunConfig{
		Concurrency: c.concurrency, Requests: c.requests, Duration: c.duration, ProgressGap: c.progress, Accept: c.accept,
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
	cpu1, err := cpuNow(ctx, c)
	if err != nil {
		return err
	}
	if n := float64(res.Requests); n > 0 {
		line := fmt.Sprintf("%s: CPU per query: this process %.1f µs", label, (cpu1.self-cpu0.self)/n*1e6)
		if c.redisCPU != nil {
			line += fmt.Sprintf(", redis-server %.1f µs", (cpu1.redis-cpu0.redis)/n*1e6)
		}
		fmt.Fprintln(stdout, line)
	}
	// The neighbours' load, so that figures taken on shared cores can be
	// read against it (docs/benchmarks.md quotes it with every run).
	if load0 != "" {
		fmt.Fprintf(stdout, "%s: load average %s -> %s\n", label, load0, loadAvg())
	}
	if res.Errors > 0 {
		return fmt.Errorf("%s: %d errors, first: %v", label, res.Errors, res.FirstErr)
	}
	return nil
}

// loadAvg is the 1-minute load average, "" where /proc/loadavg is missing.
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return ""
	}
	return f[0]
}

func ms(d time.Duration) string { return fmt.Sprintf("%.3fms", float64(d)/float64(time.Millisecond)) }

type cpuSeconds struct{ self, redis float64 }

// cpuNow reads this process's user+system CPU and, for a Redis store,
// redis-server's.
func cpuNow(ctx context.Context, c config) (cpuSeconds, error) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return cpuSeconds{}, err
	}
	out := cpuSeconds{self: tv(ru.Utime) + tv(ru.Stime)}
	if c.redisCPU != nil {
		r, err := c.redisCPU(ctx)
		if err != nil {
			return cpuSeconds{}, fmt.Errorf("redis CPU: %w", err)
		}
		out.redis = r
	}
	return out, nil
}

func tv(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }

// redisCPU sums used_cpu_user and used_cpu_sys of INFO cpu over every node
// (every master and replica of a cluster: replicas replay the writes).
func redisCPU(ctx context.Context, rc redis.UniversalClient) (float64, error) {
	if cc, ok := rc.(*redis.ClusterClient); ok {
		var mu sync.Mutex
		var sum float64
		err := cc.ForEachShard(ctx, func(ctx context.Context, n *redis.Client) error {
			v, err := nodeCPU(ctx, n)
			mu.Lock()
			sum += v
			mu.Unlock()
			return err
		})
		return sum, err
	}
	return nodeCPU(ctx, rc)
}

func nodeCPU(ctx context.Context, n redis.Cmdable) (float64, error) {
	info, err := n.Info(ctx, "cpu").Result()
	if err != nil {
		return 0, err
	}
	var sum float64
	for _, line := range strings.Split(info, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (k == "used_cpu_user" || k == "used_cpu_sys") {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return 0, fmt.Errorf("INFO cpu %s: %w", k, err)
			}
			sum += f
		}
	}
	return sum, nil
}
