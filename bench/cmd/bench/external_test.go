package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/bench/report"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/cgoenv"
)

// proxyEnv makes the test binary the stand-in for "any external router"
// (anyRouter) instead of running the tests.
const proxyEnv = "LLMF_BENCH_TEST_ANY_ROUTER"

func TestMain(m *testing.M) {
	if os.Getenv(proxyEnv) != "" {
		os.Exit(anyRouter(os.Args[1:]))
	}
	os.Exit(m.Run())
}

// anyRouter is the smallest OpenAI-compatible router, standing in for any
// router of another make that --external runs: `PORT URL…` listens on
// loopback PORT and passes every request to the next of the pods at URL…
// in turn (round robin), streamed answers flushed as they come. It writes
// one line per request it forwards, so the test counts them in its log.
func anyRouter(args []string) int {
	if len(args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: PORT URL...")
		return 2
	}
	var pods []*httputil.ReverseProxy
	for _, a := range args[1:] {
		u, err := url.Parse(a)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		p := httputil.NewSingleHostReverseProxy(u)
		p.FlushInterval = -1
		pods = append(pods, p)
	}
	var next atomic.Uint64
	srv := &http.Server{Addr: "127.0.0.1:" + args[0], Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		i := (next.Add(1) - 1) % uint64(len(pods))
		fmt.Printf("forwarded %s %s to pod %d\n", r.Method, r.URL.Path, i)
		pods[i].ServeHTTP(w, r)
	})}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	go func() { <-ctx.Done(); srv.Close() }()
	if err := srv.ListenAndServe(); err != http.ErrServerClosed {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// A bench run with an external router in place of our gateway, end to
// end on a fleet of vLLM-like pods: the stand-in for any router (the test
// binary itself as anyRouter, started per run by --external's command
// against that run's pods), and the real SGLang router where it is
// installed under var/sglang-router (python3 -m pip install --target
// var/sglang-router sglang-router). The report has each one's row with
// every request counted and served, its imbalance unknown, and the floor.
func TestExternalRoutersRunInPlaceOfTheGateway(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and starts processes")
	}
	_, file, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(file), "..", "..", "..")
	bin := t.TempDir()
	cmd := exec.Command("go", "build", "-o", bin+"/", "./metadata-center/cmd/metadata-center", "./bench/cmd/vllmsim")
	cmd.Dir = root
	cmd.Env = cgoenv.Environ()
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	policies := []string{"any-router"}
	sglangDir := filepath.Join(root, "var", "sglang-router")
	if _, err := os.Stat(filepath.Join(sglangDir, "sglang_router")); err == nil {
		policies = append(policies, sglangRouter)
	} else {
		t.Logf("sglang-router is not installed under %s: only the stand-in runs", sglangDir)
	}
	out := t.TempDir()
	args := []string{"--bin", bin, "--out", out, "--engine", "vllm", "--workers", "2",
		"--worker-args", "--num-gpu-blocks 64 --max-num-seqs 2 --max-model-len 1024",
		"--policies", strings.Join(policies, ","), "--sglang-router-dir", sglangDir,
		"--external", fmt.Sprintf("any-router=env %s=1 %s {port} {workers}", proxyEnv, exe),
		"--workloads", "kv-pressure", "--systems", "2", "--users", "1", "--turns", "2", "--rate", "20"}
	if err := run(context.Background(), args); err != nil {
		t.Fatal(err)
	}
	var r report.Run
	if err := readJSON(filepath.Join(out, "summary.json"), &r); err != nil {
		t.Fatal(err)
	}
	md, err := os.ReadFile(filepath.Join(out, "report.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range policies {
		var s report.Summary
		ok := false
		for _, x := range r.Summaries {
			if x.Workload == "kv-pressure" && x.Policy == p {
				s, ok = x, true
			}
		}
		if !ok {
			t.Fatalf("no summary of %s in %+v", p, r.Summaries)
		}
		// 2 systems × 1 user × 2 turns, every one answered through the router.
		if s.Requests != 4 || s.Succeeded != 4 || !s.External || !s.UpstreamUnknown || s.CacheHitRate <= 0 {
			t.Errorf("%s: %+v; want 4 requests served, external, imbalance unknown, second turns cached", p, s)
		}
		if !strings.Contains(string(md), "| "+p+" |") {
			t.Errorf("report.md has no row of %s:\n%s", p, md)
		}
	}
	if !strings.Contains(string(md), "Imbalance unknown for "+strings.Join(policies, ", ")) {
		t.Errorf("report.md does not say the imbalance is unknown:\n%s", md)
	}
	if len(r.Floors) != 1 || r.Floors[0].Requests != 4 || !(r.Floors[0].TTFT.P50 > 0) {
		t.Errorf("floors %+v, want kv-pressure's over its 4 requests", r.Floors)
	}
	// The stand-in forwarded the chat completions itself (and the readiness probe).
	logs, _ := filepath.Glob(filepath.Join(out, "logs", "kv-pressure", "any-router", "*", "any-router.log"))
	if len(logs) != 1 {
		t.Fatalf("router logs %v", logs)
	}
	b, _ := os.ReadFile(logs[0])
	if n := strings.Count(string(b), "forwarded POST /v1/chat/completions"); n != 4 {
		t.Errorf("the stand-in forwarded %d chat completions, want 4:\n%s", n, b)
	}
}

func TestExternalFlag(t *testing.T) {
	v := externalFlag{}
	for _, good := range []string{"up=http://10.0.0.1:8000/", "cmd=router --workers {workers_csv} --port {port}"} {
		if err := v.Set(good); err != nil {
			t.Errorf("Set(%q): %v", good, err)
		}
	}
	if v["up"].url != "http://10.0.0.1:8000" || v["cmd"].cmd.Command != "router --workers {workers_csv} --port {port}" {
		t.Errorf("parsed %+v", v)
	}
	for _, bad := range []string{"nolabel", "=http://x", "x=", "x=router --port {port}", "x=router {workers}", "a/b=http://x"} {
		if err := v.Set(bad); err == nil {
			t.Errorf("Set(%q) accepted", bad)
		}
	}
	if _, _, err := v.resolve(sglangRouter, t.TempDir()); err == nil || !strings.Contains(err.Error(), "pip install --target") {
		t.Errorf("sglang-router without its package: %v, want how to install it", err)
	}
	if e, ok, err := v.resolve(sglangRouter, ""); !ok || err != nil || e.cmd.Command != sglangRouterCommand {
		t.Errorf("sglang-router from python3's own packages: %+v %v %v", e, ok, err)
	}
	if _, ok, _ := v.resolve("epp", ""); ok {
		t.Error("epp resolved to an external router")
	}
}
