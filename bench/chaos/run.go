package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/client"
	"github.com/istio-llm-filter/istio-llm-filter/bench/fleet"
)

// Config describes the fleet and the load of a chaos run or a soak.
type Config struct {
	Bin   string // metadata-center, worker, gateway (make build)
	Out   string // outputs and logs
	Model string // GGUF for the llama worker (and the sim workers' sizes)

	SimWorkers int     // simulated workers (default 3)
	Llama      bool    // one real llama.cpp worker beside them
	LlamaCPUs  float64 // its CPU quota (the slow-worker fault divides it by 10); default 1, negative: none
	// WorkerQueue and WorkerRunning size every worker's queue and running
	// set small, so that a burst overflows them (429).
	WorkerQueue, WorkerRunning int
	WorkerArgs                 []string // more flags for every worker

	Users int // concurrent simulated users of the steady load
	// StreamShare of the users' requests are streamed (default 0.5;
	// negative: none).
	StreamShare float64
	MaxTokens   int
	Seed        uint64
	LeaseTTL    time.Duration // the center's --lease-ttl, short so leaks show

	Faults   []string      // names to run, in order (nil: all)
	Baseline time.Duration // plain load before the first fault
	Settle   time.Duration // recovery → index check
	Gap      time.Duration // recovery → next fault
	Burst    int           // requests of the burst fault

	SoakDuration time.Duration
	SampleEvery  time.Duration

	Progress io.Writer
}

func (c *Config) defaults() {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	defD := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&c.SimWorkers, 3)
	def(&c.WorkerQueue, 8)
	def(&c.WorkerRunning, 4)
	def(&c.Users, 6)
	def(&c.MaxTokens, 32)
	def(&c.Burst, 96)
	defD(&c.LeaseTTL, 5*time.Second)
	defD(&c.Baseline, 20*time.Second)
	defD(&c.Settle, time.Second)
	defD(&c.Gap, 15*time.Second)
	defD(&c.SampleEvery, 5*time.Second)
	if c.StreamShare == 0 {
		c.StreamShare = 0.5
	}
	if c.LlamaCPUs == 0 {
		c.LlamaCPUs = 1
	}
	if c.Seed == 0 {
		c.Seed = 1
	}
	if c.Progress == nil {
		c.Progress = io.Discard
	}
}

// Names of every fault, in the default order.
var FaultNames = []string{"worker-kill", "rolling-restart", "redis-restart", "redis-pause", "mc-restart", "gateway-kill", "slow-worker", "client-disconnect", "burst"}

func (c Config) spec() fleet.Spec {
	// The workers' own timeout (408) well inside the client's, so that a
	// request the fleet gives up on still gets an answer.
	wargs := append([]string{"--max-queue", fmt.Sprint(c.WorkerQueue), "--max-concurrent-requests", fmt.Sprint(c.WorkerRunning),
		"--request-timeout", "30s", "--drain-timeout", "40s", "--log-level", "warn"}, c.WorkerArgs...)
	s := fleet.Spec{
		BinDir: c.Bin, LogDir: filepath.Join(c.Out, "logs"), Engine: "sim", Workers: c.SimWorkers,
		Model: c.Model, ModelName: "tiny", Policy: "cache_aware", WorkerArgs: wargs,
		Store: "redis", Gateways: 2,
		MCArgs: []string{"--lease-ttl", c.LeaseTTL.String(), "--log-level", "warn"},
	}
	if c.Llama {
		// KV cells for its 16 sequences' prompts (a few thousand tokens
		// each), so that it evicts idle entries rather than thrash.
		// A short queue and running set: on a shared machine its real
		// compute is the slowest pod, and it should shed load (429, which
		// the client retries elsewhere) rather than time out (408).
		largs := append(append([]string{"--n-ctx", "32768"}, wargs...), "--max-queue", "4", "--max-concurrent-requests", "2")
		s.Extra = []fleet.WorkerSpec{{Engine: "llama", Model: c.Model, Args: largs, CPUs: max(c.LlamaCPUs, 0)}}
	}
	return s
}

// ClientTimeout bounds one request with its retries (the workers time out
// at 30 s).
const ClientTimeout = 90 * time.Second

// Result is everything a chaos run measured.
type Result struct {
	Started  string            `json:"started"`
	Machine  map[string]string `json:"machine"`
	Settings map[string]string `json:"settings"`
	Baseline Baseline          `json:"baseline"`
	Initial  Check             `json:"initial_check"` // before the first fault
	Faults   []FaultStats      `json:"faults"`
	Final    Check             `json:"final_check"` // load stopped, one lease TTL later
	Windows  []Window          `json:"windows"`
	Aims     []Aim             `json:"aims"`
	Duration time.Duration     `json:"duration_ns"`
}

// Aim is one of the run's aims (docs/operations.md, "Chaos and soak"),
// met or not.
type Aim struct {
	Name string `json:"name"`
	Met  bool   `json:"met"`
	Got  string `json:"got"`
}

type observer struct {
	chk    Checker
	load   *Load
	mu     sync.Mutex
	checks []Check
	out    io.Writer
	dir    string // where each check's index dump goes ("": none)
}

func (o *observer) Recovered(ctx context.Context, w *Window) {
	chk := o.chk
	o.mu.Lock()
	if o.dir != "" {
		chk.Dump = filepath.Join(o.dir, fmt.Sprintf("index_%d_%s.json", len(o.checks)+1, w.Name))
	}
	o.mu.Unlock()
	c := chk.Check(ctx, o.load.InFlight)
	o.mu.Lock()
	o.checks = append(o.checks, c)
	o.mu.Unlock()
	fmt.Fprintf(o.out, "  %s recovered at %.1fs; +1s: index %d entries, %d held, %d pending, %d in transit, %d retracting, %d wrong (%s); reports acknowledged within %.0f ms; leases %d, in flight %d %s\n",
		w.Name, w.End.Seconds(), c.IndexEntries, c.IndexTrue, c.IndexPending, c.IndexInTransit, c.IndexRetracting, c.Wrong(), pct(c.Precision),
		c.ReportLatencyMax, c.Leases, c.InFlight, c.Err)
}

func (o *observer) WindowDone(context.Context, *Window) {}

func pct(p float64) string {
	if p < 0 {
		return "empty"
	}
	return fmt.Sprintf("%.1f%%", 100*p)
}

// RunChaos starts the fleet, runs the load and the fault schedule, checks
// the end state and writes the outputs. The error is about the run itself;
// whether the aims were met is in the Result.
func RunChaos(ctx context.Context, cfg Config) (*Result, error) {
	cfg.defaults()
	names := cfg.Faults
	if names == nil {
		names = FaultNames
	}
	if slices.Contains(names, "slow-worker") && !cfg.Llama {
		return nil, fmt.Errorf("the slow-worker fault needs the llama worker")
	}
	fmt.Fprintf(cfg.Progress, "starting the fleet (redis, metadata center, %d sim workers%s, 2 gateways) in %s\n", cfg.SimWorkers, map[bool]string{true: " + 1 llama worker"}[cfg.Llama], cfg.Out)
	f, err := fleet.Start(ctx, cfg.spec())
	if err != nil {
		return nil, err
	}
	defer f.Stop()
	hc := client.NewHTTPClient()
	start := time.Now()
	cl := &Client{Gateways: f.Gateways, Model: "tiny", MaxRetries: 2, Timeout: ClientTimeout, HTTP: hc}
	load := NewLoad(cl, cfg.Users, cfg.MaxTokens, cfg.Seed, start)
	load.StreamShare = cfg.StreamShare
	chk := Checker{MC: f.MC, Cluster: fleet.Cluster, Workers: f.Workers, HTTP: hc}
	obs := &observer{chk: chk, load: load, out: cfg.Progress, dir: cfg.Out}

	faults, err := buildFaults(names, f, load, cfg, start)
	if err != nil {
		return nil, err
	}
	loadCtx, stopLoad := context.WithCancel(ctx)
	loadDone := make(chan error, 1)
	go func() { loadDone <- load.Run(loadCtx) }()
	stopProgress := progress(cfg.Progress, load, start)

	sched := Schedule{Baseline: cfg.Baseline, Settle: cfg.Settle, Gap: cfg.Gap, Faults: faults,
		Log: func(format string, a ...any) {
			fmt.Fprintf(cfg.Progress, "%6.1fs ", time.Since(start).Seconds())
			fmt.Fprintf(cfg.Progress, format+"\n", a...)
		}}
	// The steady state the faults are compared against, checked too.
	var initial Check
	sched.Before = func(c context.Context) {
		before := chk
		before.Dump = filepath.Join(cfg.Out, "index_0_before_faults.json")
		initial = before.Check(c, load.InFlight)
	}
	windows := sched.Run(ctx, start, obs)
	stopLoad()
	if err := <-loadDone; err != nil {
		return nil, err
	}
	end := time.Since(start)
	stopProgress()
	if len(windows) > 0 {
		windows[len(windows)-1].Next = end
	}
	wait := cfg.LeaseTTL + 2*time.Second
	fmt.Fprintf(cfg.Progress, "%6.1fs load stopped; waiting %s (lease TTL + 2 s) for the final check\n", end.Seconds(), wait)
	sleep(ctx, wait)
	chk.Dump = filepath.Join(cfg.Out, "final_index.json")
	final := chk.Check(context.WithoutCancel(ctx), load.InFlight)

	recs := load.Records()
	slices.SortFunc(recs, func(a, b Record) int { return int(a.Start - b.Start) })
	firstFault := end
	if len(windows) > 0 {
		firstFault = windows[0].Start
	}
	// The first 5 s warm caches up; the baseline is the steady state after.
	base := BaselineOf(recs, min(5*time.Second, firstFault/2), firstFault)
	res := &Result{
		Started:  start.UTC().Format(time.RFC3339),
		Machine:  machine(),
		Settings: cfg.settings(),
		Baseline: base, Initial: initial,
		Faults:  Analyze(recs, windows, obs.checks, base, time.Second),
		Final:   final,
		Windows: windows, Duration: end,
	}
	res.Aims = aims(recs, res)
	if err := writeChaos(cfg.Out, res, recs); err != nil {
		return res, err
	}
	return res, nil
}

func aims(recs []Record, r *Result) []Aim {
	lost, unexpected := 0, 0
	for _, rec := range recs {
		if rec.Outcome.Lost() {
			lost++
		}
	}
	for _, f := range r.Faults {
		unexpected += f.Unexpected
	}
	// Failures of the baseline (before any fault) are unexpected too.
	for _, rec := range recs {
		if rec.Fault == "" && (rec.Outcome == Failed || rec.Outcome == Reset) {
			unexpected++
		}
	}
	minPrec, where := 2.0, ""
	for _, f := range r.Faults {
		if p := f.Check.Precision; p >= 0 && p < minPrec {
			minPrec, where = p, f.Name
		}
	}
	precOK := minPrec >= 0.99
	precGot := "no index entries to check"
	if minPrec <= 1 {
		precGot = fmt.Sprintf("lowest %.1f%% (after %s)", 100*minPrec, where)
	}
	return []Aim{
		{"0 requests lost without an answer", lost == 0, fmt.Sprintf("%d lost of %d", lost, len(recs))},
		{"failed only those the fault made unanswerable", unexpected == 0, fmt.Sprintf("%d unexpected failures", unexpected)},
		{"0 leaked leases after the lease TTL", r.Final.Leases == 0 && r.Final.Err == "", fmt.Sprintf("%d live leases with no request in flight %s", r.Final.Leases, r.Final.Err)},
		{"index precision ≥ 99% one second after recovery", precOK, precGot},
	}
}

func progress(w io.Writer, l *Load, start time.Time) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(5 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			rs := l.Records()
			var ok, failed, lost int
			for _, r := range rs {
				switch {
				case r.Outcome == OK:
					ok++
				case r.Outcome.Lost():
					lost++
				case r.Outcome == Failed || r.Outcome == Reset:
					failed++
				}
			}
			fmt.Fprintf(w, "%6.1fs sent %d: ok %d, failed %d, lost %d, in flight %d\n",
				time.Since(start).Seconds(), len(rs), ok, failed, lost, l.InFlight())
		}
	}()
	return func() { close(done); wg.Wait() }
}

func machine() map[string]string {
	la, _ := os.ReadFile("/proc/loadavg")
	return map[string]string{"cpus": fmt.Sprint(runtime.NumCPU()), "os": runtime.GOOS + "/" + runtime.GOARCH,
		"go": runtime.Version(), "loadavg_at_start": strings.TrimSpace(string(la))}
}

func (c Config) settings() map[string]string {
	return map[string]string{
		"sim_workers": fmt.Sprint(c.SimWorkers), "llama_worker": fmt.Sprint(c.Llama), "llama_cpus": fmt.Sprint(c.LlamaCPUs),
		"worker_queue": fmt.Sprint(c.WorkerQueue), "worker_running": fmt.Sprint(c.WorkerRunning),
		"users": fmt.Sprint(c.Users), "stream_share": fmt.Sprint(c.StreamShare), "max_tokens": fmt.Sprint(c.MaxTokens), "seed": fmt.Sprint(c.Seed),
		"lease_ttl": c.LeaseTTL.String(), "baseline": c.Baseline.String(), "settle": c.Settle.String(), "gap": c.Gap.String(),
		"burst": fmt.Sprint(c.Burst), "worker_args": strings.Join(c.WorkerArgs, " "), "gateways": "2", "store": "redis", "policy": "cache_aware",
	}
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

func writeWith(path string, fn func(io.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := fn(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
