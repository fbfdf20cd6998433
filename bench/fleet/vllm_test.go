package fleet

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/url"
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
	bin := buildFleet(t)
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

// A vLLM-like pod evicts its least recently used blocks and tells nobody;
// the gateway sends its reported KV capacity with each save, and the
// metadata center's index keeps no more of the pod than that capacity
// (in prompt-hash blocks), the most recent prompt whole.
func TestTheIndexKeepsNoMoreOfAPodThanItsKVCacheHolds(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and starts processes")
	}
	bin := buildFleet(t)
	ctx := context.Background()
	const blocks, blockSize = 64, 16 // 1,024 tokens of KV
	f, err := Start(ctx, Spec{BinDir: bin, LogDir: t.TempDir(), Engine: EngineVLLM, Workers: 1, Policy: "cache_aware",
		WorkerArgs: []string{"--num-gpu-blocks", fmt.Sprint(blocks), "--block-size", fmt.Sprint(blockSize), "--max-model-len", "1024"}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Stop()
	// The capacity reaches the gateway with the pod's scraped signals.
	if !wait.Until(10*time.Second, func() bool { return scrapesOK(t, f.MC) >= 2 }) {
		t.Fatal("the metadata center scraped no vllm pod")
	}
	send := func(i int) {
		system := strings.Repeat(fmt.Sprintf("document %d tells of the cache and its many words ", i), 40) // ~2 KB: 4 blocks
		res := (&client.Client{}).Do(ctx, f.Gateway, client.Request{Model: "tiny", Stream: true, MaxTokens: 2, Usage: true,
			Messages: []client.Message{{Role: "system", Content: system}, {Role: "user", Content: "summarise"}}})
		if res.Outcome != client.OK {
			t.Fatalf("prompt %d: %s: %s", i, res.Outcome, res.Err)
		}
	}
	const prompts = 12 // ~48 blocks sent, far past what the pod holds
	for i := range prompts {
		send(i)
	}
	// 1,024 tokens at the workload text's bytes per token (vllmsim's
	// tokenizer: about 3.6; 4.5 leaves room for what the gateway learnt),
	// in the gateway's 512-byte blocks.
	most := int(math.Ceil(blocks * blockSize * 4.5 / 512))
	var held int
	if !wait.Until(10*time.Second, func() bool {
		held = indexEntries(t, f.MC, f.Workers[0])
		return held >= 4 && held <= most
	}) {
		t.Fatalf("the index holds %d blocks of the pod, want 4 (the last prompt) to %d (its KV capacity)", held, most)
	}
}

// buildFleet builds the binaries of a vLLM-like fleet into a temporary
// directory.
func buildFleet(t *testing.T) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	bin := t.TempDir()
	cmd := exec.Command("go", "build", "-o", bin+"/", "./metadata-center/cmd/metadata-center", "./filter/cmd/gateway", "./bench/cmd/vllmsim")
	cmd.Dir = filepath.Join(filepath.Dir(file), "..", "..")
	cmd.Env = cgoenv.Environ()
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// indexEntries counts the cache-index entries of the pod at ip:port pod.
func indexEntries(t *testing.T, mc, pod string) int {
	t.Helper()
	resp, err := http.Get(mc + "/debug/cache/index?cluster=" + url.QueryEscape(Cluster))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var idx map[string][]string
	if err := json.NewDecoder(resp.Body).Decode(&idx); err != nil {
		t.Fatal(err)
	}
	return len(idx[pod])
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
