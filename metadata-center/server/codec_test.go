package server

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// TestEncodeMatchesEncodingJSON: the hand-written encoder must be a pure
// speed-up, byte for byte what encoding/json writes.
func TestEncodeMatchesEncodingJSON(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	hosts := []string{"10.0.0.1:8000", "[fd00::1]:80", "255.255.255.255:65535", `odd"host\`, "tab\there", "<b>&é"}
	for i := 0; i < 500; i++ {
		var a api.RouteAnswer
		if i%7 != 0 {
			a.Load = api.LoadStats{}
			for n := r.IntN(10); n > 0; n-- {
				a.Load[hosts[r.IntN(len(hosts))]+fmt.Sprint(r.IntN(5))] = api.EndpointStats{TotalReqs: r.Int64N(1 << 40), PromptLength: r.Int64() - 1<<62}
			}
		}
		if i%5 != 0 {
			a.Cache = []api.CacheLocation{}
			for n := r.IntN(10); n > 0; n-- {
				a.Cache = append(a.Cache, api.CacheLocation{Host: hosts[r.IntN(len(hosts))], Length: r.IntN(5000)})
			}
		}
		if i%3 == 0 {
			a.Signals = map[string]api.PodSignals{}
			utils := []float64{0, 1, 0.5, 1e-7, 0.123456789, r.Float64(), 3e-6}
			for n := r.IntN(6); n > 0; n-- {
				sig := api.PodSignals{Waiting: r.Int64N(100), Running: r.Int64N(300),
					KVCacheUtil: utils[r.IntN(len(utils))], PrefillTokens: r.Int64N(1 << 20), AgeMS: r.Int64N(3)}
				if r.IntN(2) == 0 { // our worker's: its costs and queue
					sig.KVCapacity, sig.MaxRunning, sig.ReportsEvictions = r.Int64N(1<<20), r.Int64N(64), true
					sig.TokenSeconds, sig.AttentionSeconds, sig.StepSeconds, sig.StepLeftSeconds = 5.8e-4, 1.1e-6, 0.0125, utils[r.IntN(len(utils))]
					if r.IntN(2) == 0 { // a prompt held by finish first
						sig.HeldTokens, sig.HeldStepSeconds, sig.HoldLeftSeconds = r.Int64N(4096), utils[r.IntN(len(utils))], utils[r.IntN(len(utils))]
					}
					for range r.IntN(3) {
						sig.PrefillQueue = append(sig.PrefillQueue, api.Prefill{Tokens: r.Int64N(4096), Seconds: utils[r.IntN(len(utils))]})
					}
				}
				a.Signals[hosts[r.IntN(len(hosts))]] = sig
			}
		}
		want, err := json.Marshal(a)
		if err != nil {
			t.Fatal(err)
		}
		if got := appendRoute(nil, a); !bytes.Equal(got, want) {
			t.Fatalf("appendRoute = %s\nencoding/json = %s", got, want)
		}
		if a.Cache != nil {
			want, _ = json.Marshal(a.Cache)
			if got := appendLocations(nil, a.Cache); !bytes.Equal(got, want) {
				t.Fatalf("appendLocations = %s, want %s", got, want)
			}
		}
	}
}

// TestCompactRouteRoundTrip: the compact answer expands to exactly the
// answer it encodes, whatever overlap of load and cache hosts, and is the
// same bytes whatever the load map's iteration order.
func TestCompactRouteRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	hosts := []string{"10.0.0.1:8000", "10.0.0.2:8000", "[fd00::1]:80", "255.255.255.255:65535", `odd"host\`, "tab\there", "<b>&é", "10.0.1.9:8000"}
	for i := 0; i < 500; i++ {
		a := api.RouteAnswer{Load: api.LoadStats{}, Cache: []api.CacheLocation{}}
		for n := r.IntN(len(hosts) + 1); n > 0; n-- {
			a.Load[hosts[r.IntN(len(hosts))]] = api.EndpointStats{TotalReqs: r.Int64N(1 << 40), PromptLength: r.Int64() - 1<<62}
		}
		for _, k := range r.Perm(len(hosts))[:r.IntN(len(hosts)+1)] { // a host is in the cache once
			a.Cache = append(a.Cache, api.CacheLocation{Host: hosts[k], Length: r.IntN(5000)})
		}
		if i%3 == 0 {
			a.Signals = map[string]api.PodSignals{hosts[r.IntN(len(hosts))]: {Waiting: 1, Running: 2, KVCacheUtil: 0.5, PrefillTokens: 7, AgeMS: 3}}
			a.Pods = map[string]api.PodLabels{hosts[r.IntN(len(hosts))]: {Labels: map[string]string{"pool": "gold"}, Adapters: []string{"sql"}}}
		}
		raw := appendCompactRoute(nil, a)
		var ca api.CompactRouteAnswer
		if err := json.Unmarshal(raw, &ca); err != nil {
			t.Fatalf("%s: %v", raw, err)
		}
		got, err := ca.Expand()
		if err != nil {
			t.Fatalf("%s: %v", raw, err)
		}
		if !reflect.DeepEqual(got, a) {
			t.Fatalf("%s expands to %+v, want %+v", raw, got, a)
		}
		for range 3 { // the same answer in another map: same bytes
			b := a
			b.Load = maps.Clone(a.Load)
			if again := appendCompactRoute(nil, b); !bytes.Equal(again, raw) {
				t.Fatalf("compact answer not deterministic: %s vs %s", again, raw)
			}
		}
	}
	if raw := appendCompactRoute(nil, api.RouteAnswer{Load: api.LoadStats{}, Cache: []api.CacheLocation{}}); string(raw) != `{"hosts":[],"cache":[],"load":[]}` {
		t.Fatalf("empty compact answer %s", raw)
	}
}

// Expand refuses what no server writes instead of answering a wrong load.
func TestCompactRouteExpandRejects(t *testing.T) {
	for _, raw := range []string{
		`{"hosts":["a"],"cache":[1,2],"load":[]}`,
		`{"hosts":["a"],"cache":[],"load":[0,1]}`,
		`{"hosts":["a"],"cache":[],"load":[1,1,1]}`,
		`{"hosts":["a"],"cache":[],"load":[-1,1,1]}`,
		`{"hosts":["a"],"cache":[],"load":[0,1,1,0,2,2]}`,
	} {
		var ca api.CompactRouteAnswer
		if err := json.Unmarshal([]byte(raw), &ca); err != nil {
			t.Fatal(err)
		}
		if a, err := ca.Expand(); err == nil {
			t.Errorf("%s expands to %+v", raw, a)
		}
	}
}

var querySeeds = []string{
	`{"cluster":"c","hashes":["0123456789abcdef","fedcba9876543210"]}`,
	` { "hashes" : [ ] , "cluster" : "outbound|8000||q.svc" } `,
	`{"cluster":"c","hashes":[]}`,
	`{"cluster":"","hashes":["0123456789abcdef"]}`,
	`{"cluster":"c"}`,
	`{"cluster":"c","hashes":null}`,
	`{"cluster":"c","hashes":["0123456789ABCDEF"]}`,
	`{"cluster":"c","hashes":["0123456789abcde"]}`,
	`{"cluster":"c","hashes":[1]}`,
	`{"cluster":"c\u0041","hashes":[]}`,
	`{"Cluster":"c","hashes":[]}`,
	`{"cluster":"c","hashes":[],"model":"x"}`,
	`{"cluster":"a","cluster":"b","hashes":[]}`,
	`{"cluster":"c","hashes":["0123456789abcdef",]}`,
	`{"cluster":"c","hashes":[]}x`,
	`{"cluster":"c","hashes":[]`,
	`{"cluster":"c" "hashes":[]}`,
	`{"cluster":"é","hashes":[]}`,
	`{,"cluster":"c","hashes":[]}`,
	`[]`,
	``,
}

// checkQuery: whenever the fast path accepts an input, encoding/json plus
// the slow validation must accept it with the same result.
func checkQuery(t *testing.T, in []byte) {
	cluster, hashes, ok := parseQuery(in, nil)
	if !ok {
		return
	}
	var req api.RouteQuery
	if err := json.Unmarshal(in, &req); err != nil {
		t.Fatalf("fast path accepted %q, encoding/json refused: %v", in, err)
	}
	if req.Hashes == nil {
		t.Fatalf("fast path accepted %q without hashes", in)
	}
	want, err := validHashes(req.Hashes)
	if err != nil {
		t.Fatalf("fast path accepted %q, validation refused: %v", in, err)
	}
	if cluster != req.Cluster || !slices.Equal(hashes, want) {
		t.Fatalf("fast path %q: %q %v, slow path %q %v", in, cluster, hashes, req.Cluster, want)
	}
}

func TestParseQuery(t *testing.T) {
	accepted := 0
	for _, s := range querySeeds {
		checkQuery(t, []byte(s))
		if _, _, ok := parseQuery([]byte(s), nil); ok {
			accepted++
		}
	}
	if accepted != 4 {
		t.Fatalf("fast path accepted %d seeds, want the 4 plain ones", accepted)
	}
	many := make([]string, api.MaxHashes+1)
	for i := range many {
		many[i] = prefix.Hash(i).String()
	}
	body, _ := json.Marshal(api.RouteQuery{Cluster: "c", Hashes: many})
	if _, _, ok := parseQuery(body, nil); ok {
		t.Fatal("fast path accepted more than MaxHashes")
	}
	body, _ = json.Marshal(api.RouteQuery{Cluster: "c", Hashes: many[:api.MaxHashes]})
	if _, hs, ok := parseQuery(body, nil); !ok || len(hs) != api.MaxHashes {
		t.Fatal("fast path refused exactly MaxHashes")
	}
}

func FuzzParseQuery(f *testing.F) {
	for _, s := range querySeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(checkQuery)
}
