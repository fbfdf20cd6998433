package llmfilter_test

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewaymetrics"
)

// BenchmarkGatewayRequest measures one non-streamed chat through the
// standalone gateway running the filter (decision with a real metadata
// center on loopback, async updates) to a fake pod. Compare with
// filter/standalone's BenchmarkDirect for the gateway's overhead.
func BenchmarkGatewayRequest(b *testing.B) {
	benchGateway(b, newWorld(b, 4, ""))
}

// BenchmarkGatewayRequestNoMetadataCenter is the same without a metadata
// center (no route query, no updates): the filter and its decision alone.
func BenchmarkGatewayRequestNoMetadataCenter(b *testing.B) {
	benchGateway(b, newWorld(b, 4, noMetadataCenter))
}

// BenchmarkGatewayObservability runs the same request (no metadata
// center) with the filter reporting into plain event counts and into the
// standalone gateway's Prometheus metrics (histograms, the labelled request
// counter): the cost of the observability per request, side by side.
func BenchmarkGatewayObservability(b *testing.B) {
	b.Run("counts", func(b *testing.B) { benchGateway(b, newWorld(b, 4, noMetadataCenter)) })
	b.Run("prometheus", func(b *testing.B) {
		pm, err := gatewaymetrics.NewProm(prometheus.NewRegistry())
		if err != nil {
			b.Fatal(err)
		}
		benchGateway(b, newWorldMetrics(b, 4, noMetadataCenter, pm))
	})
}

func benchGateway(b *testing.B, w *world) {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	var n atomic.Int64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			i := n.Add(1)
			// Half share a long prefix (cache hits), half are unrelated.
			prompt := fmt.Sprintf("unrelated %d", i)
			if i%2 == 0 {
				prompt = longPrefix + fmt.Sprint(i)
			}
			resp, err := client.Post(w.gw.URL+"/v1/chat/completions", "application/json", strings.NewReader(chatBody(prompt, false)))
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
