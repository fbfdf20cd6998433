package mcreport

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"reflect"
	"sync/atomic"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
)

// The pod's registration reaches a real metadata center with the first
// signal report, rides on few of them afterwards, and comes back by itself
// after the metadata center lost it (a restart of the embedded store).
func TestRunSignalsRegisters(t *testing.T) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	var regs, reports atomic.Int64
	var h atomic.Pointer[http.Handler]
	fresh := func() {
		hh := server.New(memstore.New(memstore.Options{}), server.Options{Logger: quiet}).Handler()
		h.Store(&hh)
	}
	fresh()
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Method == http.MethodPost && req.URL.Path == api.PathPodSignals {
			body, _ := io.ReadAll(req.Body)
			var rep api.PodReport
			_ = json.Unmarshal(body, &rep)
			reports.Add(1)
			if rep.Register != nil {
				regs.Add(1)
			}
			req.Body = io.NopCloser(jsonBody(t, rep))
		}
		(*h.Load()).ServeHTTP(w, req)
	}))
	defer ts.Close()
	reg := api.PodRegistration{Models: []string{"tiny"}, Labels: map[string]string{"pool": "gold"}, Adapters: []string{"sql"}, TTLMS: 5000}
	r, err := New(Config{URL: ts.URL, Cluster: "c", Host: "10.0.0.7:9000", Logger: quiet,
		Registration: &reg, RegisterEvery: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	src := SignalSourceFunc(func() api.PodSignals { return api.PodSignals{Running: 1} })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.RunSignals(ctx, src, 5*time.Millisecond, 20*time.Millisecond); close(done) }()
	defer func() { cancel(); <-done }()

	pods := func() map[string]api.PodLabels {
		resp, err := http.Post(ts.URL+api.PathRouteQuery, "application/json", jsonBody(t, api.RouteQuery{Cluster: "c", Hashes: []string{}}))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var ans api.RouteAnswer
		if err := json.NewDecoder(resp.Body).Decode(&ans); err != nil {
			t.Fatal(err)
		}
		return ans.Pods
	}
	want := map[string]api.PodLabels{"10.0.0.7:9000": {Labels: map[string]string{"pool": "gold"}, Adapters: []string{"sql"}}}
	waitFor := func(what string) {
		t.Helper()
		if !wait.Until(5*time.Second, func() bool { return reflect.DeepEqual(pods(), want) }) {
			t.Fatalf("%s: route answer's pods %+v, want %+v", what, pods(), want)
		}
	}
	waitFor("first registration")
	// About a second of signal reports (one every 20 ms) go by.
	start := reports.Load()
	if !wait.Until(10*time.Second, func() bool { return reports.Load() >= start+50 }) {
		t.Fatalf("%d signal reports in 10 s", reports.Load()-start)
	}
	n, m := regs.Load(), reports.Load()
	// ~4 refreshes in 1.3 s against ~65 signal reports every 20 ms.
	if n < 2 || n > 8 || m < 4*n {
		t.Fatalf("%d registrations in %d reports over 1.3 s, want one every 300 ms", n, m)
	}
	fresh() // the metadata center restarts with an empty store
	if p := pods(); p != nil {
		t.Fatalf("fresh store already knows %+v", p)
	}
	waitFor("registration after the metadata center lost it")
}
