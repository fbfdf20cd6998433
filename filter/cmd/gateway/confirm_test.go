package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/sim"
	"github.com/istio-llm-filter/istio-llm-filter/worker/mcreport"
	"github.com/istio-llm-filter/istio-llm-filter/worker/scheduler"
	wserver "github.com/istio-llm-filter/istio-llm-filter/worker/server"
)

// reportingSimWorker is the real worker (scheduler, HTTP API) on the
// simulated engine, reporting its evictions to the metadata center at mc
// as the worker binary does, under cluster.
func reportingSimWorker(t *testing.T, mc, cluster string, chunk int) (*httptest.Server, *mcreport.Reporter) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	rep, err := mcreport.New(mcreport.Config{URL: mc, Cluster: cluster, Host: ln.Addr().String(), ChunkSize: chunk, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	eng, err := sim.New(sim.Config{Name: "qwen", NSeqMax: 4, NCtx: 8192, Cost: sim.Cost{StepOverhead: time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	sched, err := scheduler.New(eng, scheduler.Config{MaxRunning: 2, MaxBatch: 2, MaxOutputTokens: 4000, Logger: quiet,
		OnEvictAt: rep.EvictAt, OnCached: rep.Cached}.WithDefaults())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	schedDone, repDone := make(chan struct{}), make(chan struct{})
	go func() { sched.Run(ctx); close(schedDone) }()
	go func() { rep.Run(ctx); close(repDone) }()
	srv := httptest.NewUnstartedServer(wserver.New(sched, eng, wserver.Config{ModelName: "qwen", HashChunkSize: chunk, Logger: quiet}))
	srv.Listener.Close()
	srv.Listener = ln
	srv.Start()
	t.Cleanup(func() {
		srv.CloseClientConnections()
		cancel()
		<-schedDone
		<-repDone
		srv.Close()
	})
	select {
	case <-rep.Cleared():
	case <-time.After(10 * time.Second):
		t.Fatal("the worker's start-up evict-all never reached the metadata center")
	}
	return srv, rep
}

func getJSON(t *testing.T, u string, v any) {
	t.Helper()
	resp, err := http.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("GET %s: %d %s", u, resp.StatusCode, b)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("GET %s: %v in %s", u, err, b)
	}
}

// A conversation sent back to back, non-streamed, to one pod: each turn's
// answer ends with its first token's save (the confirmation of the
// routing-time save) still on its way while the next turn makes the pod
// truncate the previous prompt's tail and report that eviction. The
// confirmation must not bring the evicted block back: at the end, every
// index entry of the pod (the metadata center's /debug/cache/index, on a
// real redis-server) is a prefix the worker really holds (its
// /debug/kv/prefixes). Real gateway, metadata center, worker and reports.
func TestLateConfirmationKeepsEvictedBlocksOut(t *testing.T) {
	gin.SetMode(gin.ReleaseMode)
	rs := redistest.Shared(t)
	st, err := redisstore.New(redisstore.Options{Addr: rs.Addr, KeyPrefix: rs.Prefix + "-confirm"})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	mc := httptest.NewServer(server.New(st, server.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}).Handler())
	defer mc.Close()
	const cluster, chunk = "tiny-pool", 64
	pod, rep := reportingSimWorker(t, mc.URL, cluster, chunk)
	host := pod.Listener.Addr().String()

	base := startGateway(t, fmt.Sprintf(`
listen: 127.0.0.1:0
log_level: error
filter:
  metadata_center: {address: %s, query_timeout: 1s}
  prompt_hash: {chunk_size: %d}
  model_mapping_rule:
    qwen:
      - cluster: %s
        backend: llamacpp
  lb_mapping_rule:
    default: {policy: cache_aware}
  endpoints:
    static: {%s: [%s]}
`, mc.URL, chunk, cluster, cluster, host))

	const turns = 4
	msgs := []map[string]string{{"role": "system", "content": strings.Repeat("You are a patient guide to the rivers of Europe. ", 8)}}
	for i := range turns {
		msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("Turn %d: tell me more about the river, please.", i+1)})
		b, _ := json.Marshal(map[string]any{"model": "qwen", "stream": false, "max_tokens": 12, "ignore_eos": true, "messages": msgs})
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(string(b)))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var ans struct {
			Choices []struct {
				Message struct {
					Content string `json:"content"`
				} `json:"message"`
			} `json:"choices"`
		}
		if resp.StatusCode != 200 || json.Unmarshal(body, &ans) != nil || len(ans.Choices) != 1 {
			t.Fatalf("turn %d: %d %s", i+1, resp.StatusCode, body)
		}
		msgs = append(msgs, map[string]string{"role": "assistant", "content": ans.Choices[0].Message.Content})
	}

	// Everything the gateway sent has landed once the last turn's done
	// has (one batcher, in order), and the worker's reports once its
	// queue is flushed.
	wait.For(t, 10*time.Second, "the turns' updates to reach the metadata center", func() bool {
		resp, err := http.Get(mc.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return strings.Contains(string(b), fmt.Sprintf(`llmf_metadata_center_batch_ops_total{op="done"} %d`, turns))
	})
	fctx, fcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer fcancel()
	if err := rep.Flush(fctx); err != nil {
		t.Fatal(err)
	}

	var index map[string][]string
	getJSON(t, mc.URL+api.PathDebugCacheIndex+"?cluster="+url.QueryEscape(cluster), &index)
	var kv wserver.KVPrefixes
	getJSON(t, pod.URL+wserver.PathDebugKVPrefixes, &kv)
	holds := map[string]bool{}
	for _, h := range kv.Prefixes {
		holds[h] = true
	}
	if len(index[host]) == 0 || len(kv.Pending) != 0 {
		t.Fatalf("index %v, worker %+v: want the conversation's prefix indexed and nothing pending", index, kv)
	}
	var stale []string
	for _, h := range index[host] {
		if !holds[h] {
			stale = append(stale, h)
		}
	}
	if len(stale) > 0 {
		t.Fatalf("the index claims %d of its %d entries for %s that the worker does not hold: %v (worker holds %d prefixes)",
			len(stale), len(index[host]), host, stale, len(kv.Prefixes))
	}
}
