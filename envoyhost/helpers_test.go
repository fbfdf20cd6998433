package envoyhost

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/sim"
	"github.com/istio-llm-filter/istio-llm-filter/worker/scheduler"
	wserver "github.com/istio-llm-filter/istio-llm-filter/worker/server"
)

var (
	buildOnce sync.Once
	buildErr  error
	repoRoot  string
)

// artifacts builds bin/llm-filter.so and bin/envoyhost with the project's
// Makefile (Go's build cache makes the .so quick after the first time).
func artifacts(t testing.TB) (hostBin, so string) {
	t.Helper()
	buildOnce.Do(func() {
		out, err := exec.Command("go", "env", "GOMOD").Output()
		if err != nil {
			buildErr = err
			return
		}
		repoRoot = filepath.Dir(strings.TrimSpace(string(out)))
		_, _, buildErr = Build(repoRoot)
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return filepath.Join(repoRoot, "bin", "envoyhost"), filepath.Join(repoRoot, "bin", "llm-filter.so")
}

// recStore counts lease traffic at the metadata center: it wraps the
// store's Leases, and batches go through the wrapper one op at a time.
type recStore struct {
	store.Store
	store.Leases // the inner store's, which AddLease and DeleteLease wrap
	store.Index
	adds, deletes atomic.Int64
	mu            sync.Mutex
	live          map[string]string // request id -> host
	addedOn       []string          // the host of every lease added, in order
}

func (r *recStore) AddLease(ctx context.Context, c, h, id string, p int64) error {
	r.adds.Add(1)
	r.mu.Lock()
	r.live[id] = h
	r.addedOn = append(r.addedOn, h)
	r.mu.Unlock()
	return r.Leases.AddLease(ctx, c, h, id, p)
}

func (r *recStore) DeleteLease(ctx context.Context, c, h, id string) error {
	r.deletes.Add(1)
	r.mu.Lock()
	delete(r.live, id)
	r.mu.Unlock()
	return r.Leases.DeleteLease(ctx, c, h, id)
}

func (r *recStore) Parts() store.Parts {
	p := r.Store.Parts()
	p.Leases = r
	p.Batch = store.Sequential{Leases: r, Index: p.Index}
	return p
}

func (r *recStore) liveLeases() map[string]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := map[string]string{}
	for k, v := range r.live {
		m[k] = v
	}
	return m
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func newMetadataCenter(t testing.TB) (*recStore, string) {
	inner := memstore.New(memstore.Options{})
	st := &recStore{Store: inner, Leases: inner, Index: inner, live: map[string]string{}}
	mc := httptest.NewServer(server.New(st, server.Options{Logger: quietLogger()}).Handler())
	t.Cleanup(mc.Close)
	return st, mc.URL
}

// hangingMetadataCenter accepts connections and never answers.
func hangingMetadataCenter(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
	})
	return "http://" + ln.Addr().String()
}

// simWorker is a real worker (OpenAI server, scheduler) on the simulated
// engine: real HTTP, real SSE, no llama.cpp compute.
func simWorker(t testing.TB) string {
	t.Helper()
	eng, err := sim.New(sim.Config{NSeqMax: 8, NCtx: 8192, NBatch: 512})
	if err != nil {
		t.Fatal(err)
	}
	sched, err := scheduler.New(eng, scheduler.Config{}.WithDefaults())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { sched.Run(ctx); close(done) }()
	srv := httptest.NewServer(wserver.New(sched, eng, wserver.Config{ModelName: "tiny"}))
	t.Cleanup(func() {
		srv.CloseClientConnections()
		cancel()
		<-done
		srv.Close()
		eng.Close()
	})
	return srv.Listener.Addr().String()
}

// backend is a scripted OpenAI-shaped server that records what it received.
type backend struct {
	srv  *httptest.Server
	addr string
	hits atomic.Int64
	mu   sync.Mutex
	hold chan struct{}
	// what the last request looked like
	lastBody     []byte
	lastTrailers http.Header
	lastHeaders  http.Header
	// respond with these trailers when set
	respTrailers map[string]string
}

func newBackend(t testing.TB) *backend {
	b := &backend{}
	b.srv = httptest.NewServer(http.HandlerFunc(b.serve))
	b.addr = b.srv.Listener.Addr().String()
	t.Cleanup(b.srv.Close)
	return b
}

func (b *backend) serve(w http.ResponseWriter, r *http.Request) {
	b.hits.Add(1)
	body, _ := io.ReadAll(r.Body)
	var req struct {
		Stream bool `json:"stream"`
	}
	_ = json.Unmarshal(body, &req)
	b.mu.Lock()
	b.lastBody = body
	b.lastTrailers = r.Trailer.Clone()
	b.lastHeaders = r.Header.Clone()
	hold := b.hold
	trailers := b.respTrailers
	b.mu.Unlock()
	for k := range trailers {
		w.Header().Add("Trailer", k)
	}
	w.Header().Set("x-served-by", b.addr)
	if hold != nil {
		select {
		case <-hold:
		case <-r.Context().Done():
			return
		}
	}
	if req.Stream {
		w.Header().Set("content-type", "text/event-stream")
		fmt.Fprint(w, `data: {"choices":[{"delta":{"content":"first"}}]}`+"\n\n")
		w.(http.Flusher).Flush()
		fmt.Fprint(w, `data: {"choices":[{"delta":{"content":" second"}}]}`+"\n\n")
		fmt.Fprint(w, "data: [DONE]\n\n")
	} else {
		w.Header().Set("content-type", "application/json")
		fmt.Fprintf(w, `{"object":"chat.completion","choices":[{"message":{"role":"assistant","content":"ok from %s"}}]}`, b.addr)
	}
	for k, v := range trailers {
		w.Header().Set(k, v)
	}
}

func (b *backend) last() (body []byte, trailers, headers http.Header) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.lastBody, b.lastTrailers, b.lastHeaders
}

// filterDoc is a filter config routing model qwen to cluster pool.
func filterDoc(mcURL string, hosts []string, extra string) string {
	mc := ""
	if mcURL != "" {
		mc = fmt.Sprintf("metadata_center: {address: %q, query_timeout: 300ms, update_timeout: 1500ms}\n", mcURL)
	}
	return fmt.Sprintf(`%smodel_mapping_rule:
  qwen:
    - cluster: pool
      backend: llamacpp
lb_mapping_rule:
  default: {policy: cache_aware}
endpoints:
  static: {pool: [%s]}
%s`, mc, strings.Join(hosts, ", "), extra)
}

// startHost runs the C host with the given clusters and fails the test,
// with the host's stderr, if the host crashes at any point.
func startHost(t testing.TB, opts Options) *Host {
	t.Helper()
	opts.HostBin, opts.SO = artifacts(t)
	if opts.DefaultCluster == "" {
		opts.DefaultCluster = "pool"
	}
	if opts.Logger == nil {
		opts.Logger = quietLogger()
	}
	if os.Getenv("ENVOYHOST_VERBOSE") != "" {
		opts.Stderr = os.Stderr
	}
	h, err := Start(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := h.Close(); err != nil {
			t.Errorf("host: %v", err)
		} else if t.Failed() {
			// a stalled stream or a wrong answer: the host's log says why
			t.Logf("host stderr (tail):\n%s", lastLines(h.Stderr(), 40))
		}
	})
	return h
}

func chatBody(prompt string, stream bool) string {
	b, _ := json.Marshal(map[string]any{"model": "qwen", "stream": stream, "max_tokens": 4,
		"messages": []any{
			map[string]any{"role": "system", "content": "You are terse."},
			map[string]any{"role": "user", "content": prompt},
		}})
	return string(b)
}

func post(t testing.TB, url, body string) (*http.Response, []byte) {
	t.Helper()
	c := &http.Client{Timeout: 30 * time.Second}
	resp, err := c.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatalf("reading the body: %v", err)
	}
	return resp, b
}

func waitUntil(t testing.TB, what string, d time.Duration, cond func() bool) {
	t.Helper()
	wait.For(t, d, what, cond)
}

var httpClient = http.Client{Timeout: 30 * time.Second}

func TestMain(m *testing.M) {
	if os.Getenv("GIN_MODE") == "" {
		os.Setenv("GIN_MODE", "release")
	}
	os.Exit(m.Run())
}
