package llmfilter_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewaymetrics"
	"github.com/istio-llm-filter/istio-llm-filter/filter/llmfilter"
	"github.com/istio-llm-filter/istio-llm-filter/filter/standalone"
	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode/openai"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// recStore is the real in-memory store with call counters, so tests can wait
// for the filter's asynchronous updates to land instead of sleeping. It
// wraps the store's Leases and Index; batches go through the wrappers one
// op at a time.
type recStore struct {
	store.Store
	store.Leases // the inner store's, which the counters wrap
	store.Index
	adds, saves, deletes atomic.Int64
}

func (r *recStore) AddLease(ctx context.Context, c, h, id string, p int64) error {
	err := r.Leases.AddLease(ctx, c, h, id, p)
	r.adds.Add(1)
	return err
}

func (r *recStore) SaveCacheAs(ctx context.Context, c, h string, hs []prefix.Hash, id string, at int64, maxEntries int) error {
	err := r.Index.SaveCacheAs(ctx, c, h, hs, id, at, maxEntries)
	r.saves.Add(1)
	return err
}

func (r *recStore) DeleteLease(ctx context.Context, c, h, id string) error {
	err := r.Leases.DeleteLease(ctx, c, h, id)
	r.deletes.Add(1)
	return err
}

func (r *recStore) Parts() store.Parts {
	p := r.Store.Parts()
	p.Leases, p.Index = r, r
	p.Batch = store.Sequential{Leases: r, Index: r}
	return p
}

func waitUntil(t testing.TB, what string, cond func() bool) {
	t.Helper()
	wait.For(t, 10*time.Second, what, cond)
}

// backend is a fake OpenAI server: JSON or SSE answers, optionally held
// open until released, naming itself in x-served-by.
type backend struct {
	srv   *httptest.Server
	addr  string
	hits  atomic.Int64
	mu    sync.Mutex
	hold  chan struct{} // non-nil: requests wait on it before answering
	paths []string
}

func newBackend(t testing.TB) *backend {
	b := &backend{}
	b.srv = httptest.NewServer(http.HandlerFunc(b.serve))
	b.addr = b.srv.Listener.Addr().String()
	t.Cleanup(b.srv.Close)
	return b
}

func (b *backend) setHold(ch chan struct{}) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.hold = ch
}

func (b *backend) serve(w http.ResponseWriter, r *http.Request) {
	b.hits.Add(1)
	var req struct {
		Stream bool `json:"stream"`
	}
	body, _ := io.ReadAll(r.Body)
	_ = json.Unmarshal(body, &req)
	b.mu.Lock()
	hold := b.hold
	b.paths = append(b.paths, r.URL.Path)
	b.mu.Unlock()
	w.Header().Set("x-served-by", b.addr)
	w.Header().Set("x-seen-request-id", r.Header.Get("x-request-id"))
	if req.Stream {
		w.Header().Set("content-type", "text/event-stream")
		fl := w.(http.Flusher)
		fmt.Fprint(w, `data: {"choices":[{"delta":{"content":"first"}}]}`+"\n\n")
		fl.Flush()
		if hold != nil {
			select {
			case <-hold:
			case <-r.Context().Done():
				return
			}
		}
		fmt.Fprint(w, `data: {"choices":[{"delta":{"content":" second"}}]}`+"\n\n")
		fmt.Fprint(w, "data: [DONE]\n\n")
		return
	}
	if hold != nil {
		select {
		case <-hold:
		case <-r.Context().Done():
			return
		}
	}
	w.Header().Set("content-type", "application/json")
	fmt.Fprintf(w, `{"object":"chat.completion","choices":[{"message":{"role":"assistant","content":"ok from %s"}}]}`, b.addr)
}

type world struct {
	t        testing.TB
	backends []*backend
	byAddr   map[string]*backend
	st       *recStore
	gw       *httptest.Server
	metrics  *counts
}

type counts struct {
	mu sync.Mutex
	m  map[string]int64
}

func (c *counts) Count(name string, d int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.m[name] += d
}

// Observe and Request count how many values each histogram and outcome got.
func (c *counts) Observe(histogram string, _ gatewaymetrics.HistLabels, _ time.Duration) {
	c.Count("observed "+histogram, 1)
}

func (c *counts) Request(l gatewaymetrics.RequestLabels) { c.Count("request "+l.Outcome, 1) }

func (c *counts) get(name string) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m[name]
}

// noMetadataCenter as newWorld's mcURL configures none at all.
const noMetadataCenter = "none"

// newWorld starts n fake pods, a real metadata center (server + memstore)
// unless mcURL is given, and the standalone gateway running the filter.
func newWorld(t testing.TB, n int, mcURL string) *world {
	return newWorldMetrics(t, n, mcURL, nil)
}

// newWorldMetrics is newWorld with the filter reporting into m instead of
// the world's counts (nil: the counts).
func newWorldMetrics(t testing.TB, n int, mcURL string, m llmfilter.Metrics) *world {
	w := &world{t: t, byAddr: map[string]*backend{}, metrics: &counts{m: map[string]int64{}}}
	addrs := []string{}
	for i := 0; i < n; i++ {
		b := newBackend(t)
		w.backends = append(w.backends, b)
		w.byAddr[b.addr] = b
		addrs = append(addrs, b.addr)
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	if mcURL == "" {
		inner := memstore.New(memstore.Options{})
		w.st = &recStore{Store: inner, Leases: inner, Index: inner}
		mc := httptest.NewServer(server.New(w.st, server.Options{Logger: quiet}).Handler())
		t.Cleanup(mc.Close)
		mcURL = mc.URL
	}
	mcDoc := fmt.Sprintf("metadata_center: {address: %q, query_timeout: 500ms, update_timeout: 2s}", mcURL)
	if mcURL == noMetadataCenter {
		mcDoc = ""
	}
	doc := fmt.Sprintf(`
%s
model_mapping_rule:
  qwen:
    - cluster: tiny-pool
      backend: llamacpp
lb_mapping_rule:
  default: {policy: cache_aware}
endpoints:
  static: {tiny-pool: [%s]}
`, mcDoc, strings.Join(addrs, ", "))
	cfg, err := config.Parse([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	if m == nil {
		m = w.metrics
	}
	conf, err := llmfilter.NewParser(llmfilter.ParserOptions{Logger: quiet}).Build(cfg, m)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conf.Destroy)
	host, err := standalone.New(standalone.Options{Factory: llmfilter.Factory, Config: conf, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	w.gw = httptest.NewServer(host)
	t.Cleanup(w.gw.Close)
	return w
}

func chatBody(prompt string, stream bool) string {
	b, _ := json.Marshal(map[string]any{"model": "qwen", "stream": stream,
		"messages": []any{
			map[string]any{"role": "system", "content": "You are terse."},
			map[string]any{"role": "user", "content": prompt},
		}})
	return string(b)
}

// ask sends a non-streamed chat and returns the pod that served it.
func (w *world) ask(prompt string) string {
	w.t.Helper()
	return w.askBody(chatBody(prompt, false))
}

// askBody sends a chat body and returns the pod that served it.
func (w *world) askBody(chat string) string {
	w.t.Helper()
	resp, err := http.Post(w.gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(chat))
	if err != nil {
		w.t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		w.t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if resp.Header.Get("x-seen-request-id") == "" {
		w.t.Fatal("the backend must see an x-request-id")
	}
	served := resp.Header.Get("x-served-by")
	if got := resp.Header.Get(headers.UpstreamHost); got != served {
		w.t.Fatalf("%s = %q, but %s served the request", headers.UpstreamHost, got, served)
	}
	return served
}

// settle waits until every finished request's async updates reached the
// metadata center (updates of one request run in order, Done last).
func (w *world) settle(done int64) {
	w.t.Helper()
	waitUntil(w.t, fmt.Sprintf("%d request leases deleted", done), func() bool { return w.st.deletes.Load() >= done })
}

// longPrefix is a shared system-prompt-like prefix spanning several 512-byte blocks.
var longPrefix = strings.Repeat("The quick brown fox jumps over the lazy dog while the router keeps the KV cache warm. ", 40)

func TestE2ERepeatedPrefixLandsOnItsPod(t *testing.T) {
	w := newWorld(t, 4, "")
	first := w.ask(longPrefix + "Question 0?")
	w.settle(1)
	if w.st.saves.Load() < 1 {
		t.Fatal("the first answer must have saved its cache location")
	}
	for i := 1; i <= 6; i++ {
		if got := w.ask(longPrefix + fmt.Sprintf("Question %d?", i)); got != first {
			t.Fatalf("request %d with the cached prefix went to %s, not %s which holds it", i, got, first)
		}
		w.settle(int64(i + 1))
	}
	if w.metrics.get("cache_hit_routes") < 6 {
		t.Fatalf("cache_hit_routes = %d, want >= 6", w.metrics.get("cache_hit_routes"))
	}
}

func TestE2EUnrelatedPromptsSpread(t *testing.T) {
	w := newWorld(t, 4, "")
	used := map[string]int{}
	for i := 0; i < 24; i++ {
		// Different from the first byte on, without chatBody's system
		// message (a block of its own, which every prompt would share):
		// no shared block at all.
		body, _ := json.Marshal(map[string]any{"model": "qwen", "messages": []any{map[string]any{"role": "user",
			"content": fmt.Sprintf("%d unrelated question number %d about topic %x", i*7919, i, i*104729)}}})
		used[w.askBody(string(body))]++
		w.settle(int64(i + 1))
	}
	if len(used) < 3 {
		t.Fatalf("24 unrelated prompts used only %d of 4 pods: %v", len(used), used)
	}
}

// A short conversation's next turn finds the pod that served the turn
// before, and is predicted to hold it: the turn before ends where the next
// assistant message starts, a block boundary of the next prompt, so both
// whole messages match, not only the system prompt every pod may hold. The
// whole conversation fits in one 512-byte chunk.
func TestE2EAConversationsNextTurnFindsItsPod(t *testing.T) {
	w := newWorld(t, 4, "")
	msg := func(role, content string) map[string]any { return map[string]any{"role": role, "content": content} }
	turn1 := []any{msg("system", "You are terse."), msg("user", "What is a KV cache?")}
	turn2 := append(append([]any(nil), turn1...), msg("assistant", "Keys and values kept per token."), msg("user", "Why keep it?"))
	body := func(msgs []any) string {
		b, _ := json.Marshal(map[string]any{"model": "qwen", "messages": msgs})
		return string(b)
	}
	canonLen := func(chat string) float64 {
		_, canon, err := openai.Canonical("/v1/chat/completions", []byte(chat))
		if err != nil {
			t.Fatal(err)
		}
		return float64(len(canon))
	}
	home := w.askBody(body(turn1))
	w.settle(1)

	resp, err := http.Post(w.gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(body(turn2)))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	share, err := strconv.ParseFloat(resp.Header.Get(headers.PredictedCachedShare), 64)
	if err != nil {
		t.Fatalf("%s = %q: %v", headers.PredictedCachedShare, resp.Header.Get(headers.PredictedCachedShare), err)
	}
	if got, want := resp.Header.Get("x-served-by"), home; got != want {
		t.Fatalf("turn 2 served by %s, want %s, which served turn 1", got, want)
	}
	if min := canonLen(body(turn1)) / canonLen(body(turn2)); share < min-0.01 {
		t.Fatalf("turn 2 predicted to find %.2f of its prompt cached, want at least turn 1's share, %.2f", share, min)
	}
}

func TestE2EHotPrefixSpreadsOnceItsPodIsLoaded(t *testing.T) {
	w := newWorld(t, 4, "")
	home := w.ask(longPrefix + "warm up")
	w.settle(1)

	// Every pod holds requests open, so in-flight load accumulates.
	release := make(chan struct{})
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) }) // also on failure: held handlers block server Close
	for _, b := range w.backends {
		b.setHold(release)
	}
	results := make(chan error, 16)
	send := func(i int) {
		resp, err := http.Post(w.gw.URL+"/v1/chat/completions", "application/json",
			strings.NewReader(chatBody(longPrefix+fmt.Sprintf("hot %d", i), false)))
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		results <- err
	}
	total := func() int64 {
		var n int64
		for _, b := range w.backends {
			n += b.hits.Load()
		}
		return n
	}
	// Hot requests one at a time, each held at its pod: a cache hit costs its
	// pod little prefill, so the first go home; as home's queue grows (each
	// lease counts the prompt's unmatched blocks in full) it outweighs the
	// cache hit and the prefix spreads to other pods.
	base := total()
	homeHits := w.byAddr[home].hits.Load()
	sent, spreadAt := 0, 0
	for i := 1; i <= 12 && spreadAt == 0; i++ {
		go send(i)
		sent++
		waitUntil(t, fmt.Sprintf("hot request %d at a pod", i), func() bool { return total() == base+int64(i) })
		waitUntil(t, fmt.Sprintf("hot request %d's lease", i), func() bool { return w.st.adds.Load() >= int64(1+i) })
		if w.byAddr[home].hits.Load()-homeHits < int64(i) {
			spreadAt = i
		}
	}
	if spreadAt == 0 {
		t.Fatalf("12 concurrent hot requests all piled onto %s", home)
	}
	if spreadAt == 1 {
		t.Fatal("the first hot request left the idle pod that holds its prefix")
	}
	t.Logf("the hot prefix spread with %d requests in flight at its home pod", spreadAt-1)
	once.Do(func() { close(release) })
	for i := 0; i < sent; i++ {
		if err := <-results; err != nil {
			t.Fatal(err)
		}
	}
}

func TestE2EStreamReachesClientUnbuffered(t *testing.T) {
	w := newWorld(t, 2, "")
	release := make(chan struct{})
	for _, b := range w.backends {
		b.setHold(release)
	}
	resp, err := http.Post(w.gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(chatBody("stream it", true)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("content-type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Fatalf("content-type %q", ct)
	}
	rd := bufio.NewReader(resp.Body)
	line, err := rd.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	// The backend is still holding the rest: this line was not buffered.
	if !strings.Contains(line, `"first"`) {
		t.Fatalf("first line %q", line)
	}
	close(release)
	rest, err := io.ReadAll(rd)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(rest), `" second"`) || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Fatalf("rest of stream %q", rest)
	}
	w.settle(1)
}

func TestE2EMetadataCenterDownStillServes(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	url := dead.URL
	dead.Close()
	w := newWorld(t, 3, url)
	used := map[string]bool{}
	for i := 0; i < 6; i++ {
		used[w.ask(fmt.Sprintf("question %d with the metadata center down", i))] = true
	}
	for pod := range used {
		if w.byAddr[pod] == nil {
			t.Fatalf("served by unknown pod %q", pod)
		}
	}
	if w.metrics.get("routed") != 6 {
		t.Fatalf("routed = %d, want 6 (degraded, not failed)", w.metrics.get("routed"))
	}
}

func TestE2EClientGoneMidStreamReleasesThePod(t *testing.T) {
	w := newWorld(t, 2, "")
	release := make(chan struct{})
	defer close(release)
	for _, b := range w.backends {
		b.setHold(release)
	}
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", w.gw.URL+"/v1/chat/completions", strings.NewReader(chatBody("leave early", true)))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	pod := resp.Header.Get("x-served-by")
	waitUntil(t, "the lease at the metadata center", func() bool { return w.st.adds.Load() == 1 })
	cancel() // the client goes away while the pod is still generating
	resp.Body.Close()
	// The filter still reports the end: the lease is deleted and the pod is free.
	w.settle(1)
	stats, err := w.st.LoadStats(context.Background(), "tiny-pool")
	if err != nil {
		t.Fatal(err)
	}
	if s := stats[pod]; s.TotalReqs != 0 || s.PromptLength != 0 {
		t.Fatalf("pod %s still looks busy after the client left: %+v", pod, s)
	}
}
