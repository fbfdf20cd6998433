package main

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
)

// A worker told to stop (SIGTERM, as the kubelet does) reports that it
// drains to the metadata center while it finishes what it accepted, and
// the gateway's next decisions avoid it. Real worker processes (simulated
// engine), real metadata center, the gateway's real decider.
func TestSIGTERMStopsTheRouterChoosingTheWorker(t *testing.T) {
	mc := httptest.NewServer(server.New(memstore.New(memstore.Options{}), server.Options{}).Handler())
	defer mc.Close()
	const cluster = "pool"
	start := func() *process {
		// Slow decode steps: the stream below runs for seconds, so the
		// drain lasts that long.
		return startProcess(t, "--engine", "sim", "--sim-step-overhead", "20ms", "--max-output-tokens", "3500",
			"--metadata-center", mc.URL, "--cluster", cluster, "--drain-timeout", "60s", "--log-level", "info")
	}
	a, b := start(), start()
	hostA, hostB := strings.TrimPrefix(a.url, "http://"), strings.TrimPrefix(b.url, "http://")

	cfg, err := config.Parse([]byte(fmt.Sprintf(`
metadata_center: {address: %q, query_timeout: 2s}
model_mapping_rule:
  m:
    - cluster: %s
lb_mapping_rule:
  default: {policy: cache_aware}
`, mc.URL, cluster)))
	if err != nil {
		t.Fatal(err)
	}
	src, err := endpoints.NewStatic(map[string][]string{cluster: {hostA, hostB}})
	if err != nil {
		t.Fatal(err)
	}
	d, err := routing.New(cfg, routing.Options{Endpoints: src})
	if err != nil {
		t.Fatal(err)
	}
	decide := func(i int) string {
		t.Helper()
		body := fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"question %d"}]}`, i)
		dec, err := d.Decide(context.Background(), hdrs{":path": "/v1/chat/completions"}, []byte(body))
		if err != nil {
			t.Fatal(err)
		}
		return dec.Host
	}
	mcc, err := client.New(client.Options{Address: mc.URL})
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "both workers to report", func() bool {
		ans, err := mcc.Route(context.Background(), cluster, nil)
		return err == nil && len(ans.Signals) == 2
	})

	// A long stream on A keeps it draining for a while once told to stop.
	resp, err := http.Post(a.url+"/v1/chat/completions", "application/json", strings.NewReader(
		`{"model":"m","messages":[{"role":"user","content":"tell a long story"}],"max_tokens":3500,"ignore_eos":true,"stream":true}`))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("stream: %v %v", resp, err)
	}
	defer resp.Body.Close()
	if l, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || !strings.HasPrefix(l, "data: ") {
		t.Fatalf("first line %q %v", l, err)
	}
	if err := a.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "A's report that it drains", func() bool {
		ans, err := mcc.Route(context.Background(), cluster, nil)
		return err == nil && ans.Signals[hostA].Draining && !ans.Signals[hostB].Draining
	})
	for i := range 20 {
		if h := decide(i); h != hostB {
			t.Fatalf("decision %d after A's SIGTERM went to %s, not B (%s)", i, h, hostB)
		}
	}
	// A still answers (new requests 503): it is draining, not gone.
	r, err := http.Post(a.url+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	r.Body.Close()
	if r.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("a new request to the draining worker: %d, want 503", r.StatusCode)
	}
	resp.Body.Close()
	select {
	case <-a.exited:
	case <-time.After(60 * time.Second):
		t.Fatal("the drained worker did not exit")
	}
}

// hdrs is a request's headers for Decide.
type hdrs map[string]string

func (h hdrs) Get(k string) (string, bool) { v, ok := h[k]; return v, ok }
