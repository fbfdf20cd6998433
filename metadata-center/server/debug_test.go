package server_test

import (
	"net/url"
	"reflect"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/storetest"
)

// TestDebugCacheIndex lists the index through the real handler after saves
// and evictions made through the API, on both stores, and checks the
// listing is guarded like the rest of the API.
func TestDebugCacheIndex(t *testing.T) {
	const a, b = "10.0.0.1:8000", "10.0.0.2:8000"
	h := []string{"00000000000000a1", "00000000000000a2", "00000000000000b1"}
	path := api.PathDebugCacheIndex + "?cluster=" + url.QueryEscape(cl)
	for _, st := range storetest.Stores() {
		t.Run(st.Name, func(t *testing.T) {
			c := serve(t, st.New(t), server.Options{AuthToken: "s3cret"})
			index := func() map[string][]string {
				var got map[string][]string
				c.ok("GET", path, nil, &got)
				return got
			}
			if got := index(); len(got) != 0 {
				t.Fatalf("empty index = %v", got)
			}
			c.ok("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: a, Hashes: h[:2]}, nil)
			c.ok("POST", api.PathCacheSave, api.CacheSave{Cluster: cl, Host: b, Hashes: []string{h[2], h[0]}}, nil)
			want := map[string][]string{a: h[:2], b: {h[0], h[2]}}
			if got := index(); !reflect.DeepEqual(got, want) {
				t.Fatalf("index = %v, want %v", got, want)
			}
			c.ok("POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: a, Hashes: h[1:2]}, nil)
			c.ok("POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: b, All: true}, nil)
			want = map[string][]string{a: h[:1]}
			if got := index(); !reflect.DeepEqual(got, want) {
				t.Fatalf("index after evictions = %v, want %v", got, want)
			}
			c.fails("GET", api.PathDebugCacheIndex, nil, 400, "bad_request", "cluster")
			anon := *c
			anon.token = ""
			anon.fails("GET", path, nil, 401, "unauthorized", "")
		})
	}
}
