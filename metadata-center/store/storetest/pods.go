package storetest

import (
	"reflect"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// testRegistrations: a pod's registration is answered by the route query
// (labels and adapters only) and by Pods (all of it, with the time left)
// until its TTL passes without a refresh; a new one replaces the old.
func testRegistrations(e *env) {
	hs := hashes("reg", 2)
	if got, err := e.st.Router.Route(e.ctx, cl, hs); err != nil || got.Pods != nil {
		e.t.Fatalf("no registrations yet: Route pods %+v %v", got.Pods, err)
	}
	if got, err := e.st.Registry.Pods(e.ctx, cl); err != nil || len(got) != 0 {
		e.t.Fatalf("no registrations yet: Pods %+v %v", got, err)
	}
	regA := api.PodRegistration{Models: []string{"tiny"}, Labels: map[string]string{"pool": "a", "gpu": "l4"},
		Adapters: []string{"sql", "chat"}, TTLMS: 99}
	regB := api.PodRegistration{Models: []string{"tiny"}, Labels: map[string]string{"pool": "b"}}
	e.must(e.st.Registry.Register(e.ctx, cl, hostA, regA, 30*time.Second))
	e.must(e.st.Registry.Register(e.ctx, cl, hostB, regB, 5*time.Second))
	e.must(e.st.Registry.Register(e.ctx, "other", hostC, regB, 30*time.Second))
	e.must(e.st.Leases.AddLease(e.ctx, cl, hostA, "r1", 10))
	e.must(e.st.Index.SaveCacheAs(e.ctx, cl, hostB, hs, "", 0, 0))
	e.clock.Advance(time.Second)

	got, err := e.st.Router.Route(e.ctx, cl, hs)
	e.must(err)
	want := map[string]api.PodLabels{
		hostA: {Labels: map[string]string{"pool": "a", "gpu": "l4"}, Adapters: []string{"sql", "chat"}},
		hostB: {Labels: map[string]string{"pool": "b"}},
	}
	if !reflect.DeepEqual(got.Pods, want) {
		e.t.Fatalf("Route pods = %+v, want %+v", got.Pods, want)
	}
	if !reflect.DeepEqual(got.Load, api.LoadStats{hostA: {TotalReqs: 1, PromptLength: 10}}) ||
		!reflect.DeepEqual(got.Cache, []api.CacheLocation{{Host: hostB, Length: 2}}) {
		e.t.Fatalf("Route load/cache beside pods = %+v", got)
	}
	pods, err := e.st.Registry.Pods(e.ctx, cl)
	e.must(err)
	wantA, wantB := regA, regB
	wantA.TTLMS, wantB.TTLMS = 29_000, 4_000
	if !reflect.DeepEqual(pods, map[string]api.PodRegistration{hostA: wantA, hostB: wantB}) {
		e.t.Fatalf("Pods = %+v, want A %+v and B %+v", pods, wantA, wantB)
	}

	// A refresh replaces the registration and restarts its TTL.
	regB2 := api.PodRegistration{Labels: map[string]string{"pool": "c"}, Adapters: []string{"sql"}}
	e.must(e.st.Registry.Register(e.ctx, cl, hostB, regB2, 5*time.Second))
	e.clock.Advance(4 * time.Second)
	got, err = e.st.Router.Route(e.ctx, cl, hs)
	e.must(err)
	want[hostB] = api.PodLabels{Labels: map[string]string{"pool": "c"}, Adapters: []string{"sql"}}
	if !reflect.DeepEqual(got.Pods, want) {
		e.t.Fatalf("after B's refresh: Route pods = %+v, want %+v", got.Pods, want)
	}
	// B is not refreshed again: past its TTL it is gone, A stays.
	e.clock.Advance(time.Second + time.Millisecond)
	got, err = e.st.Router.Route(e.ctx, cl, hs)
	e.must(err)
	delete(want, hostB)
	if !reflect.DeepEqual(got.Pods, want) {
		e.t.Fatalf("after B's TTL: Route pods = %+v, want %+v", got.Pods, want)
	}
	if pods, err := e.st.Registry.Pods(e.ctx, cl); err != nil || len(pods) != 1 || pods[hostA].TTLMS != 24_000-1 {
		e.t.Fatalf("after B's TTL: Pods = %+v %v, want A alone with 23999 ms left", pods, err)
	}
	e.clock.Advance(25 * time.Second)
	if got, err := e.st.Router.Route(e.ctx, cl, hs); err != nil || got.Pods != nil {
		e.t.Fatalf("every registration expired: Route pods %+v %v", got.Pods, err)
	}
	if got, err := e.st.Registry.Pods(e.ctx, "other"); err != nil || len(got) != 0 {
		e.t.Fatalf("other cluster's registration past its TTL: %+v %v", got, err)
	}
}
