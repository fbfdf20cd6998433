package gatewaymetrics

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
)

// Prom exports every family under its conventional name: counters with
// _total, durations in seconds labelled by the rule's model and cluster,
// and every series a config can produce from the start.
func TestPromNamesUnitsAndLabels(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := NewProm(reg)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Parse([]byte("model_mapping_rule: {qwen: [{cluster: pool, scene_name: chat}]}\n"))
	if err != nil {
		t.Fatal(err)
	}
	m.Declare(cfg)
	m.Count("routed", 2)
	m.Count("no_such_event", 1)
	m.Count(InFlight, 1)
	m.Observe(TTFT, HistLabels{Model: "qwen", Cluster: "pool"}, 1500*time.Millisecond)
	m.Request(RequestLabels{Model: "qwen", Cluster: "pool", Scene: "chat", Policy: "cache_aware", Outcome: OutcomeSuccess})

	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, mf := range mfs {
		seen[mf.GetName()] = true
		switch mf.GetName() {
		case EventMetric("routed"):
			if v := mf.GetMetric()[0].GetCounter().GetValue(); v != 2 {
				t.Errorf("%s = %v, want 2", mf.GetName(), v)
			}
		case InFlightMetric:
			if v := mf.GetMetric()[0].GetGauge().GetValue(); v != 1 {
				t.Errorf("%s = %v, want 1", mf.GetName(), v)
			}
		}
		if mf.GetName() != TTFT {
			continue
		}
		for _, mt := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range mt.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			h := mt.GetHistogram()
			switch labels[LabelModel] + "/" + labels[LabelCluster] {
			case "qwen/pool":
				if h.GetSampleCount() != 1 || h.GetSampleSum() != 1.5 {
					t.Errorf("ttft{qwen,pool}: %d values summing to %v, want one of 1.5 s", h.GetSampleCount(), h.GetSampleSum())
				}
			case "none/none":
				if h.GetSampleCount() != 0 {
					t.Errorf("ttft{none,none}: %d values, want the declared empty series", h.GetSampleCount())
				}
			default:
				t.Errorf("ttft series with labels %v", labels)
			}
		}
	}
	for _, n := range append([]string{Requests, InFlightMetric, EventMetric("fallbacks")}, Histograms...) {
		if !seen[n] {
			t.Errorf("%s not exported", n)
		}
	}
	for n := range seen {
		if !strings.HasPrefix(n, Prefix) || (!strings.HasSuffix(n, "_total") && !strings.HasSuffix(n, "_seconds") && n != InFlightMetric) {
			t.Errorf("%s does not follow the naming rules", n)
		}
	}
}

// Label values reach Envoy stat names without breaking their ;k=v syntax.
func TestEnvoyStatNames(t *testing.T) {
	l := RequestLabels{Model: "m;x=y", Cluster: "c", Outcome: OutcomeFailed}
	if got, want := l.EnvoyStatName(), "llm_filter_requests_total;model_name=m_x_y;cluster=c;scene=none;policy=none;outcome=failed"; got != want {
		t.Errorf("EnvoyStatName = %q, want %q", got, want)
	}
	if got, want := (HistLabels{}).EnvoyStatName("llm_filter_ttft_milliseconds"), "llm_filter_ttft_milliseconds;model_name=none;cluster=none"; got != want {
		t.Errorf("EnvoyStatName = %q, want %q", got, want)
	}
}
