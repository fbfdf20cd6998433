package main

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
)

// BenchmarkGatewayOverhead measures the latency the standalone gateway adds
// to one request on loopback: the same chat completion sent, one at a time
// and alternately, straight to a simulated pod and through the gateway
// (cache_aware policy, route query and batched updates to a real metadata
// center on its embedded store). It reports both p50s and their
// difference; ns/op is meaningless here.
//
//	go test -run '^$' -bench GatewayOverhead -benchtime 2000x ./filter/cmd/gateway/
func BenchmarkGatewayOverhead(b *testing.B) {
	gin.SetMode(gin.ReleaseMode)
	for _, tc := range []struct {
		size  int
		async string
	}{{64, "batched"}, {8 << 10, "batched"}, {64, "unbatched"}, {8 << 10, "unbatched"}} {
		size, async := tc.size, ""
		if tc.async == "unbatched" {
			async = "\n  async: {batch_window: 0s}"
		}
		b.Run(fmt.Sprintf("%s/prompt_%dB", tc.async, size), func(b *testing.B) {
			mc := httptest.NewServer(server.New(memstore.New(memstore.Options{}), server.Options{
				Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
			}).Handler())
			defer mc.Close()
			pod := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.Copy(io.Discard, r.Body)
				w.Header().Set("content-type", "application/json")
				_, _ = io.WriteString(w, `{"object":"chat.completion","choices":[{"message":{"role":"assistant","content":"ok"}}]}`)
			}))
			defer pod.Close()
			gw := startGateway(b, fmt.Sprintf(`
listen: 127.0.0.1:0
log_level: error
filter:
  metadata_center: {address: %s}
  model_mapping_rule:
    qwen:
      - cluster: pool
        backend: llamacpp
  lb_mapping_rule:
    default: {policy: cache_aware}
  endpoints:
    static: {pool: [%s]}%s
`, mc.URL, pod.Listener.Addr(), async))
			body := fmt.Sprintf(`{"model":"qwen","messages":[{"role":"system","content":%q},{"role":"user","content":"hi"}]}`,
				strings.Repeat("a", size))
			hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
			post := func(url string) time.Duration {
				start := time.Now()
				resp, err := hc.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
				if err != nil {
					b.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					b.Fatalf("status %d", resp.StatusCode)
				}
				return time.Since(start)
			}
			for range 50 { // warm connections and caches
				post(pod.URL)
				post(gw)
			}
			direct := make([]time.Duration, 0, b.N)
			via := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for range b.N {
				direct = append(direct, post(pod.URL))
				via = append(via, post(gw))
			}
			b.StopTimer()
			p50 := func(d []time.Duration) float64 {
				slices.Sort(d)
				return float64(d[len(d)/2].Microseconds())
			}
			p90 := func(d []time.Duration) float64 { return float64(d[len(d)*9/10].Microseconds()) }
			pd, pg := p50(direct), p50(via)
			b.ReportMetric(pd, "direct_p50_us")
			b.ReportMetric(pg, "gateway_p50_us")
			b.ReportMetric(pg-pd, "overhead_p50_us")
			b.ReportMetric(p90(via)-p90(direct), "overhead_p90_us")
		})
	}
}
