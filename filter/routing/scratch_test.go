package routing

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// yieldingHeaders lets other decisions run at each header lookup, which
// the decider makes between parsing and hashing: a buffer handed back too
// early would then be overwritten before it is read.
type yieldingHeaders map[string]string

func (h yieldingHeaders) Get(k string) (string, bool) {
	runtime.Gosched()
	v, ok := h[k]
	return v, ok
}

// TestPooledScratchKeepsDecisionsApart runs decisions of different prompts
// concurrently through the decider's pooled per-decision buffers (prompt
// texts, canonical bytes, sums, cache view): every decision must carry its
// own prompt's hashes and its own host's cache ratio, as if computed alone.
func TestPooledScratchKeepsDecisionsApart(t *testing.T) {
	ans := api.RouteAnswer{Load: api.LoadStats{}}
	for i, p := range pods {
		ans.Load[p] = api.EndpointStats{TotalReqs: int64(i)}
		ans.Cache = append(ans.Cache, api.CacheLocation{Host: p, Length: i + 1})
	}
	e := newDecider(t, configFor(t, "", ""), Options{Querier: memRouter{ans}})
	type prompt struct {
		body []byte
		want []string
	}
	prompts := make([]prompt, 6)
	for i := range prompts {
		system := strings.Repeat(fmt.Sprintf("système %d \"quoted\"\n", i), 10+i*7)
		user := strings.Repeat("question é中 ", 1+i)
		canon := prefix.CanonicalChat([]prefix.Message{
			{Role: "system", Parts: []prefix.Part{{Type: "text", Text: system}}},
			{Role: "user", Parts: []prefix.Part{{Type: "text", Text: user}}},
		})
		prompts[i] = prompt{chatBody(system, user), prefix.Wire(prefix.Hasher{ChunkSize: 64}.Sum("qwen", canon))}
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := 0; n < 200; n++ {
				p := prompts[(g+n)%len(prompts)]
				d, err := e.Decide(context.Background(), yieldingHeaders{":path": "/v1/chat/completions"}, p.body)
				if err != nil {
					errs <- err
					return
				}
				if !slices.Equal(d.Hashes, p.want) {
					errs <- fmt.Errorf("decision carries another prompt's hashes: %d, want %d", len(d.Hashes), len(p.want))
					return
				}
				i := slices.Index(pods, d.Host)
				if want := min(1, float64(i+1)/float64(len(p.want))); i < 0 || d.CacheRatio != want {
					errs <- fmt.Errorf("host %s cache ratio %v, want %v", d.Host, d.CacheRatio, want)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}
