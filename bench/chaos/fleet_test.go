package chaos

import (
	"context"
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/fleet"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/cgoenv"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
	buildOut  []byte
)

// buildBinaries builds the fleet's commands once per test binary into a
// temporary directory, with the project's cgo flags (the Makefile's).
func buildBinaries(t *testing.T) string {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Skip("redis-server not installed (make test installs it)")
	}
	buildOnce.Do(func() {
		_, file, _, _ := runtime.Caller(0)
		root := filepath.Join(filepath.Dir(file), "..", "..")
		if binDir, buildErr = os.MkdirTemp("", "llmf-chaos-bin-"); buildErr != nil {
			return
		}
		cmd := exec.Command("go", "build", "-o", binDir+"/", "./metadata-center/cmd/metadata-center", "./worker/cmd/worker", "./filter/cmd/gateway")
		cmd.Dir = root
		cmd.Env = cgoenv.Environ()
		buildOut, buildErr = cmd.CombinedOutput()
	})
	if buildErr != nil {
		t.Fatalf("go build: %v\n%s", buildErr, buildOut)
	}
	return binDir
}

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

// TestFaultsOnARealFleet runs a short schedule — a worker killed with a
// stream in flight and restarted on its address, a rolling restart of
// every worker, Redis frozen, a gateway killed and restarted — on real
// processes (Redis, the metadata center, two gateways, two simulated
// workers and a llama.cpp worker on the generated tiny model) under the
// steady load, and checks what the harness relies on: every fault
// injected and recovered without error, the restarted parts answering on
// their old addresses, the index check reading both sides, every request
// recorded with an outcome, and no lease left one lease TTL after the
// load stopped. The rolling restart must meet its aim: every worker
// replaced (the llama one too), no stream cut, no request lost or failed.
func TestFaultsOnARealFleet(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a fleet of processes")
	}
	bin := buildBinaries(t)
	// The llama worker without a CPU quota: the test needs no writable
	// cgroup (only the slow-worker fault, not run here, uses one).
	cfg := Config{Bin: bin, Out: t.TempDir(), SimWorkers: 2, Llama: true, Model: testmodel.Path(t), LlamaCPUs: -1,
		Users: 3, MaxTokens: 16, LeaseTTL: 3 * time.Second, Baseline: 6 * time.Second, Gap: 3 * time.Second,
		Faults: []string{"worker-kill", "rolling-restart", "redis-pause", "gateway-kill"}}
	res, err := RunChaos(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Faults) != len(cfg.Faults) {
		t.Fatalf("%d fault windows", len(res.Faults))
	}
	var recs []Record
	readJSONFile(t, filepath.Join(cfg.Out, "results.json"), &recs)
	if len(recs) == 0 {
		t.Fatal("no requests recorded")
	}
	for _, r := range recs {
		switch r.Outcome {
		case OK, Failed, Reset, Cut, Unanswered, Aborted:
		default:
			t.Fatalf("request %d without an outcome: %+v", r.ID, r)
		}
	}
	for _, f := range res.Faults {
		if f.Err != "" {
			t.Errorf("%s: %s", f.Name, f.Err)
		}
		if f.Sent == 0 {
			t.Errorf("%s: no request in its window", f.Name)
		}
		if f.Check.Err != "" || f.Check.IndexEntries == 0 {
			t.Errorf("%s: index check %+v", f.Name, f.Check)
		}
	}
	if res.Final.Leases != 0 || res.Final.Err != "" {
		t.Errorf("one lease TTL after the load: %+v", res.Final)
	}
	// The baseline holds the requests that ran entirely before the first
	// fault; on a loaded machine a few-second window may hold none (cold
	// prefills take seconds), but those it holds must have succeeded.
	if res.Initial.IndexEntries == 0 || res.Baseline.Requests > 0 && res.Baseline.SuccessRate < 0.9 {
		t.Errorf("baseline %+v, initial check %+v", res.Baseline, res.Initial)
	}
	ok := 0
	for _, r := range recs {
		if r.Outcome == OK {
			ok++
		}
	}
	if ok < len(recs)/2 {
		t.Errorf("%d of %d requests succeeded under the faults", ok, len(recs))
	}
	checkRollingRestart(t, res.Faults[1], recs, cfg.SimWorkers+1)
	for _, name := range []string{"summary.json", "report.md", "chaos_ttft.svg", "chaos_errors.svg", "final_index.json"} {
		if st, err := os.Stat(filepath.Join(cfg.Out, name)); err != nil || st.Size() == 0 {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// checkRollingRestart checks the rolling restart's window: every one of
// the workers restarted once, on its address, as a new process that got
// ready (the llama worker among them), and not one request of the window
// cut, unanswered or failed.
func checkRollingRestart(t *testing.T, f FaultStats, recs []Record, workers int) {
	t.Helper()
	if f.Name != "rolling-restart" {
		t.Fatalf("window %s, want rolling-restart", f.Name)
	}
	byID := map[int]Record{}
	for _, r := range recs {
		byID[r.ID] = r
	}
	seen, llama, drained := map[string]bool{}, 0, 0
	for _, rs := range f.Restarts {
		// What the worker was serving at the SIGTERM finished there.
		for _, id := range rs.InFlight {
			if r, ok := byID[id]; !ok || r.Outcome != OK {
				t.Errorf("request %d in flight on %s at its SIGTERM ended %+v", id, rs.Worker, r)
			}
		}
		drained += rs.Streaming
		if rs.Err != "" || rs.OldPID == 0 || rs.NewPID == 0 || rs.NewPID == rs.OldPID || seen[rs.Worker] {
			t.Errorf("restart %+v", rs)
		}
		seen[rs.Worker] = true
		if rs.Engine == "llama" {
			llama++
		}
		t.Logf("rolling restart: %s worker %s pid %d → %d, %d in flight at SIGTERM (%d streaming), drained in %.2f s, ready %.2f s later",
			rs.Engine, rs.Worker, rs.OldPID, rs.NewPID, len(rs.InFlight), rs.Streaming, rs.DrainS, rs.ReadyS)
	}
	if len(seen) != workers || len(f.Restarts) != workers || llama != 1 {
		t.Errorf("%d restarts of %d workers (%d llama), want each of the %d once, the llama one among them", len(f.Restarts), len(seen), llama, workers)
	}
	if drained == 0 {
		t.Error("no worker had a stream in flight at its SIGTERM: the drain let none finish")
	}
	if f.Lost != 0 || f.Unexpected != 0 || len(f.Failed) != 0 {
		t.Errorf("rolling restart: %d lost, %d unexpected failures (%s) of %d sent", f.Lost, f.Unexpected, joinCounts(f.Failed), f.Sent)
	}
	cut, unanswered, streams := 0, 0, 0
	for _, r := range recs {
		if r.Fault != f.Name {
			continue
		}
		switch r.Outcome {
		case Cut:
			cut++
		case Unanswered:
			unanswered++
		}
		if r.Stream {
			streams++
		}
	}
	if cut != 0 || unanswered != 0 {
		t.Errorf("rolling restart: %d streams cut, %d requests unanswered", cut, unanswered)
	}
	t.Logf("rolling restart: %d requests (%d streamed) in its window, %d succeeded, %d retried by the client (%s)",
		f.Sent, streams, f.Succeeded, f.Retried, joinCounts(f.Retries))
}

// TestFleetRestartsPartsOnTheirAddresses checks the fleet operations the
// faults are made of, one by one, on real processes.
func TestFleetRestartsPartsOnTheirAddresses(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a fleet of processes")
	}
	bin := buildBinaries(t)
	ctx := context.Background()
	f, err := fleet.Start(ctx, fleet.Spec{BinDir: bin, LogDir: t.TempDir(), Engine: "sim", Workers: 1, ModelName: "tiny",
		Policy: "cache_aware", Store: "redis", Gateways: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Stop()
	up := func(url string) bool {
		c := http.Client{Timeout: 500 * time.Millisecond}
		resp, err := c.Get(url)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	}
	w := "http://" + f.Workers[0] + "/healthz"
	f.KillWorker(0)
	if up(w) {
		t.Fatal("worker answers after kill -9")
	}
	if err := f.RestartWorker(ctx, 0); err != nil || !up(w) {
		t.Fatalf("worker not back on %s: %v", f.Workers[0], err)
	}
	f.KillGateway(1)
	if up(f.Gateways[1] + "/healthz") {
		t.Fatal("gateway answers after kill -9")
	}
	if err := f.RestartGateway(ctx, 1); err != nil || !up(f.Gateways[1]+"/healthz") {
		t.Fatalf("gateway not back: %v", err)
	}
	ready := f.MC + "/readyz"
	if err := f.PauseRedis(); err != nil {
		t.Fatal(err)
	}
	if up(ready) {
		t.Error("metadata center ready while Redis is frozen")
	}
	if err := f.ResumeRedis(); err != nil {
		t.Fatal(err)
	}
	if err := f.StopRedis(); err != nil {
		t.Fatal(err)
	}
	if up(ready) {
		t.Error("metadata center ready while Redis is down")
	}
	if err := f.StartRedis(ctx); err != nil {
		t.Fatal(err)
	}
	if !wait.Until(10*time.Second, func() bool { return up(ready) }) {
		t.Fatal("metadata center not ready again after Redis came back")
	}
	names := map[string]bool{}
	for _, p := range f.Procs() {
		names[p.Name] = true
	}
	for _, n := range []string{"redis-0", "metadata-center", "worker-0", "gateway", "gateway-1"} {
		if !names[n] {
			t.Errorf("process %s missing from %v", n, names)
		}
	}
}

func readJSONFile(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatal(err)
	}
}
