package routing

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
)

// syncBuffer is a log sink safe for the decider's concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// A pod whose report says it drains is not routed to, whatever the
// policy that reads the route answer, and each decision says so in one
// debug line naming it; when every pod drains, they are routed to as
// before (their 503 with Retry-After is the answer left).
func TestDrainingPodsAreNotRoutedTo(t *testing.T) {
	ts := center(t)
	mc, err := client.New(client.Options{Address: ts.URL})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	report := func(host string, draining bool) {
		t.Helper()
		if err := mc.ReportSignals(ctx, api.PodReport{Cluster: cluster, Host: host, Draining: draining}); err != nil {
			t.Fatal(err)
		}
	}
	var logs syncBuffer
	log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	for _, policy := range []string{"cache_aware", "least_request", "prefix_only", "seed"} {
		t.Run(policy, func(t *testing.T) {
			e := newDecider(t, configFor(t, ts.URL, "lb_mapping_rule: {default: {policy: "+policy+"}}"), Options{Logger: log})
			drained := pods[1]
			for _, p := range pods {
				report(p, p == drained)
			}
			before := strings.Count(logs.String(), "host="+drained)
			for i := range 20 {
				d, err := e.Decide(ctx, chatPath(), chatBody("You are terse.", strings.Repeat("q", i)))
				if err != nil {
					t.Fatal(err)
				}
				if d.Host == drained {
					t.Fatalf("decision %d went to the draining pod %s", i, drained)
				}
				if d.Candidates != len(pods)-1 {
					t.Fatalf("%d candidates, want %d", d.Candidates, len(pods)-1)
				}
			}
			if n := strings.Count(logs.String(), "pod not routed to: it reports that it drains"); n < 20 ||
				strings.Count(logs.String(), "host="+drained)-before < 20 {
				t.Fatalf("want a debug line naming %s per decision:\n%s", drained, logs.String())
			}
			for _, p := range pods {
				report(p, true)
			}
			seen := map[string]bool{}
			for i := range 30 {
				d, err := e.Decide(ctx, chatPath(), chatBody("You are terse.", strings.Repeat("r", i)))
				if err != nil {
					t.Fatal(err)
				}
				seen[d.Host] = true
			}
			if len(seen) == 0 {
				t.Fatal("no decision while every pod drains")
			}
		})
	}
}
