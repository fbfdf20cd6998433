package envoyhost

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewaymetrics"
	"github.com/istio-llm-filter/istio-llm-filter/filter/llmfilter"
)

// Through the real .so: the per-request access record reaches the HCM
// access log as dynamic metadata, the histograms are Envoy histograms
// (defined through the C API), and the request counter carries the rule's
// labels in its stat name.
func TestAccessRecordAndMetricsInEnvoy(t *testing.T) {
	_, mc := newMetadataCenter(t)
	pod := simWorker(t)
	// Envoy's log at warning, Istio's default proxy log level.
	h := startHost(t, Options{LogLevel: 3, Clusters: map[string][]string{"pool": {pod}}})
	if _, err := h.PushConfig([]byte(filterDoc(mc, []string{pod}, ""))); err != nil {
		t.Fatal(err)
	}
	for _, stream := range []bool{true, false} {
		if resp, body := post(t, h.URL(), chatBody("observe me", stream)); resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
	}
	if resp, _ := send(t, "POST", h.URL()+"/v1/chat/completions", "", nil); resp.StatusCode != 400 {
		t.Fatalf("body-less POST: %d", resp.StatusCode)
	}
	var recs []AccessRecord
	waitUntil(t, "three access log lines", 10*time.Second, func() bool {
		var err error
		recs, err = h.AccessLog()
		if err != nil {
			t.Fatal(err)
		}
		return len(recs) == 3
	})
	ns := llmfilter.Name + ":"
	for i, r := range recs[:2] {
		m := r.Metadata
		if r.Code != 200 || m[ns+llmfilter.AccessBackend] != pod || m[ns+llmfilter.AccessChosen] != pod ||
			m[ns+llmfilter.AccessModel] != "qwen" || m[ns+llmfilter.AccessCluster] != "pool" || m[ns+llmfilter.AccessPolicy] != "cache_aware" {
			t.Fatalf("record %d: %+v", i, r)
		}
		if _, ok := m[ns+llmfilter.AccessCacheRatio].(float64); !ok {
			t.Fatalf("record %d: cache_ratio %v", i, m[ns+llmfilter.AccessCacheRatio])
		}
		if ttft, ok := m[ns+llmfilter.AccessTTFT].(float64); !ok || ttft < 0 {
			t.Fatalf("record %d: ttft_ms %v", i, m[ns+llmfilter.AccessTTFT])
		}
		if m[ns+llmfilter.LocalReplyMetadataKey] != nil {
			t.Fatalf("record %d: a routed answer is marked as the filter's reply", i)
		}
	}
	if r := recs[2]; r.Code != 400 || r.Metadata[ns+llmfilter.LocalReplyMetadataKey] != true {
		t.Fatalf("the filter's 400 is not marked for local_reply_config: %+v", r)
	}

	var m map[string]int64
	waitUntil(t, "the request counters", 10*time.Second, func() bool {
		var err error
		if m, err = h.Metrics(); err != nil {
			t.Fatal(err)
		}
		ok := (gatewaymetrics.RequestLabels{Model: "qwen", Cluster: "pool", Policy: "cache_aware", Outcome: gatewaymetrics.OutcomeSuccess}).EnvoyStatName()
		rej := (gatewaymetrics.RequestLabels{Outcome: gatewaymetrics.OutcomeRejected}).EnvoyStatName()
		return m[ok] == 2 && m[rej] == 1
	})
	// Each histogram is an Envoy stat per rule's model and cluster, in the
	// integer unit its name carries.
	labels := gatewaymetrics.HistLabels{Model: "qwen", Cluster: "pool"}
	stat := func(hist string) string {
		name, _ := llmfilter.EnvoyHistogram(hist)
		return labels.EnvoyStatName(name)
	}
	for _, h := range gatewaymetrics.Histograms {
		if n := m[stat(h)+":count"]; n != 2 {
			t.Errorf("histogram %s recorded %d values, want 2 (all: %v)", stat(h), n, m)
		}
	}
	// The filter's own line goes to stdout (the host points fd 1 at its
	// stderr), one JSON object per request, whatever Envoy's log level.
	lines := 0
	for _, l := range strings.Split(h.Stderr(), "\n") {
		var rec map[string]any
		if json.Unmarshal([]byte(l), &rec) == nil && rec["msg"] == "completed" {
			lines++
			if rec["outcome"] != gatewaymetrics.OutcomeSuccess && rec["outcome"] != gatewaymetrics.OutcomeRejected {
				t.Errorf("access line with outcome %v: %s", rec["outcome"], l)
			}
		}
	}
	if lines != 3 {
		t.Errorf("%d JSON access lines on stdout, want 3", lines)
	}
	if ttft, dur := m[stat(gatewaymetrics.TTFT)+":sum"], m[stat(gatewaymetrics.RequestDuration)+":sum"]; ttft > dur {
		t.Errorf("TTFT sum %d ms above the duration sum %d ms", ttft, dur)
	}
}
