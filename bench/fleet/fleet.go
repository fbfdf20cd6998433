// Package fleet starts the whole system as real processes on loopback — a
// metadata center, N workers and the standalone gateway — from the binaries
// `make build` produces, and stops them again. The benchmark starts a fresh
// fleet for every workload × policy pair so that no policy inherits another's
// warm caches.
package fleet

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/internal/cpulimit"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/podsignals"
)

// Spec describes one fleet.
type Spec struct {
	BinDir     string   // holds metadata-center, worker, gateway (and vllmsim for vllm, epp for envoy-epp)
	LogDir     string   // one log file per process
	Engine     string   // sim | llama | vllm (EngineVLLM)
	Workers    int      // number of worker processes (vllm: pods, all in one vllmsim process)
	Model      string   // GGUF path (llama; optional for sim)
	ModelName  string   // the OpenAI model name clients send
	Policy     string   // the filter's lb policy for the whole cluster
	LBRule     string   // extra lb_mapping_rule keys, YAML flow style ("cache_ratio_weight: 4, ...")
	WorkerArgs []string // extra worker flags (scheduler sizes, sim cost knobs), or vllmsim flags
	WorkerCPUs float64  // if > 0, each worker's CPU quota (cgroups): pods with their own compute
	Store      string   // metadata-center store: memory (default) | redis | redis-cluster
	RedisAddr  string   // empty with redis / redis-cluster: the fleet starts its own
	// RedisPrefix is --redis-key-prefix: tests sharing one redis-server keep apart.
	RedisPrefix string
	// Gateways and MetadataCenters (default 1 each) scale the routing tier
	// out: gateway i and worker i talk to metadata center i mod
	// MetadataCenters, and clients spread requests over Gateways. More than
	// one metadata center needs a shared store (redis or redis-cluster).
	Gateways        int
	MetadataCenters int
	// MCArgs are extra metadata-center flags (e.g. a short --lease-ttl).
	MCArgs []string
	// QueryTimeout, if set, is the gateways' metadata_center.query_timeout
	// (default 100ms). On a loaded 2-core machine route queries miss 100ms
	// now and then, and a turn routed without metadata lands on a random
	// pod and prefills its whole history again (docs/benchmarks.md).
	QueryTimeout time.Duration
	// GatewayLogLevel is the gateways' log_level (default warn); debug
	// logs every decision's per-scorer scores.
	GatewayLogLevel string
	// GatewayFilter are extra keys of the gateways' filter document, YAML
	// indented by two spaces (e.g. "  tracing: {otlp_endpoint: ...}\n").
	GatewayFilter string
	// Extra are workers of other kinds started after the Workers ones
	// (a real llama.cpp worker beside simulated ones).
	Extra []WorkerSpec
	// Topology is how clients reach the workers (epp.go): the standalone
	// gateway ("" or TopologyGateway), or the upstream Envoy ($LLMF_TEST_ENVOY)
	// with our endpoint picker or straight to the workers; Gateway is then
	// Envoy's URL.
	Topology string
	// NoGateway starts the fleet without our gateways: a router of another
	// make takes the clients' requests (StartRouter, bench --external).
	NoGateway bool
}

// WorkerSpec is one extra worker.
type WorkerSpec struct {
	Engine string
	Model  string
	Args   []string
	CPUs   float64 // if > 0, its CPU quota (cgroups)
}

// Cluster is the Envoy-style cluster name the fleet's workers form.
const Cluster = "outbound|8000||bench-pool.local"

// EngineVLLM is the engine of a fleet of vLLM-like pods (bench/vllmsim):
// one vllmsim process serves them all, the gateway's rule says `backend:
// vllm`, and the metadata center scrapes their /metrics every
// ScrapeInterval instead of taking pushed reports.
const EngineVLLM = "vllm"

// ScrapeInterval is how often the metadata center scrapes vLLM-like pods,
// as the llm-d endpoint picker scrapes its pods in the comparison of
// docs/benchmarks.md (50 ms).
const ScrapeInterval = 50 * time.Millisecond

// Fleet is a running system.
type Fleet struct {
	Gateway  string   // base URL of the (first) gateway
	Gateways []string // base URLs of every gateway
	MC       string   // base URL of the (first) metadata center
	MCs      []string // base URLs of every metadata center
	Workers  []string // worker ip:port, as the router knows them
	LogDir   string   // one <process>.log per process

	spec    Spec
	mcArgs  []string
	procs   []*exec.Cmd
	mc      *exec.Cmd
	workers []*exec.Cmd
	limits  []*cpulimit.Group

	// What restarting a part on its address needs (chaos.go).
	workerArgs [][]string
	workerCPUs []float64
	workerLim  []*cpulimit.Group // by worker index; nil when unlimited
	gateways   []*exec.Cmd
	gwArgs     [][]string
	redis      *exec.Cmd
	redisArgs  []string
	RedisAddr  string // the fleet's own redis-server, when it started one
	names      map[*exec.Cmd]string
	closers    []func() // Envoys (epp.go), stopped first
}

// Start launches the fleet and waits until every part answers /healthz.
func Start(ctx context.Context, s Spec) (*Fleet, error) {
	if s.ModelName == "" {
		s.ModelName = "tiny"
	}
	if s.Store == "" {
		s.Store = "memory"
	}
	if err := os.MkdirAll(s.LogDir, 0o755); err != nil {
		return nil, err
	}
	f := &Fleet{spec: s, LogDir: s.LogDir}
	ok := false
	defer func() {
		if !ok {
			f.Stop()
		}
	}()
	s.Gateways, s.MetadataCenters = max(1, s.Gateways), max(1, s.MetadataCenters)
	if s.MetadataCenters > 1 && s.Store == "memory" {
		return nil, errors.New("fleet: several metadata centers need a shared store (redis or redis-cluster)")
	}
	redisAddr := s.RedisAddr
	if redisAddr == "" && s.Store != "memory" {
		a, err := f.startRedis(ctx, s)
		if err != nil {
			return nil, err
		}
		redisAddr = a
	}
	if s.Engine == EngineVLLM {
		if err := f.startVLLMPods(ctx, s); err != nil {
			return nil, err
		}
	}
	for i := range s.MetadataCenters {
		mc, err := freeAddr()
		if err != nil {
			return nil, err
		}
		args := append([]string{"--listen", mc, "--store", s.Store}, s.MCArgs...)
		if s.Engine == EngineVLLM {
			scrape := filepath.Join(s.LogDir, fmt.Sprintf("scrape-%d.yaml", i))
			if err := os.WriteFile(scrape, scrapeConfig(f.Workers), 0o644); err != nil {
				return nil, err
			}
			args = append(args, "--scrape-config", scrape, "--scrape-interval", ScrapeInterval.String())
		}
		if s.Store == "redis-cluster" {
			args[3] = "redis"
			args = append(args, "--redis-cluster")
		}
		if redisAddr != "" {
			args = append(args, "--redis-addr", redisAddr)
		}
		if s.RedisPrefix != "" {
			args = append(args, "--redis-key-prefix", s.RedisPrefix)
		}
		if i == 0 {
			f.MC, f.mcArgs = "http://"+mc, args
			if err := f.StartMC(ctx); err != nil {
				return nil, err
			}
		} else {
			if _, err := f.spawn(s, "metadata-center", fmt.Sprintf("metadata-center-%d", i), args...); err != nil {
				return nil, err
			}
			if err := waitHealthy(ctx, "http://"+mc+"/healthz"); err != nil {
				return nil, fmt.Errorf("metadata center %d: %w", i, err)
			}
		}
		f.MCs = append(f.MCs, "http://"+mc)
	}
	kinds := make([]WorkerSpec, 0, s.Workers+len(s.Extra))
	if s.Engine != EngineVLLM {
		for range s.Workers {
			kinds = append(kinds, WorkerSpec{Engine: s.Engine, Model: s.Model, Args: s.WorkerArgs, CPUs: s.WorkerCPUs})
		}
	}
	kinds = append(kinds, s.Extra...)
	for _, k := range kinds {
		i := len(f.Workers)
		addr, err := freeAddr()
		if err != nil {
			return nil, err
		}
		args := []string{"--listen", addr, "--engine", k.Engine, "--model-name", s.ModelName,
			"--metadata-center", f.MCs[i%len(f.MCs)], "--advertise-host", addr, "--cluster", Cluster}
		if k.Model != "" {
			args = append(args, "--model", k.Model)
		}
		args = append(args, k.Args...)
		f.Workers = append(f.Workers, addr)
		f.workerArgs = append(f.workerArgs, args)
		f.workerCPUs = append(f.workerCPUs, k.CPUs)
		f.workers = append(f.workers, nil)
		f.workerLim = append(f.workerLim, nil)
		if err := f.spawnWorker(i); err != nil {
			return nil, err
		}
	}
	for _, w := range f.Workers[len(f.Workers)-len(kinds):] {
		if err := waitHealthy(ctx, "http://"+w+"/healthz"); err != nil {
			return nil, fmt.Errorf("worker %s: %w", w, err)
		}
	}
	if s.NoGateway {
		s.Gateways = 0
	}
	for i := range s.Gateways {
		gw, err := freeAddr()
		if err != nil {
			return nil, err
		}
		name := "gateway"
		if i > 0 {
			name = fmt.Sprintf("gateway-%d", i)
		}
		// freeAddr's port is free only until another process binds it: with
		// several benches at once a gateway can lose its port and the
		// health check then reaches another run's gateway, which would
		// serve (and skew) both runs. A gateway that is gone after its
		// health check is started again on a new port.
		for attempt := 1; ; attempt++ {
			cfg := filepath.Join(s.LogDir, name+".yaml")
			if err := os.WriteFile(cfg, []byte(gatewayConfig(gw, f.MCs[i%len(f.MCs)], s, f.Workers)), 0o644); err != nil {
				return nil, err
			}
			p, err := f.spawn(s, "gateway", name, "--config", cfg)
			if err != nil {
				return nil, err
			}
			if err := waitHealthy(ctx, "http://"+gw+"/healthz"); err != nil {
				return nil, fmt.Errorf("%s: %w", name, err)
			}
			time.Sleep(200 * time.Millisecond) // a failed bind exits at once
			if exited(p) {
				f.terminate(p)
				if attempt == 3 {
					return nil, fmt.Errorf("%s: exited after its health check three times (port taken?), see %s", name, filepath.Join(s.LogDir, name+".log"))
				}
				if gw, err = freeAddr(); err != nil {
					return nil, err
				}
				continue
			}
			f.gateways = append(f.gateways, p)
			f.gwArgs = append(f.gwArgs, []string{"--config", cfg})
			break
		}
		f.Gateways = append(f.Gateways, "http://"+gw)
	}
	if s.NoGateway {
		ok = true
		return f, nil
	}
	f.Gateway = f.Gateways[0]
	switch s.Topology {
	case "", TopologyGateway:
	case TopologyEnvoyEPP, TopologyEnvoyDirect:
		start := f.StartEnvoyEPP
		if s.Topology == TopologyEnvoyDirect {
			start = f.StartEnvoyDirect
		}
		url, err := start(ctx, "")
		if err != nil {
			return nil, err
		}
		f.Gateway, f.Gateways = url, []string{url}
	default:
		return nil, fmt.Errorf("fleet: unknown topology %q", s.Topology)
	}
	ok = true
	return f, nil
}

// startVLLMPods starts one vllmsim process serving s.Workers pods on
// ports it picks itself (no race for free ports between 64 listeners),
// reads their addresses from its --addr-file and waits until each answers
// /health.
func (f *Fleet) startVLLMPods(ctx context.Context, s Spec) error {
	file := filepath.Join(s.LogDir, "vllmsim.addrs")
	_ = os.Remove(file)
	args := append([]string{"--pods", fmt.Sprint(s.Workers), "--listen", "127.0.0.1:0", "--addr-file", file, "--model-name", s.ModelName}, s.WorkerArgs...)
	p, err := f.spawn(s, "vllmsim", "vllmsim", args...)
	if err != nil {
		return err
	}
	logs := filepath.Join(s.LogDir, "vllmsim.log")
	var addrs []string
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if b, err := os.ReadFile(file); err == nil {
			addrs = strings.Fields(string(b))
			break
		}
		if exited(p) {
			return fmt.Errorf("vllmsim exited before listening, see %s", logs)
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("vllmsim: no pod addresses after 60s, see %s", logs)
		}
	}
	if len(addrs) != s.Workers {
		return fmt.Errorf("vllmsim listed %d pods, want %d (see %s)", len(addrs), s.Workers, file)
	}
	for _, a := range addrs {
		if err := waitHealthy(ctx, "http://"+a+"/health"); err != nil {
			return fmt.Errorf("vLLM-like pod %s: %w (see %s)", a, err, logs)
		}
	}
	f.Workers = append(f.Workers, addrs...)
	for range addrs {
		f.workerArgs = append(f.workerArgs, nil)
		f.workerCPUs = append(f.workerCPUs, 0)
		f.workers = append(f.workers, nil)
		f.workerLim = append(f.workerLim, nil)
	}
	return nil
}

// CheckRule parses the filter section of the gateway file Start would write
// for s (its Policy and LBRule), so that a mistyped --variant or --lb-rule
// fails before any fleet starts instead of as a gateway that never becomes
// healthy, runs into the benchmark.
func CheckRule(s Spec) error {
	_, _, err := parseGatewayConfig(gatewayConfig("127.0.0.1:1", "http://127.0.0.1:2", s, []string{"127.0.0.1:3"}))
	if err != nil {
		return fmt.Errorf("policy %s with %q: %w", s.Policy, s.LBRule, err)
	}
	return nil
}

// parseGatewayConfig reads a file gatewayConfig wrote: its log_level, and
// its filter section through the filter's own parser.
func parseGatewayConfig(doc string) (logLevel string, cfg *config.Config, err error) {
	j, err := yaml.YAMLToJSON([]byte(doc))
	if err != nil {
		return "", nil, fmt.Errorf("not YAML: %w", err)
	}
	var file struct {
		LogLevel string `json:"log_level"`
		Filter   json.RawMessage
	}
	if err := json.Unmarshal(j, &file); err != nil {
		return "", nil, err
	}
	cfg, err = config.Parse(file.Filter)
	return file.LogLevel, cfg, err
}

func gatewayConfig(listen, mc string, s Spec, workers []string) string {
	extra, mcExtra := "", ""
	if s.LBRule != "" {
		extra = ", " + s.LBRule
	}
	if s.QueryTimeout > 0 {
		mcExtra = fmt.Sprintf(", query_timeout: %q", s.QueryTimeout.String())
	}
	logLevel := cmp.Or(s.GatewayLogLevel, "warn")
	backend := "llamacpp" // our workers speak llama-server's API and push their signals
	if s.Engine == EngineVLLM {
		backend = "vllm"
	}
	return fmt.Sprintf(`listen: %s
log_level: %s
filter:
  protocol: openai
  metadata_center: {address: %s%s}
  model_mapping_rule:
    %s:
      - {cluster: %q, backend: %s}
  lb_mapping_rule:
    default: {policy: %s%s}
  endpoints:
    static:
      %q: [%s]
%s`, listen, logLevel, mc, mcExtra, s.ModelName, Cluster, backend, s.Policy, extra, Cluster, strings.Join(workers, ", "), s.GatewayFilter)
}

// StartMC (re)starts the metadata center on its address, e.g. after StopMC.
func (f *Fleet) StartMC(ctx context.Context) error {
	p, err := f.spawn(f.spec, "metadata-center", "metadata-center", f.mcArgs...)
	if err != nil {
		return err
	}
	f.mc = p
	if err := waitHealthy(ctx, f.MC+"/healthz"); err != nil {
		return fmt.Errorf("metadata center: %w", err)
	}
	return nil
}

// StopMC stops the metadata center, leaving the rest of the fleet running.
func (f *Fleet) StopMC() { f.terminate(f.mc) }

// KillWorker kills worker i outright (SIGKILL), as a crashed pod would die.
func (f *Fleet) KillWorker(i int) { f.kill(f.workers[i]) }

func (f *Fleet) spawn(s Spec, bin, name string, args ...string) (*exec.Cmd, error) {
	return f.spawnPath(s, filepath.Join(s.BinDir, bin), name, args...)
}

// spawnPath starts path (a file, or a command looked up on PATH) with its
// output in <LogDir>/<name>.log.
func (f *Fleet) spawnPath(s Spec, path, name string, args ...string) (*exec.Cmd, error) {
	return f.spawnEnv(s, path, name, nil, args...)
}

// spawnEnv is spawnPath with env added to this process's environment.
func (f *Fleet) spawnEnv(s Spec, path, name string, env []string, args ...string) (*exec.Cmd, error) {
	logf, err := os.OpenFile(filepath.Join(s.LogDir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(path, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// A bench that dies without stopping its fleet (killed, or by a write
	// to a closed pipe) takes it along: no pod, gateway or metadata center
	// outlives the run to load the next one.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	logf.Close() // the child holds its own descriptor
	f.procs = append(f.procs, cmd)
	if f.names == nil {
		f.names = map[*exec.Cmd]string{}
	}
	f.names[cmd] = name
	return cmd, nil
}

// Stop terminates every process still running, newest first.
func (f *Fleet) Stop() {
	for i := len(f.closers) - 1; i >= 0; i-- {
		f.closers[i]()
	}
	f.closers = nil
	for i := len(f.procs) - 1; i >= 0; i-- {
		f.terminate(f.procs[i])
	}
	for _, l := range f.limits {
		l.Remove()
	}
	f.limits = nil
}

// terminate sends SIGTERM, then SIGKILL after 5 s.
func (f *Fleet) terminate(p *exec.Cmd) {
	if p == nil {
		return
	}
	_ = p.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = p.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = p.Process.Kill()
		<-done
	}
	f.forget(p)
}

func (f *Fleet) forget(p *exec.Cmd) {
	delete(f.names, p)
	for i, q := range f.procs {
		if q == p {
			f.procs = append(f.procs[:i], f.procs[i+1:]...)
			return
		}
	}
}

// exited reports whether a started process has exited (a zombie not yet
// reaped counts as exited). Where /proc does not exist it says false.
func exited(p *exec.Cmd) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.Process.Pid))
	if err != nil {
		return errors.Is(err, fs.ErrNotExist) && procExists()
	}
	// pid (comm) state ...: comm may hold spaces and parentheses.
	i := bytes.LastIndexByte(b, ')')
	return i < 0 || i+2 >= len(b) || b[i+2] == 'Z' || b[i+2] == 'X'
}

func procExists() bool {
	_, err := os.Stat("/proc/self/stat")
	return err == nil
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

func waitHealthy(ctx context.Context, url string) error {
	return waitAnswering(ctx, url, nil)
}

// healthyWithin bounds how long a process may take to answer 200.
const healthyWithin = 60 * time.Second

// waitAnswering polls url until it answers 200, for healthyWithin at most;
// with p set, it gives up as soon as p has exited.
func waitAnswering(ctx context.Context, url string, p *exec.Cmd) error {
	deadline := time.Now().Add(healthyWithin)
	var last error = errors.New("not answering")
	for time.Now().Before(deadline) {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		resp, err := http.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = fmt.Errorf("status %d", resp.StatusCode)
		} else {
			last = err
		}
		if p != nil && exited(p) {
			return fmt.Errorf("exited before %s answered (%w)", url, last)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("%s not healthy after %v: %w", url, healthyWithin, last)
}

// scrapeConfig is the metadata center's scrape configuration
// (podsignals.Config) for a vLLM-like fleet: every pod under the bench's
// cluster, backend vllm.
func scrapeConfig(pods []string) []byte {
	b, _ := json.Marshal(podsignals.Config{Clusters: map[string]podsignals.ClusterTargets{
		Cluster: {Backend: podsignals.BackendVLLM, Pods: pods},
	}})
	return b
}
