package server

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
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
				a.Signals[hosts[r.IntN(len(hosts))]] = api.PodSignals{Waiting: r.Int64N(100), Running: r.Int64N(300),
					KVCacheUtil: utils[r.IntN(len(utils))], PrefillTokens: r.Int64N(1 << 20), AgeMS: r.Int64N(3)}
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
