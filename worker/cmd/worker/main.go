// Command worker is the llama.cpp-backed OpenAI server whose KV cache the
// router exploits (docs/worker.md).
//
//	go run ./worker/cmd/worker --model var/models/tiny.gguf --listen 127.0.0.1:9001
//	go run ./worker/cmd/worker --engine sim --listen 127.0.0.1:9002   # no compute: fleet benchmarks
//
// With --metadata-center it reports KV-cache evictions (and {all:true} at
// start-up) for --cluster and --advertise-host.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/istio-llm-filter/istio-llm-filter/internal/tracing"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
	"github.com/istio-llm-filter/istio-llm-filter/worker/cpus"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/llama"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/sim"
	"github.com/istio-llm-filter/istio-llm-filter/worker/kvcache"
	"github.com/istio-llm-filter/istio-llm-filter/worker/mcreport"
	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
	"github.com/istio-llm-filter/istio-llm-filter/worker/scheduler"
	"github.com/istio-llm-filter/istio-llm-filter/worker/seqpool"
	"github.com/istio-llm-filter/istio-llm-filter/worker/server"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The first signal drains; a second one kills at once.
	go func() { <-ctx.Done(); stop() }()
	if err := run(ctx, os.Args[1:], os.Stderr, nil); err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "worker:", err)
		os.Exit(2)
	}
}

type options struct {
	model, listen, engine, modelName, advertise, cluster, mcURL, mcToken, kvType, logLevel string
	mcTokenFile, mcCAFile, mcServerName                                                    string
	nSeqMax, maxRunning, maxQueue, nCtx, nBatch, threads, hashChunk                        int
	maxBatch, maxOutput, finishFirst, prefillChunk                                         int
	kvMaxMB, kvMaxItems, parkMaxBytes                                                      int64
	kvThreshold                                                                            float64
	timeout, cleanup, queueTimeout, readyWait, drainTimeout                                time.Duration
	strictModel, flashAttn, parkIdle, compact                                              bool
	simCost                                                                                sim.Cost
	lora                                                                                   []llama.LoRA
	simBytesPerToken                                                                       int64
	labelFlags                                                                             labelFlags
	labelsFile                                                                             string
	advertiseListen                                                                        bool // advertise is --listen, whose port may be 0
	podLabels                                                                              map[string]string
	tracing                                                                                tracing.Options
}

// parkBound is llama.Config.ParkMaxBytes for --kv-park-max-bytes: its -1
// (the KV cache's size) is the engine's 0; 0 (never park) turns parking off
// through NoPark instead.
func (o *options) parkBound() int64 { return max(o.parkMaxBytes, 0) }

func parse(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	def := scheduler.DefaultConfig()
	fs := flag.NewFlagSet("worker", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.model, "model", "", "GGUF model path (required for --engine llama; with sim it only lends its name, context and KV size)")
	fs.StringVar(&o.listen, "listen", "127.0.0.1:9001", "HTTP listen address")
	fs.StringVar(&o.engine, "engine", "llama", "compute engine: llama (llama.cpp) or sim (calibrated cost model, no compute)")
	// Three counts of concurrency, from the widest: --n-seq-max seq ids
	// (running requests + cached conversations), --max-concurrent-requests
	// running requests, --max-batch-size sequences per step.
	fs.IntVar(&o.nSeqMax, "n-seq-max", 16, "llama.cpp sequence ids (1-256), the widest of three counts: each running request holds one, and the rest keep finished conversations' KV cells for reuse; set it to --max-concurrent-requests plus the conversations to keep cached")
	fs.IntVar(&o.maxRunning, "max-concurrent-requests", def.MaxRunning, "requests in the running set (admitted from the queue, holding or waiting for a seq id); more queue. Raise it for throughput while each request's tokens/s holds; it must leave --n-seq-max room for the cache")
	fs.IntVar(&o.maxBatch, "max-batch-size", def.MaxBatch, "the narrowest count: most sequences one decode step evaluates, at most --max-concurrent-requests (unset: capped by it); with more ready they take turns. A step lasts longer with every sequence in it, and all of them wait for its end")
	fs.IntVar(&o.maxOutput, "max-output-tokens", def.MaxOutputTokens, "generated tokens of a request without max_tokens; a larger max_tokens is refused with 400")
	fs.IntVar(&o.finishFirst, "finish-first-tokens", def.FinishFirst, "while a request has at most this many tokens left before its max_tokens, long prompts wait with their prefill until it ends (its KV cells would crowd their attention); 0: off")
	fs.IntVar(&o.maxQueue, "max-queue", def.MaxQueue, "request queue length; beyond it requests get 429")
	fs.DurationVar(&o.timeout, "request-timeout", def.RequestTimeout, "time a request may spend in the running set before 408")
	fs.DurationVar(&o.drainTimeout, "drain-timeout", 100*time.Second, "on SIGTERM: /readyz turns 503 and new requests get 503 with Retry-After at once, while running and queued requests get this long to finish before the rest fail (503) and the worker exits; keep it below the pod's terminationGracePeriodSeconds minus its preStop")
	fs.DurationVar(&o.queueTimeout, "queue-timeout", def.QueueTimeout, "longest wait in the request queue before 408 (0: no bound)")
	fs.IntVar(&o.nCtx, "n-ctx", 0, "KV cells shared by all sequences (0: the model's training context; sim without a model: 16384)")
	fs.IntVar(&o.nBatch, "n-batch", 512, "most tokens per decode step")
	fs.IntVar(&o.threads, "threads", 0, "llama.cpp threads (0: the CPUs this process may use: its affinity, capped by its cgroup CPU quota rounded down, at least 1)")
	fs.StringVar(&o.kvType, "kv-cache-type", "f16", "KV cache type: f16, q8_0 or q4_0")
	fs.IntVar(&o.prefillChunk, "prefill-chunk", def.PrefillChunk, "at most this many prompt tokens per decode step while more than one request steps (a whole --n-batch for a request alone): a shorter step gives a cache hit its first token and the decoding requests their next sooner on a busy pod; 0: --n-batch")
	fs.BoolVar(&o.flashAttn, "flash-attention", false, "use llama.cpp's fused attention kernel: it skips other sequences' cells (faster on a crowded KV cache, e.g. with --kv-park-idle=false) but prefills ~1.6x slower on an uncrowded one; on by default with a quantized --kv-cache-type, which needs it")
	fs.BoolVar(&o.compact, "kv-compact", true, "move KV cells down into the holes a parked, finished or cut sequence leaves, before the next step (llama.cpp attends over every cell up to the highest used one); only with --kv-park-idle")
	fs.BoolVar(&o.parkIdle, "kv-park-idle", true, "keep finished conversations' KV cells in host memory instead of the KV cache, so they do not slow down other sequences' attention (restored, bit for bit, when reused)")
	fs.Int64Var(&o.parkMaxBytes, "kv-park-max-bytes", -1, "host memory parked idle entries may take; parking one past it first evicts the least recently used parked entries (an entry larger than it alone stays in the KV cache); -1: the KV cache's own size (n-ctx x KV bytes per token); 0: never park")
	fs.Int64Var(&o.kvMaxMB, "kv-max-memory-mb", def.KV.MaxBytes>>20, "KV-cache memory limit in MiB; idle entries are evicted past threshold x limit")
	fs.Int64Var(&o.kvMaxItems, "kv-max-items", def.KV.MaxItems, "KV-cache item (token) limit")
	fs.Float64Var(&o.kvThreshold, "kv-eviction-threshold", def.KV.Threshold, "fraction of a limit at which LRU eviction starts")
	fs.DurationVar(&o.cleanup, "kv-cleanup-interval", def.CleanupInterval, "period of the KV-cache threshold check")
	fs.StringVar(&o.mcURL, "metadata-center", "", "metadata center URL for eviction reports (empty: no reports)")
	fs.StringVar(&o.mcToken, "metadata-center-token", "", "bearer token for the metadata center")
	fs.StringVar(&o.mcTokenFile, "metadata-center-token-file", "", "file holding the metadata center's bearer token (a mounted Secret), read again when it changes; instead of --metadata-center-token")
	fs.StringVar(&o.mcCAFile, "metadata-center-ca-file", "", "PEM CA bundle an https:// metadata center's certificate is verified against (empty: the system's roots)")
	fs.StringVar(&o.mcServerName, "metadata-center-server-name", "", "name an https:// metadata center's certificate must carry (empty: the URL's host)")
	fs.DurationVar(&o.readyWait, "ready-wait", 10*time.Second, "with --metadata-center: longest time /readyz waits for the metadata center to acknowledge the start-up index reset before it reports ready anyway (0: no bound)")
	fs.StringVar(&o.cluster, "cluster", "", "Envoy cluster name the router knows this worker under (with --metadata-center)")
	fs.StringVar(&o.advertise, "advertise-host", "", "this worker's ip:port as the router addresses it (default: --listen when it names an IP)")
	fs.StringVar(&o.modelName, "model-name", "", "model id served (default: the model file name, or \"sim\")")
	fs.BoolVar(&o.strictModel, "strict-model-name", false, "answer 404 to requests naming another model")
	fs.IntVar(&o.hashChunk, "prompt-hash-chunk-size", prefix.DefaultChunkSize, "the router's prompt_hash.chunk_size")
	fs.StringVar(&o.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.Func("lora", "load a LoRA adapter, name=path[:scale] (repeatable); the worker then serves only requests naming an adapter", func(v string) error {
		a, err := parseLoRA(v)
		if err != nil {
			return err
		}
		if slices.Contains(o.adapterNames(), a.Name) {
			return fmt.Errorf("lora %q given twice", a.Name)
		}
		o.lora = append(o.lora, a)
		return nil
	})
	o.labelFlags = labelFlags{}
	fs.Var(o.labelFlags, "label", "a label of this pod, key=value (repeatable); registered with the metadata center for the router's label selectors")
	fs.StringVar(&o.labelsFile, "labels-file", "", "more labels, one key=\"value\" per line (the Kubernetes downward API's labels file); env "+LabelsEnv+"=k=v,... and --label override it")
	simDef := sim.BenchCost()
	fs.DurationVar(&o.simCost.StepOverhead, "sim-step-overhead", simDef.StepOverhead, "sim: cost of every decode step")
	fs.DurationVar(&o.simCost.PerToken, "sim-per-token", simDef.PerToken, "sim: cost per evaluated token")
	fs.DurationVar(&o.simCost.PerSample, "sim-per-sample", simDef.PerSample, "sim: cost per sampled sequence")
	fs.DurationVar(&o.simCost.PerKCtxToken, "sim-per-kctx-token", simDef.PerKCtxToken, "sim: attention cost per token per 1000 cells of context")
	fs.Int64Var(&o.simBytesPerToken, "sim-bytes-per-token", 0, "sim: KV bytes per token (0: from --model, else the bench preset's 8192)")
	o.tracing.RegisterFlags(fs)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if err := o.tracing.Validate(); err != nil {
		return nil, fmt.Errorf("--otlp-endpoint/--trace-sample-ratio: %w", err)
	}
	batchSet, faSet := false, false
	fs.Visit(func(f *flag.Flag) {
		batchSet = batchSet || f.Name == "max-batch-size"
		faSet = faSet || f.Name == "flash-attention"
	})
	if quantizedKV := o.kvType != "f16" && o.kvType != ""; quantizedKV && !faSet {
		o.flashAttn = true // llama.cpp quantizes the V cache only under flash attention
	}
	if !batchSet {
		o.maxBatch = min(o.maxBatch, max(o.maxRunning, 1))
	}
	switch {
	case o.engine != "llama" && o.engine != "sim":
		return nil, fmt.Errorf("--engine must be llama or sim, got %q", o.engine)
	case o.engine == "llama" && o.model == "":
		return nil, errors.New("--model is required with --engine llama")
	case o.nSeqMax < 1 || o.nSeqMax > seqpool.MaxSeq:
		return nil, fmt.Errorf("--n-seq-max must be within 1..%d, got %d", seqpool.MaxSeq, o.nSeqMax)
	case o.maxRunning < 1 || o.maxQueue < 1 || o.maxBatch < 1 || o.maxOutput < 1:
		return nil, errors.New("--max-concurrent-requests, --max-queue, --max-batch-size and --max-output-tokens must be at least 1")
	case o.maxBatch > o.maxRunning:
		return nil, fmt.Errorf("--max-batch-size (%d) must not exceed --max-concurrent-requests (%d): a step only holds running requests", o.maxBatch, o.maxRunning)
	case o.kvType != "f16" && o.kvType != "" && !o.flashAttn:
		return nil, fmt.Errorf("--kv-cache-type %s needs --flash-attention (llama.cpp quantizes the V cache only with it)", o.kvType)
	case o.timeout <= 0 || o.cleanup <= 0:
		return nil, errors.New("--request-timeout and --kv-cleanup-interval must be positive")
	case o.drainTimeout < 0:
		return nil, fmt.Errorf("--drain-timeout must not be negative, got %v", o.drainTimeout)
	case o.readyWait < 0:
		return nil, fmt.Errorf("--ready-wait must not be negative (0: no bound), got %v", o.readyWait)
	case o.queueTimeout < 0:
		return nil, fmt.Errorf("--queue-timeout must not be negative (0: no bound), got %v", o.queueTimeout)
	case o.finishFirst < 0:
		return nil, errors.New("--finish-first-tokens must not be negative")
	case o.prefillChunk < 0:
		return nil, errors.New("--prefill-chunk must not be negative")
	case o.nCtx < 0 || o.nBatch < 1 || o.threads < 0 || o.kvMaxMB < 0 || o.kvMaxItems < 0 || o.hashChunk < 1:
		return nil, errors.New("--n-ctx, --n-batch, --threads, --kv-max-memory-mb, --kv-max-items and --prompt-hash-chunk-size must not be negative (n-batch and chunk size at least 1)")
	case o.parkMaxBytes < -1:
		return nil, fmt.Errorf("--kv-park-max-bytes must be -1 (the KV cache's size), 0 (never park) or a byte count, got %d", o.parkMaxBytes)
	case o.kvThreshold <= 0 || o.kvThreshold > 1:
		return nil, fmt.Errorf("--kv-eviction-threshold must be within (0, 1], got %g", o.kvThreshold)
	}
	var err error
	if o.podLabels, err = o.labels(os.Getenv); err != nil {
		return nil, err
	}
	if o.mcURL != "" {
		if o.cluster == "" {
			return nil, errors.New("--cluster is required with --metadata-center")
		}
		if o.advertise == "" {
			host, _, err := net.SplitHostPort(o.listen)
			if ip := net.ParseIP(host); err != nil || ip == nil || ip.IsUnspecified() {
				return nil, fmt.Errorf("--advertise-host is required with --metadata-center when --listen %q names no IP", o.listen)
			}
			o.advertise = o.listen
			o.advertiseListen = true
		}
		if _, _, err := net.SplitHostPort(o.advertise); err != nil {
			return nil, fmt.Errorf("--advertise-host %q: want ip:port", o.advertise)
		}
	}
	return o, nil
}

// run starts the worker and serves until ctx ends. ready, if set, gets the
// bound address once requests are accepted.
func run(ctx context.Context, args []string, stderr io.Writer, ready func(addr string)) error {
	o, err := parse(args, stderr)
	if err != nil {
		return err
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.logLevel)); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	// llama.cpp's own messages go through slog.Default's level.
	slog.SetDefault(log)

	if o.nSeqMax <= o.maxRunning {
		// Finished conversations keep their cells under a seq id; with no
		// spare ids every new request evicts one, and reuse only happens
		// for a conversation's immediate next turn.
		log.Warn("--n-seq-max leaves no seq ids for cached conversations beyond the running set",
			"n_seq_max", o.nSeqMax, "max_concurrent_requests", o.maxRunning)
	}
	eng, tmpl, err := openEngine(o, log)
	if err != nil {
		return err
	}
	defer eng.Close()
	info := eng.Info()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if p, ok := eng.(interface{ ParkedBytes() int64 }); ok {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "llmf_worker_kv_parked_bytes",
			Help: "Host memory holding idle KV-cache entries' cells parked out of llama.cpp's KV cache (--kv-park-idle).",
		}, func() float64 { return float64(p.ParkedBytes()) }))
	}
	if p, ok := eng.(interface{ ParkLimit() int64 }); ok {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "llmf_worker_kv_park_limit_bytes",
			Help: "Bound on llmf_worker_kv_parked_bytes (--kv-park-max-bytes; 0: nothing is parked).",
		}, func() float64 { return float64(p.ParkLimit()) }))
	}
	cfg := scheduler.Config{
		MaxQueue: o.maxQueue, MaxRunning: o.maxRunning, RequestTimeout: o.timeout, CleanupInterval: o.cleanup,
		QueueTimeout: o.queueTimeout,
		MaxBatch:     o.maxBatch, MaxOutputTokens: o.maxOutput, FinishFirst: o.finishFirst, PrefillChunk: o.prefillChunk,
		KV: kvcache.Limits{MaxItems: o.kvMaxItems, MaxBytes: o.kvMaxMB << 20, Threshold: o.kvThreshold},
		// Labelled with the served model, as the vllm:* series are.
		Metrics: scheduler.NewMetrics(prometheus.WrapRegistererWith(prometheus.Labels{"model_name": info.Name}, reg)), Logger: log,
	}
	// The loop and the reporters outlive ctx: on SIGTERM they serve the
	// drain, and stop when run returns.
	runCtx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if o.mcURL == "" && (len(o.podLabels) > 0 || len(o.lora) > 0) {
		log.Warn("labels and LoRA adapters are registered with the metadata center only: without --metadata-center the router's selectors do not see them",
			"labels", o.podLabels, "adapters", o.adapterNames())
	}
	// Listen before the reporter starts: with --listen ip:0 the pod is
	// known to the router under the port it really got.
	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return err
	}
	defer ln.Close()
	if _, port, _ := net.SplitHostPort(o.advertise); o.advertiseListen && port == "0" {
		o.advertise = ln.Addr().String()
	}
	var reporterDone chan struct{}
	var reporter *mcreport.Reporter
	if o.mcURL != "" {
		rep, err := mcreport.New(mcreport.Config{URL: o.mcURL, Cluster: o.cluster, Host: o.advertise, AuthToken: o.mcToken, ChunkSize: o.hashChunk,
			AuthTokenFile: o.mcTokenFile, CAFile: o.mcCAFile, ServerName: o.mcServerName,
			Logger: log, Registerer: reg,
			Registration: &api.PodRegistration{Models: []string{info.Name}, Labels: o.podLabels, Adapters: o.adapterNames()}})
		if err != nil {
			return err
		}
		cfg.OnEvictAt = rep.EvictAt
		cfg.OnCached = rep.Cached
		reporter = rep
	}
	sched, err := scheduler.New(eng, cfg)
	if err != nil {
		return err
	}
	// Beside ours, the series a vLLM-reading endpoint picker scrapes.
	if err := sched.ExportVLLM(reg, info.Name, o.adapterNames()); err != nil {
		return err
	}
	if reporter != nil {
		reporterDone = make(chan struct{})
		go func() { reporter.Run(runCtx); close(reporterDone) }()
	}
	schedDone := make(chan struct{})
	go func() { sched.Run(runCtx); close(schedDone) }()
	defer func() {
		cancel()
		<-schedDone
		if reporterDone != nil {
			<-reporterDone
		}
	}()

	scfg := server.Config{
		ModelName: o.modelName, StrictModel: o.strictModel, Adapters: o.adapterNames(), Template: tmpl, HashChunkSize: o.hashChunk,
		RequestTimeout: o.timeout, Registry: reg, Logger: log, Ready: readiness(reporter, o.readyWait, log),
	}
	if reporter != nil {
		scfg.Evictions = reporter.Recent
	}
	o.tracing.Service = "llm-worker"
	tp, err := tracing.New(o.tracing)
	if err != nil {
		return err
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), tracing.ShutdownTimeout)
		defer cancel()
		_ = tp.Shutdown(ctx)
	}()
	if tp.Enabled() {
		scfg.Tracer = tp
	}
	srv := server.New(sched, eng, scfg)
	if reporter != nil {
		signalsDone := make(chan struct{})
		go func() { reporter.RunSignals(runCtx, podSignals(sched, srv), 0, 0); close(signalsDone) }()
		defer func() { <-signalsDone }()
	}
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second}
	log.Info("worker ready", "addr", ln.Addr().String(), "engine", o.engine, "model", info.Name, "n_ctx", info.NCtx,
		"n_seq_max", info.NSeqMax, "n_batch", info.NBatch, "template", string(tmpl.Family), "kv_bytes_per_token", info.BytesPerToken)
	if ready != nil {
		ready(ln.Addr().String())
	}
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	drain(srv, reporter, o.drainTimeout, log)
	sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer scancel()
	// Stop the loop first: what the drain left fails (503) and the
	// handlers return, so Shutdown does not wait for long generations.
	cancel()
	<-schedDone
	if err := hs.Shutdown(sctx); err != nil {
		return err
	}
	log.Info("worker stopped")
	return nil
}

// drain lets the requests the worker accepted finish, for at most timeout:
// readiness turns false and new requests get 503 with Retry-After at once
// (the gateway retries them on another replica), the listener stays open
// so that none is refused a connection meanwhile.
// The metadata center hears of the drain at once (reporter, when set), so
// that the gateways stop choosing this pod.
func drain(srv *server.Server, reporter *mcreport.Reporter, timeout time.Duration, log *slog.Logger) {
	srv.Drain()
	if reporter != nil {
		reporter.Nudge()
	}
	n := srv.InFlight()
	log.Info("draining: new requests get 503, running and queued ones may finish", "in_flight", n, "drain_timeout", timeout.String())
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	start := time.Now()
	if err := srv.Drained(ctx); err != nil {
		log.Warn("drain timeout: the requests still running end with 503", "in_flight", srv.InFlight(), "drain_timeout", timeout.String())
		return
	}
	log.Info("drained", "requests", n, "took", time.Since(start).Round(time.Millisecond).String())
}

func openEngine(o *options, log *slog.Logger) (engine.Engine, openai.Template, error) {
	tmpl := openai.ChatML()
	if o.model != "" {
		t, known, err := openai.LoadTemplate(o.model)
		if err != nil {
			return nil, tmpl, err
		}
		if !known {
			log.Warn("the model's chat template is not one this worker renders; using ChatML", "model", o.model)
		}
		log.Info("chat template", "model", o.model, "renders_with", t.Describe(), "tools", t.RendersTools())
		tmpl = t
	}
	if o.engine == "llama" {
		if o.threads == 0 {
			l := cpus.Detect()
			o.threads = l.Threads()
			log.Info("llama.cpp threads from the CPUs this process may use", "threads", o.threads,
				"affinity_cpus", l.Affinity, "cgroup_quota_cpus", l.Quota, "quota_file", l.Source)
		}
		eng, err := llama.Open(llama.Config{ModelPath: o.model, Name: o.modelName, NCtx: o.nCtx, NBatch: o.nBatch,
			NSeqMax: o.nSeqMax, Threads: o.threads, KVCacheType: o.kvType, FlashAttention: o.flashAttn, NoPark: !o.parkIdle || o.parkMaxBytes == 0, ParkMaxBytes: o.parkBound(), NoCompact: !o.compact, LoRA: o.lora})
		return eng, tmpl, err
	}
	cfg := sim.Config{Name: o.modelName, NCtx: o.nCtx, NBatch: o.nBatch, NSeqMax: o.nSeqMax, Cost: o.simCost, BytesPerToken: o.simBytesPerToken}
	if o.model != "" {
		meta, err := llama.ReadMeta(o.model)
		if err != nil {
			return nil, tmpl, err
		}
		if cfg.NCtx == 0 {
			cfg.NCtx = meta.NCtxTrain
		}
		if cfg.BytesPerToken == 0 {
			cfg.BytesPerToken = meta.BytesPerToken
		}
		if cfg.Name == "" {
			cfg.Name = strings.TrimSuffix(filepath.Base(o.model), filepath.Ext(o.model))
		}
	}
	eng, err := sim.New(cfg)
	return eng, tmpl, err
}

// readiness gates /readyz on the metadata center's acknowledgement of the
// start-up evict-all (docs/worker.md, "Readiness"): until then the index
// may still hold what an earlier process on this address cached, and the
// router must not be sent here on the strength of it. Past wait the worker
// reports ready anyway: a metadata center that is down is down for the
// gateways too (they route without it), and the evict-all, stamped with
// this process's start, still removes exactly the earlier process's
// entries whenever it lands.
func readiness(rep *mcreport.Reporter, wait time.Duration, log *slog.Logger) func() error {
	if rep == nil {
		return nil
	}
	start := time.Now()
	var warned atomic.Bool
	return func() error {
		select {
		case <-rep.Cleared():
			return nil
		default:
		}
		if wait > 0 && time.Since(start) >= wait {
			if !warned.Swap(true) {
				log.Warn("ready without the metadata center's acknowledgement of the start-up index reset",
					"waited", wait.String())
			}
			return nil
		}
		return errors.New("waiting for the metadata center to acknowledge the start-up index reset of this host")
	}
}

// podSignals reads the pod's signals from the scheduler's stats and the
// server's drain.
func podSignals(s *scheduler.Scheduler, srv *server.Server) mcreport.SignalSource {
	return mcreport.SignalSourceFunc(func() api.PodSignals {
		st := s.Stats()
		// Waiting is what the gateways' model reads as "no free running
		// slot": the requests queued beyond the running set's free places,
		// not those that join it at the next step (vLLM's
		// num_requests_waiting, on /metrics, counts both). The signals go
		// to the metadata center its eviction reports go to.
		//
		// The costs are what its own steps measured (zero until it has
		// run enough of them), so routers predict its compute in seconds;
		// to two significant digits, so that the fit's drift from step to
		// step does not count as a change to send.
		return api.PodSignals{Waiting: int64(st.Blocked), Running: int64(st.Running), PrefillTokens: int64(st.PrefillTokens),
			KVCacheUtil: st.KVUsage(), KVCapacity: int64(st.KVCells), MaxRunning: int64(st.MaxRunning),
			PrefillQueue: prefillQueue(st.Prefills), TokenSeconds: twoDigits(st.Cost.PerToken),
			AttentionSeconds: twoDigits(st.Cost.PerPair), StepSeconds: twoDigits(st.StepSeconds), StepLeftSeconds: twoDigits(st.StepLeft),
			HeldTokens: int64(st.Held.Tokens), HeldStepSeconds: twoDigits(st.Held.Step), HoldLeftSeconds: twoDigits(st.Held.Left),
			ReportsEvictions: true, Draining: srv.Draining()}
	})
}

// prefillQueue is the scheduler's prefills as reported, their seconds to
// two significant digits; nil while the pod's cost is not known yet.
func prefillQueue(ps []scheduler.Prefill) []api.Prefill {
	var q []api.Prefill
	for _, p := range ps {
		if p.Seconds > 0 {
			q = append(q, api.Prefill{Tokens: int64(p.Tokens), Seconds: twoDigits(p.Seconds)})
		}
	}
	return q
}

// twoDigits rounds v > 0 to two significant digits.
func twoDigits(v float64) float64 {
	if v <= 0 || math.IsInf(v, 0) || math.IsNaN(v) {
		return 0
	}
	r, _ := strconv.ParseFloat(strconv.FormatFloat(v, 'g', 2, 64), 64) // the float nearest the decimal: short on the wire
	return r
}

// parseLoRA reads --lora name=path[:scale].
func parseLoRA(v string) (llama.LoRA, error) {
	name, path, ok := strings.Cut(v, "=")
	if !ok || name == "" || path == "" {
		return llama.LoRA{}, fmt.Errorf("want name=path[:scale], got %q", v)
	}
	a := llama.LoRA{Name: name, Path: path}
	if i := strings.LastIndexByte(path, ':'); i > 0 {
		if f, err := strconv.ParseFloat(path[i+1:], 32); err == nil {
			if f <= 0 {
				return llama.LoRA{}, fmt.Errorf("lora %q: scale must be positive, got %v", name, f)
			}
			a.Path, a.Scale = path[:i], float32(f)
		}
	}
	if _, err := os.Stat(a.Path); err != nil {
		return llama.LoRA{}, fmt.Errorf("lora %q: %w", name, err)
	}
	return a, nil
}

func (o *options) adapterNames() []string {
	var names []string
	for _, a := range o.lora {
		names = append(names, a.Name)
	}
	return names
}
