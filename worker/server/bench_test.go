package server

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/worker/ggufgen"
)

// benchModel is the bench preset (8 layers, 512 wide): $LLMF_BENCH_MODEL,
// or generated once into the user cache directory.
func benchModel(b *testing.B) string {
	if p := os.Getenv("LLMF_BENCH_MODEL"); p != "" {
		return p
	}
	dir, err := os.UserCacheDir()
	if err != nil {
		dir = os.TempDir()
	}
	p := ggufgen.Bench()
	path := filepath.Join(dir, "istio-llm-filter", p.ID(ggufgen.DefaultSeed)+".gguf")
	if _, err := os.Stat(path); err == nil {
		return path
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		b.Fatal(err)
	}
	if err := ggufgen.WriteFile(path, ggufgen.Options{Preset: p, Seed: ggufgen.DefaultSeed}); err != nil {
		b.Fatal(err)
	}
	return path
}

// BenchmarkNChoicesTTFT is the time from sending a streamed chat request
// with a cold ~1,000-token prompt until every one of its n choices has sent
// its first content, on the bench preset (LLMF_THREADS threads, default 2),
// for n=1 and n=4 in turn within each iteration (paired, so a machine
// shared with other work slows both alike). The n choices share one
// prefill, so n=4 should cost little more than n=1 (aim: ratio ≤ 1.3):
//
//	go test -run '^$' -bench NChoicesTTFT -benchtime 3x ./worker/server/
func BenchmarkNChoicesTTFT(b *testing.B) {
	threads, _ := strconv.Atoi(os.Getenv("LLMF_THREADS"))
	if threads == 0 {
		threads = 2
	}
	w := startWorker(b, opts{model: benchModel(b), nCtx: 8192, nSeq: 8, threads: threads})
	ttft := func(n, round int) time.Duration {
		body, _ := json.Marshal(map[string]any{"model": "tiny", "n": n, "max_tokens": 2, "ignore_eos": true, "stream": true,
			"messages": msgs("user", longText(1000, fmt.Sprintf("round %d", round)))}) // a new prompt every time: nothing cached
		start := time.Now()
		resp, err := http.Post(w.url+"/v1/chat/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			b.Fatal(err)
		}
		defer resp.Body.Close()
		first := map[int]bool{}
		var took time.Duration
		for _, ev := range sse(b, resp.Body) {
			var c struct {
				Choices []struct {
					Index int `json:"index"`
					Delta struct {
						Content *string `json:"content"`
					} `json:"delta"`
				} `json:"choices"`
			}
			json.Unmarshal([]byte(ev), &c)
			for _, ch := range c.Choices {
				if ch.Delta.Content != nil && *ch.Delta.Content != "" && !first[ch.Index] {
					first[ch.Index] = true
					if len(first) == n {
						took = time.Since(start)
					}
				}
			}
		}
		if len(first) != n {
			b.Fatalf("%d of %d choices wrote", len(first), n)
		}
		return took
	}
	var one, four time.Duration
	for i := range b.N {
		one += ttft(1, 2*i)
		four += ttft(4, 2*i+1)
	}
	b.ReportMetric(float64(one.Milliseconds())/float64(b.N), "ms_ttft_n1")
	b.ReportMetric(float64(four.Milliseconds())/float64(b.N), "ms_ttft_n4")
	b.ReportMetric(float64(four)/float64(one), "n4/n1")
}
