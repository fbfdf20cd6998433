package storetest

// The contract of store.Signals: the pods' reports, fresh ones only. The
// registrations are in pods.go.

import (
	"reflect"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
)

// Pods' reports: the latest per host (every field, draining included),
// answered with load and cache by Route, stamped by the store's clock, and left out once older than the
// default max age (store.DefaultSignalMaxAge), never answered stale.
func testSignals(e *env) {
	hs := hashes("sig", 2)
	if got, err := e.st.Signals.Signals(e.ctx, cl); err != nil || len(got) != 0 {
		e.t.Fatalf("no reports yet: %v %v", got, err)
	}
	e.must(e.st.Signals.ReportSignals(e.ctx, cl, hostA, api.PodSignals{Waiting: 3, Running: 8, KVCacheUtil: 0.75, PrefillTokens: 4096, KVCapacity: 65536, MaxRunning: 16, ReportsEvictions: true,
		PrefillQueue: []api.Prefill{{Tokens: 96, Seconds: 0.0625}, {Tokens: 4000, Seconds: 0.6875}}, TokenSeconds: 5.8e-4, AttentionSeconds: 1.1e-6, StepSeconds: 0.0125, StepLeftSeconds: 0.25,
		HeldTokens: 4000, HeldStepSeconds: 0.375, HoldLeftSeconds: 0.0625}))
	e.must(e.st.Signals.ReportSignals(e.ctx, cl, hostB, api.PodSignals{Waiting: 1, Running: 2, KVCacheUtil: 0.125, Draining: true, AgeMS: 99999}))
	e.must(e.st.Signals.ReportSignals(e.ctx, "other", hostC, api.PodSignals{Running: 1}))
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostA, "r1", 10))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, hs, "", 0, 0))
	e.clock.Advance(300 * time.Millisecond)
	want := map[string]api.PodSignals{
		hostA: {Waiting: 3, Running: 8, KVCacheUtil: 0.75, PrefillTokens: 4096, KVCapacity: 65536, MaxRunning: 16, ReportsEvictions: true,
			PrefillQueue: []api.Prefill{{Tokens: 96, Seconds: 0.0625}, {Tokens: 4000, Seconds: 0.6875}}, TokenSeconds: 5.8e-4, AttentionSeconds: 1.1e-6, StepSeconds: 0.0125, StepLeftSeconds: 0.25,
			HeldTokens: 4000, HeldStepSeconds: 0.375, HoldLeftSeconds: 0.0625, AgeMS: 300},
		hostB: {Waiting: 1, Running: 2, KVCacheUtil: 0.125, Draining: true, AgeMS: 300},
	}
	got, err := e.st.Router.Route(e.ctx, cl, hs)
	e.must(err)
	if !reflect.DeepEqual(got.Signals, want) {
		e.t.Fatalf("Route signals = %+v, want %+v", got.Signals, want)
	}
	if !reflect.DeepEqual(got.Load, api.LoadStats{hostA: {TotalReqs: 1, PromptLength: 10}}) ||
		!reflect.DeepEqual(got.Cache, []api.CacheLocation{{Host: hostB, Length: 2}}) {
		e.t.Fatalf("Route load/cache beside signals = %+v", got)
	}
	if s, err := e.st.Signals.Signals(e.ctx, cl); err != nil || !reflect.DeepEqual(s, want) {
		e.t.Fatalf("Signals = %+v %v, want %+v", s, err, want)
	}
	// A new report replaces the old one and restarts its age.
	e.must(e.st.Signals.ReportSignals(e.ctx, cl, hostA, api.PodSignals{Waiting: 0, Running: 1, KVCacheUtil: 0.5}))
	e.clock.Advance(store.DefaultSignalMaxAge - 300*time.Millisecond + time.Millisecond)
	got, err = e.st.Router.Route(e.ctx, cl, hs)
	e.must(err)
	wantA := api.PodSignals{Running: 1, KVCacheUtil: 0.5, AgeMS: (store.DefaultSignalMaxAge - 300*time.Millisecond + time.Millisecond).Milliseconds()}
	if !reflect.DeepEqual(got.Signals, map[string]api.PodSignals{hostA: wantA}) {
		e.t.Fatalf("after B's report went stale: %+v, want only A's newer one %+v", got.Signals, wantA)
	}
	e.clock.Advance(store.DefaultSignalMaxAge)
	got, err = e.st.Router.Route(e.ctx, cl, hs)
	e.must(err)
	if got.Signals != nil {
		e.t.Fatalf("stale reports answered: %+v", got.Signals)
	}
	if s, err := e.st.Signals.Signals(e.ctx, cl); err != nil || len(s) != 0 {
		e.t.Fatalf("stale reports answered by Signals: %+v %v", s, err)
	}
}
