package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/sim"
	"github.com/istio-llm-filter/istio-llm-filter/worker/scheduler"
	wserver "github.com/istio-llm-filter/istio-llm-filter/worker/server"
)

// simWorker is the real worker (scheduler and HTTP API) on the simulated
// engine, with a running set of one and a queue of one, each queued
// request timing out after queueTimeout.
func simWorker(t *testing.T, queueTimeout time.Duration) *httptest.Server {
	t.Helper()
	eng, err := sim.New(sim.Config{Name: "qwen", NSeqMax: 4, NCtx: 8192, Cost: sim.Cost{StepOverhead: 2 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	sched, err := scheduler.New(eng, scheduler.Config{MaxRunning: 1, MaxBatch: 1, MaxQueue: 1, QueueTimeout: queueTimeout,
		MaxOutputTokens: 4000, Logger: quiet}.WithDefaults())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { sched.Run(ctx); close(done) }()
	srv := httptest.NewServer(wserver.New(sched, eng, wserver.Config{ModelName: "qwen", Logger: quiet}))
	t.Cleanup(func() {
		srv.CloseClientConnections()
		cancel()
		<-done
		srv.Close()
	})
	return srv
}

// A pod that refuses a request before its first token (408 after the queue
// wait, 429 with a full queue) never builds the prompt's cache: through the
// real standalone gateway, the prefix the gateway saved at routing time is
// withdrawn from the metadata center (on a real redis-server), while the
// prefix of the request the pod is really serving stays.
func TestRefusedRequestsLeaveNoIndexEntries(t *testing.T) {
	gin.SetMode(gin.ReleaseMode)
	rs := redistest.Shared(t)
	st, err := redisstore.New(redisstore.Options{Addr: rs.Addr, KeyPrefix: rs.Prefix + "-retract"})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	mc := httptest.NewServer(server.New(st, server.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}).Handler())
	defer mc.Close()
	// The second request's queue wait must outlast the third's arrival
	// (429 only while the second still holds the one queue slot): 300 ms
	// ran out first on a loaded CI machine.
	pod := simWorker(t, 2*time.Second)

	base := startGateway(t, fmt.Sprintf(`
listen: 127.0.0.1:0
log_level: error
filter:
  metadata_center: {address: %s, query_timeout: 1s}
  prompt_hash: {chunk_size: 64}
  model_mapping_rule:
    qwen:
      - cluster: tiny-pool
        backend: llamacpp
  lb_mapping_rule:
    default: {policy: cache_aware}
  endpoints:
    static: {tiny-pool: [%s]}
`, mc.URL, pod.Listener.Addr()))
	entries := func() int64 {
		s, err := st.Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return s.IndexEntries
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		if !wait.Until(10*time.Second, cond) {
			t.Fatalf("timed out waiting for %s (index entries %d)", what, entries())
		}
	}
	body := func(user string, stream bool, maxTokens int) string {
		b, _ := json.Marshal(map[string]any{"model": "qwen", "stream": stream, "max_tokens": maxTokens, "ignore_eos": true,
			"messages": []any{map[string]any{"role": "user", "content": strings.Repeat(user+" ", 30)}}})
		return string(b)
	}

	// The pod serves a long answer: its first token is out, so its prefix
	// is true.
	lctx, lcancel := context.WithCancel(context.Background())
	defer lcancel()
	req, _ := http.NewRequestWithContext(lctx, "POST", base+"/v1/chat/completions", strings.NewReader(body("the long one", true, 3000)))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("long request: %d", resp.StatusCode)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() && !strings.HasPrefix(sc.Text(), "data: {") {
	}
	go io.Copy(io.Discard, resp.Body)
	// Its routing-time save and its confirming one.
	waitFor("the long request's saves", func() bool { return batchOps(t, mc.URL, "cache_save") == 2 })
	held := entries()
	if held == 0 {
		t.Fatal("the long request's prefix is not in the index")
	}

	// Queued behind it, a second request waits out the queue timeout: 408.
	// Its prefix was in the index meanwhile.
	type answer struct {
		status int
		body   string
	}
	second := make(chan answer, 1)
	go func() {
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body("the queued one", false, 5)))
		if err != nil {
			second <- answer{status: -1, body: err.Error()}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		second <- answer{resp.StatusCode, string(b)}
	}()
	waitFor("the queued request's routing-time save", func() bool { return entries() > held })
	// A third finds the queue full: 429.
	resp3, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body("the refused one", false, 5)))
	if err != nil {
		t.Fatal(err)
	}
	b3, _ := io.ReadAll(resp3.Body)
	resp3.Body.Close()
	if resp3.StatusCode != 429 {
		t.Fatalf("third request: %d %s", resp3.StatusCode, b3)
	}
	a := <-second
	var e struct {
		Error struct {
			Code int    `json:"code"`
			Type string `json:"type"`
		} `json:"error"`
		TraceID string `json:"trace_id"`
	}
	if json.Unmarshal([]byte(a.body), &e); a.status != 408 || e.Error.Code != 408 || e.Error.Type != "timeout_error" || e.TraceID == "" {
		t.Fatalf("queued request: %d %s", a.status, a.body)
	}
	waitFor("the refused requests' saves to be withdrawn", func() bool { return entries() == held })

	// A client that gives up while its request is queued: the stream ends
	// before the first token, and its save goes too.
	qctx, qcancel := context.WithCancel(context.Background())
	left := make(chan struct{})
	go func() {
		defer close(left)
		req, _ := http.NewRequestWithContext(qctx, "POST", base+"/v1/chat/completions", strings.NewReader(body("the impatient one", false, 5)))
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	waitFor("the impatient request's routing-time save", func() bool { return entries() > held })
	qcancel()
	<-left
	// Its routing-time save withdrawn and its lease ended, as the two
	// refused requests' were: nothing of the three is left on its way to
	// the metadata center.
	waitFor("the three retractions and dones", func() bool {
		return batchOps(t, mc.URL, "cache_retract") == 3 && batchOps(t, mc.URL, "done") == 3
	})
	if n := entries(); n != held {
		t.Fatalf("index entries %d, want the long request's %d", n, held)
	}
	lcancel()
}

// A pod that cannot be reached (no healthy upstream: the connection is
// refused) never sees the request: the gateway answers 503 itself and the
// prefix it saved at routing time is withdrawn.
func TestUnreachablePodLeavesNoIndexEntries(t *testing.T) {
	gin.SetMode(gin.ReleaseMode)
	rs := redistest.Shared(t)
	st, err := redisstore.New(redisstore.Options{Addr: rs.Addr, KeyPrefix: rs.Prefix + "-unreachable"})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	mc := httptest.NewServer(server.New(st, server.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}).Handler())
	defer mc.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()
	base := startGateway(t, fmt.Sprintf(`
listen: 127.0.0.1:0
log_level: error
filter:
  metadata_center: {address: %s, query_timeout: 1s}
  model_mapping_rule:
    qwen:
      - cluster: tiny-pool
        backend: llamacpp
  endpoints:
    static: {tiny-pool: [%s]}
`, mc.URL, dead))
	resp, err := http.Post(base+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"qwen","messages":[{"role":"user","content":"`+strings.Repeat("is anyone there? ", 80)+`"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 {
		t.Fatalf("status %d, want the gateway's 503", resp.StatusCode)
	}
	// Wait for the metadata center to have applied the request's updates
	// (save, retraction, done all come through /v1/batch).
	applied := func(op string) bool {
		resp, err := http.Get(mc.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return strings.Contains(string(b), `llmf_metadata_center_batch_ops_total{op="`+op+`"} 1`)
	}
	wait.For(t, 10*time.Second, "the request's save, retraction and done to reach the metadata center", func() bool {
		return applied("cache_save") && applied("cache_retract") && applied("done")
	})
	s, err := st.Stats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if s.IndexEntries != 0 || s.LiveLeases != 0 {
		t.Fatalf("after an unreachable pod: %+v, want no entries and no leases", s)
	}
}

// batchOps is how many updates of kind op the metadata center at url has
// applied through /v1/batch (its llmf_metadata_center_batch_ops_total).
func batchOps(t *testing.T, url, op string) int {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	prefix := `llmf_metadata_center_batch_ops_total{op="` + op + `"} `
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, prefix); ok {
			n, _ := strconv.Atoi(v)
			return n
		}
	}
	return 0
}
