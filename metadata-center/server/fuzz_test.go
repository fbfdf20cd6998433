package server_test

import (
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
)

var fuzzPaths = []string{
	api.PathLoadStats, api.PathLoadStatsPrompt, api.PathCacheQuery, api.PathCacheSave, api.PathCacheEvict,
	api.PathRouteQuery, api.PathHealthz, api.PathReadyz, "/v1/unknown", api.PathLoadStats + "?cluster=c", api.PathBatch,
	api.PathCacheRetract,
	api.PathPodSignals, api.PathPods + "?cluster=c", api.PathPods,
}

var fuzzMethods = []string{http.MethodGet, http.MethodPost, http.MethodDelete, http.MethodPut}

// FuzzAPI sends arbitrary bodies to every endpoint of the real server (on
// the in-memory store, which never fails). Whatever arrives, the answer is
// never a 5xx, always JSON, and an error names its own status in the
// error format; the server keeps answering afterwards.
func FuzzAPI(f *testing.F) {
	for _, b := range []string{
		`{"cluster":"c","host":"10.0.0.1:80","request_id":"r","prompt_length":5}`,
		`{"cluster":"c","hashes":["0123456789abcdef","fedcba9876543210"]}`,
		`{"cluster":"c","host":"10.0.0.1:80","hashes":["0123456789abcdef"],"chunk_size":512}`,
		`{"cluster":"c","host":"10.0.0.1:80","all":true}`,
		`{"cluster":"c","host":"10.0.0.1:80","all":true,"evicted_at":1700000000000}`,
		`{"cluster":"c","host":"10.0.0.1:80","hashes":["0123456789abcdef"],"evicted_at":-1}`,
		`{"cluster":"c","host":"10.0.0.1:80","hashes":["0123456789abcdef"],"save_id":"r1"}`,
		`{"cluster":"c","host":"10.0.0.1:80","hashes":["0123456789abcdef"],"save_id":"r1","refresh_only":true}`,
		`{"cluster":"c","host":"10.0.0.1:80","hashes":["0123456789abcdef"],"save_id":"r1","age_ms":250}`,
		`{"cluster":"c","host":"10.0.0.1:80","hashes":["0123456789abcdef"],"refresh_only":"yes"}`,
		`{"ops":[{"op":"cache_save","cluster":"c","host":"10.0.0.1:80","hashes":["0123456789abcdef"],"refresh_only":true}]}`,
		`{"ops":[{"op":"done","cluster":"c","host":"10.0.0.1:80","request_id":"r","refresh_only":true}]}`,
		`{"ops":[{"op":"cache_retract","cluster":"c","host":"10.0.0.1:80","hashes":["0123456789abcdef"],"save_id":"r1"}]}`,
		`{"cluster":"c","host":"10.0.0.1:80","running":1,"register":{"models":["m"],"labels":{"pool":"a"},"adapters":["sql"],"ttl_ms":5000}}`,
		`{"cluster":"c","host":"10.0.0.1:80","register":{"labels":{"":"x"},"adapters":["a","a"],"ttl_ms":-1}}`,
		`{"cluster":"c","hashes":["0123456789ABCDEF"]}`, `{"cluster":"c","hashes":null}`,
		`[]`, `{"cluster":1}`, `{"cluster":"c"}{}`, "", `{"cluster":"\ud800","host":"[::1]:0"}`,
	} {
		for i := range fuzzPaths {
			f.Add(uint8(1), uint8(i), []byte(b))
		}
	}
	srv := server.New(memstore.New(memstore.Options{}), server.Options{
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), MaxBodyBytes: 64 << 10})
	h := srv.Handler()
	f.Fuzz(func(t *testing.T, method, path uint8, body []byte) {
		m, p := fuzzMethods[int(method)%len(fuzzMethods)], fuzzPaths[int(path)%len(fuzzPaths)]
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(m, p, bytes.NewReader(body)))
		if rec.Code >= 500 {
			t.Fatalf("%s %s %q: %d %s", m, p, body, rec.Code, rec.Body)
		}
		out := rec.Body.Bytes()
		if len(out) == 0 || !json.Valid(out) {
			t.Fatalf("%s %s %q: %d, body not JSON: %q", m, p, body, rec.Code, out)
		}
		if rec.Code >= 400 {
			var e api.Error
			if err := json.Unmarshal(out, &e); err != nil || e.Error.Code != rec.Code || e.Error.Type == "" || e.Error.Message == "" {
				t.Fatalf("%s %s %q: %d with a body not in the error format: %s", m, p, body, rec.Code, out)
			}
		}
		rec = httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, api.PathHealthz, nil))
		if rec.Code != http.StatusOK {
			t.Fatalf("healthz after %s %s %q: %d", m, p, body, rec.Code)
		}
	})
}
