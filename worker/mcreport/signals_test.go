package mcreport

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
)

// reporterAtCenter starts a real metadata center on the embedded store and
// a Reporter of pod 10.0.0.7:9000 in cluster c to it.
func reporterAtCenter(t *testing.T, opts memstore.Options) (*httptest.Server, *Reporter) {
	t.Helper()
	ts := httptest.NewServer(server.New(memstore.New(opts),
		server.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}).Handler())
	t.Cleanup(ts.Close)
	r, err := New(Config{URL: ts.URL, Cluster: "c", Host: "10.0.0.7:9000", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	return ts, r
}

// The worker's signals reach a real metadata center and its route answer:
// a change is pushed within a poll, and a steady pod is re-reported often
// enough never to go stale.
func TestRunSignalsReachesTheRouteAnswer(t *testing.T) {
	ts, r := reporterAtCenter(t, memstore.Options{SignalMaxAge: 250 * time.Millisecond})
	var waiting atomic.Int64
	src := SignalSourceFunc(func() api.PodSignals {
		return api.PodSignals{Waiting: waiting.Load(), Running: 3, KVCacheUtil: 0.5, PrefillTokens: 100 * waiting.Load(),
			KVCapacity: 8192, MaxRunning: 8, ReportsEvictions: true}
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.RunSignals(ctx, src, 5*time.Millisecond, 50*time.Millisecond); close(done) }()
	defer func() { cancel(); <-done }()

	route := func() api.PodSignals {
		resp, err := http.Post(ts.URL+api.PathRouteQuery, "application/json", jsonBody(t, api.RouteQuery{Cluster: "c", Hashes: []string{}}))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var ans api.RouteAnswer
		if err := json.NewDecoder(resp.Body).Decode(&ans); err != nil {
			t.Fatal(err)
		}
		return ans.Signals["10.0.0.7:9000"]
	}
	waitFor := func(what string, ok func(api.PodSignals) bool) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		var s api.PodSignals
		if !wait.Until(time.Until(deadline), func() bool { s = route(); return ok(s) }) {
			t.Fatalf("%s: last answer %+v", what, s)
		}
	}
	// Every field the pod reports reaches the gateways, the KV cache's size
	// and the running set's, and that it reports its evictions, included.
	waitFor("first report", func(s api.PodSignals) bool {
		return s.Running == 3 && s.KVCacheUtil == 0.5 && s.KVCapacity == 8192 && s.MaxRunning == 8 && s.ReportsEvictions
	})
	waiting.Store(4)
	waitFor("a change", func(s api.PodSignals) bool { return s.Waiting == 4 && s.PrefillTokens == 400 })
	// Unchanged for 4 max ages: still answered, and young.
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for range 10 {
		<-tick.C
		if s := route(); s.Waiting != 4 || s.AgeMS > 200 {
			t.Fatalf("steady pod: %+v (want it re-reported every 50 ms)", s)
		}
	}
	if got := counterValue(t, r.signals.WithLabelValues("ok")); got < 10 {
		t.Fatalf("ok reports counted: %v", got)
	}
}

func jsonBody(t *testing.T, v any) io.Reader {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return bytes.NewReader(b)
}

// Nudge sends a change at once: with polls an hour apart, the drain's
// start still reaches the route answer.
func TestNudgeSendsTheDrainAtOnce(t *testing.T) {
	ts, r := reporterAtCenter(t, memstore.Options{})
	var draining atomic.Bool
	src := SignalSourceFunc(func() api.PodSignals { return api.PodSignals{Running: 1, Draining: draining.Load()} })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.RunSignals(ctx, src, time.Hour, time.Hour); close(done) }()
	defer func() { cancel(); <-done }()
	signals := func() map[string]api.PodSignals {
		resp, err := http.Get(ts.URL + api.PathPodSignals + "?cluster=c")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var got map[string]api.PodSignals
		if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
			t.Fatal(err)
		}
		return got
	}
	poll := func(what string, ok func(api.PodSignals) bool) {
		t.Helper()
		if !wait.Until(5*time.Second, func() bool { return ok(signals()["10.0.0.7:9000"]) }) {
			t.Fatalf("%s: %+v", what, signals())
		}
	}
	poll("the first report", func(s api.PodSignals) bool { return s.Running == 1 && !s.Draining })
	draining.Store(true)
	r.Nudge()
	poll("the drain", func(s api.PodSignals) bool { return s.Draining })
}

// The rest of the step in progress runs down between any two reads: alone
// it is no change to push (a pod in a long prefill step would report at
// every poll), and it rides with the next report that changes something.
func TestTheStepLeftAloneIsNoChange(t *testing.T) {
	_, r := reporterAtCenter(t, memstore.Options{})
	var reads, waiting atomic.Int64
	src := SignalSourceFunc(func() api.PodSignals {
		return api.PodSignals{Running: 1, Waiting: waiting.Load(), StepLeftSeconds: 1 / float64(reads.Add(1))}
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.RunSignals(ctx, src, time.Millisecond, time.Hour); close(done) }()
	defer func() { cancel(); <-done }()
	ok := r.signals.WithLabelValues("ok")
	if !wait.Until(5*time.Second, func() bool { return reads.Load() >= 50 }) {
		t.Fatalf("the source was read %d times", reads.Load())
	}
	if got := counterValue(t, ok); got != 1 {
		t.Fatalf("%v reports over %d reads that differed only in the step left, want the first only", got, reads.Load())
	}
	waiting.Store(2)
	if !wait.Until(5*time.Second, func() bool { return counterValue(t, ok) == 2 }) {
		t.Fatalf("a change was not pushed: %v reports", counterValue(t, ok))
	}
}
