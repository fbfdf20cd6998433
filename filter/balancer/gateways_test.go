package balancer_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/filter/lifecycle"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
)

func init() { gin.SetMode(gin.ReleaseMode) }

type headers map[string]string

func (h headers) Get(k string) (string, bool) { v, ok := h[k]; return v, ok }

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// gateway is what a host builds: a decider and the reporter of its
// decisions, sharing the balancer's tracker.
type gateway struct {
	*routing.Decider
	*lifecycle.Reporter
}

// gateways starts one real metadata center (embedded store) on loopback and
// n gateways on it, each with its own clients, batcher and balancer (so its
// own tracker and decision windows): n gateways of one mesh in front of 8
// pods. rule is the lb rule's flow mapping.
func gateways(t *testing.T, n int, rule string) []gateway {
	t.Helper()
	ts := httptest.NewServer(server.New(memstore.New(memstore.Options{}), server.Options{Logger: quiet()}).Handler())
	t.Cleanup(ts.Close)
	var out []gateway
	for i := range n {
		cfg, err := config.Parse([]byte(fmt.Sprintf(`
metadata_center: {address: %q, query_timeout: 2s, update_timeout: 2s}
prompt_hash: {chunk_size: 64}
model_mapping_rule: {qwen: [{cluster: pool}]}
lb_mapping_rule: {default: %s}
async: {batch_window: 1ms}
`, ts.URL, rule)))
		if err != nil {
			t.Fatal(err)
		}
		src, err := endpoints.NewStatic(map[string][]string{"pool": pods()})
		if err != nil {
			t.Fatal(err)
		}
		d, err := routing.New(cfg, routing.Options{Endpoints: src, Logger: quiet(), IntN: seeded(uint64(i + 1))})
		if err != nil {
			t.Fatal(err)
		}
		r, err := lifecycle.New(cfg, lifecycle.Options{Tracker: d.Tracker(), Logger: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(r.Close)
		out = append(out, gateway{d, r})
	}
	return out
}

func pods() []string {
	var out []string
	for i := range 8 {
		out = append(out, fmt.Sprintf("10.0.1.%d:8000", i+1))
	}
	return out
}

func seeded(seed uint64) func(int) int {
	var mu sync.Mutex
	r := rand.New(rand.NewPCG(seed, 0x5eed))
	return func(n int) int {
		mu.Lock()
		defer mu.Unlock()
		return r.IntN(n)
	}
}

// settled waits until e has sent every queued update to the metadata center
// and taken in the acknowledgements (a request counted both as a lease and
// as not yet acknowledged would weigh twice in the next decision).
func settled(t *testing.T, e gateway) {
	t.Helper()
	wait.For(t, 10*time.Second, "the gateway's updates to reach the metadata center", func() bool {
		if e.Pending() != 0 {
			return false
		}
		for _, p := range pods() {
			if _, unacked := e.InFlight("pool", p); unacked != 0 {
				return false
			}
		}
		return true
	})
}

// hotPrompt routes requests of one hot system prompt round robin over gws,
// each once the updates before it have reached the metadata center (as they
// have at any rate where a request outlasts a batch window). A request ends
// live decisions after its own, at once, so live requests are in flight at
// each decision and in between, a third of them a given gateway's when
// there are three; it gets its first token at the next decision. It returns the requests per
// pod, in the order the pods were first chosen.
func hotPrompt(t *testing.T, gws []gateway, requests, live int) []int {
	t.Helper()
	system := strings.Repeat("One hot system prompt that the whole fleet sends. ", 16)
	type routed struct {
		d *lifecycle.Request
		e gateway
	}
	var flight []routed
	per := map[string]int{}
	var order []string
	for i := range requests {
		e := gws[i%len(gws)]
		body, _ := json.Marshal(map[string]any{"model": "qwen", "stream": true, "messages": []any{
			map[string]any{"role": "system", "content": system},
			map[string]any{"role": "user", "content": fmt.Sprintf("question %d?", i)},
		}})
		dec, err := e.Decide(context.Background(), headers{":path": "/v1/chat/completions"}, body)
		if err != nil || dec.Degraded {
			t.Fatalf("%+v %v", dec, err)
		}
		d := lifecycle.NewRequest(dec)
		e.Started(d)
		settled(t, e)
		if per[d.Host] == 0 {
			order = append(order, d.Host)
		}
		per[d.Host]++
		flight = append(flight, routed{d, e})
		if len(flight) > live {
			f := flight[0]
			f.e.Done(f.d)
			settled(t, f.e)
			flight = flight[1:]
		}
		if n := len(flight); n > 1 {
			f := flight[n-2]
			f.e.FirstToken(f.d)
			f.e.Saved(f.d)
			settled(t, f.e)
		}
	}
	for _, f := range flight {
		f.e.Done(f.d)
	}
	counts := make([]int, len(order))
	for i, h := range order {
		counts[i] = per[h]
	}
	return counts
}

// TestHotPrefixSpreadsTheSameOverOneOrThreeGateways routes one hot prompt
// through one gateway and through three on one metadata center, with few
// requests in flight, so that the load terms never outweigh the cache
// credit and only herd control spreads the prompt. Herd control reads each
// gateway's own window of decisions, a third of the cluster's with three
// gateways; it must act about as early as with one, or three gateways herd the
// prompt onto its first pod three times as long (48 requests instead of
// 16 with 8 pods). Shares alone (herd_wait 0): with herd_wait, when the
// gate opens depends on the pods' own prefill reports, which no pod sends
// here.
func TestHotPrefixSpreadsTheSameOverOneOrThreeGateways(t *testing.T) {
	const requests, live = 48, 6
	rule := `{policy: cache_aware, cache_ratio_weight: 2, request_load_weight: 1, prefill_load_weight: 3, candidate_percent: 10, herd_share: 2, herd_wait: 0}`
	one := hotPrompt(t, gateways(t, 1, rule), requests, live)
	three := hotPrompt(t, gateways(t, 3, rule), requests, live)
	t.Logf("requests per pod, in the order pods were first chosen: one gateway %v, three %v", one, three)
	if len(one) < 3 {
		t.Fatalf("one gateway kept the hot prompt on %d pods: %v", len(one), one)
	}
	// Each gateway learns how many gateways there are from the leases as
	// it goes (a count that starts from an empty fleet), so the second
	// pod may come a few requests later; a window that counted only its
	// own decisions kept all 48 on the first pod.
	if len(three) < len(one)-1 || three[0] > one[0]+6 {
		t.Fatalf("requests per pod: %v with one gateway, %v with three", one, three)
	}
}
