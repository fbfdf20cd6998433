package standalone

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
)

// asyncPin is the shape of the real filter: buffer the body, decide on a
// goroutine, pin the host, continue.
type asyncPin struct {
	api.PassThroughStreamFilter
	cb   api.FilterCallbackHandler
	host string
}

func (f *asyncPin) DecodeHeaders(_ api.RequestHeaderMap, end bool) api.StatusType {
	if end {
		return api.Continue
	}
	return api.StopAndBuffer
}

func (f *asyncPin) DecodeData(api.BufferInstance, bool) api.StatusType {
	go func() {
		dec := f.cb.DecoderFilterCallbacks()
		_ = dec.SetUpstreamOverrideHost(f.host, true)
		dec.Continue(api.Continue)
	}()
	return api.Running
}

func benchBackend(b *testing.B) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("content-type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"ok"}}]}`)
	}))
	b.Cleanup(srv.Close)
	return srv
}

func runPosts(b *testing.B, url string) {
	body := `{"model":"qwen","messages":[{"role":"user","content":"` + strings.Repeat("x", 2048) + `"}]}`
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			resp, err := client.Post(url, "application/json", strings.NewReader(body))
			if err != nil {
				b.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				b.Fatalf("status %d", resp.StatusCode)
			}
		}
	})
}

// BenchmarkDirect is the baseline: client straight to the backend.
func BenchmarkDirect(b *testing.B) {
	runPosts(b, benchBackend(b).URL+"/v1/chat/completions")
}

// BenchmarkHost adds the standalone host with a Running/Continue filter.
func BenchmarkHost(b *testing.B) {
	backend := benchBackend(b)
	host, err := New(Options{
		Factory: func(_ any, cb api.FilterCallbackHandler) api.StreamFilter {
			return &asyncPin{cb: cb, host: backend.Listener.Addr().String()}
		},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		b.Fatal(err)
	}
	gw := httptest.NewServer(host)
	b.Cleanup(gw.Close)
	runPosts(b, gw.URL+"/v1/chat/completions")
}
