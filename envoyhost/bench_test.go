package envoyhost

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

// The cost the Envoy-faithful host adds per routed request (real .so, no
// metadata center) next to the same request sent to the pod directly.
// Figures: docs/benchmarks.md.
func BenchmarkRequest(b *testing.B) {
	be := newBackend(b)
	h := startHost(b, Options{Clusters: map[string][]string{"pool": {be.addr}}})
	if _, err := h.PushConfig([]byte(filterDoc("", []string{be.addr}, ""))); err != nil {
		b.Fatal(err)
	}
	body := chatBody("benchmark question", false)
	c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	run := func(b *testing.B, url string) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				resp, err := c.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
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
	b.Run("direct", func(b *testing.B) { run(b, "http://"+be.addr) })
	b.Run("envoyhost", func(b *testing.B) { run(b, h.URL()) })
}
