package fleet

import (
	"bufio"
	"context"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/client"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/cgoenv"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// A fleet of vLLM-like pods on real processes: the gateway routes to them
// under backend vllm, the metadata center scrapes every pod's /metrics, and a
// repeated prompt routed by prefix comes back served from the pod's cache.
func TestVLLMFleetServesAndIsScraped(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and starts processes")
	}
	_, file, _, _ := runtime.Caller(0)
	bin := t.TempDir()
	cmd := exec.Command("go", "build", "-o", bin+"/", "./metadata-center/cmd/metadata-center", "./filter/cmd/gateway", "./bench/cmd/vllmsim")
	cmd.Dir = filepath.Join(filepath.Dir(file), "..", "..")
	cmd.Env = cgoenv.Environ()
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	ctx := context.Background()
	f, err := Start(ctx, Spec{BinDir: bin, LogDir: t.TempDir(), Engine: EngineVLLM, Workers: 3, Policy: "prefix_only"})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Stop()
	if len(f.Workers) != 3 {
		t.Fatalf("%d pods, want 3", len(f.Workers))
	}
	system := strings.Repeat("a shared system prompt of many words for the cache ", 40)
	send := func() (worker string, cached int) {
		res := (&client.Client{}).Do(ctx, f.Gateway, client.Request{Model: "tiny", Stream: true, MaxTokens: 4, Usage: true,
			Messages: []client.Message{{Role: "system", Content: system}, {Role: "user", Content: "hello"}}})
		if res.Outcome != client.OK {
			t.Fatalf("%s: %s", res.Outcome, res.Err)
		}
		return res.Worker, res.CachedTokens
	}
	first, _ := send()
	if !strings.Contains(strings.Join(f.Workers, " "), first) || first == "" {
		t.Fatalf("answered by %q, not one of the pods %v", first, f.Workers)
	}
	// The gateway learns where the prefix went from its own routing; wait
	// (bounded) until a repeat lands on the holder and hits its cache.
	var w string
	var cached int
	if !wait.Until(10*time.Second, func() bool {
		w, cached = send()
		return w == first && cached > 0
	}) {
		t.Fatalf("repeats never hit the first pod's cache (last: %s, cached %d)", w, cached)
	}
	// The metadata center scrapes the pods: it counts successful scrapes.
	if !wait.Until(10*time.Second, func() bool { return scrapesOK(t, f.MC) >= 3 }) {
		b, _ := os.ReadFile(filepath.Join(f.LogDir, "metadata-center.log"))
		t.Fatalf("the metadata center scraped no vllm pod:\n%s", b)
	}
}

func scrapesOK(t *testing.T, mc string) float64 {
	t.Helper()
	resp, err := http.Get(mc + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "llmf_metadata_center_scrapes_total{") && strings.Contains(line, `backend="vllm"`) && strings.Contains(line, `result="ok"`) {
			v, _ := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
			return v
		}
	}
	return 0
}
