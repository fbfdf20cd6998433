package lifecycle

import (
	"context"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
)

// The first token checks the decision's prediction against the TTFT since
// Started, unless another pod served the request: its TTFT says nothing of
// the chosen pod. The answer's usage.prompt_tokens teaches the model's
// bytes per token, once per request, and its cached_tokens check what the
// decision believed the pod held of the prompt, likewise for the chosen pod
// only.
func TestFirstTokenChecksThePredictionOfTheChosenPodOnly(t *testing.T) {
	ts := center(t)
	reg := prometheus.NewRegistry()
	e := newGateway(t, configFor(t, ts.URL, ""), routing.Options{Registerer: reg}, nil)
	gathered := func(name string) *dto.Metric {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == name {
				return mf.GetMetric()[0]
			}
		}
		t.Fatalf("no metric %s", name)
		return nil
	}
	checked := func() uint64 {
		return gathered("llm_filter_balancer_ttft_prediction_error").GetHistogram().GetSampleCount()
	}
	ctx := context.Background()
	system := strings.Repeat("You answer questions about rivers, briefly. ", 6)

	d, err := e.Decide(ctx, chatPath(), chatBody(system, "Where does the Nile begin?"))
	if err != nil {
		t.Fatal(err)
	}
	if d.Prediction.Host != d.Host || d.Prediction.Total <= 0 {
		t.Fatalf("decision on %s predicts %+v", d.Host, d.Prediction)
	}
	e.Started(d)
	e.FirstToken(d)
	e.FirstToken(d) // once only
	if got := checked(); got != 1 {
		t.Fatalf("%d predictions checked, want 1", got)
	}
	// The answer, in two pieces; a second usage is not read.
	e.ResponseData(d, []byte(`{"choices":[],"usage":{"prompt_tok`))
	e.ResponseData(d, []byte(`ens":50,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":10}}}`))
	e.ResponseData(d, []byte(`{"usage":{"prompt_tokens":1,"prompt_tokens_details":{"cached_tokens":1}}}`))
	want := float64(d.PromptLength) / 50
	if got := e.Decider.Balancer().BytesPerToken("qwen").Value(); got != want {
		t.Fatalf("bytes per token %v, want %v (%d bytes over 50 tokens)", got, want, d.PromptLength)
	}
	if got := gathered("llm_filter_balancer_bytes_per_token").GetGauge().GetValue(); got != want {
		t.Fatalf("llm_filter_balancer_bytes_per_token %v, want %v", got, want)
	}
	// The index knew nothing of the prompt (a fresh metadata center): the
	// decision believed none of it cached, the pod served 10 of 50 tokens.
	belief := func() *dto.Histogram { return gathered("llm_filter_balancer_cache_belief_error").GetHistogram() }
	if d.Prediction.CachedShare() != 0 || belief().GetSampleCount() != 1 || belief().GetSampleSum() != -0.2 {
		t.Fatalf("believed %v cached; belief checked %d times, sum %v; want 0, once, -0.2",
			d.Prediction.CachedShare(), belief().GetSampleCount(), belief().GetSampleSum())
	}
	e.Done(d)

	d2, err := e.Decide(ctx, chatPath(), chatBody(system, "Where does the Danube end?"))
	if err != nil {
		t.Fatal(err)
	}
	e.Started(d2)
	e.Served(d2, "10.9.9.9:8000")
	e.FirstToken(d2)
	e.ResponseData(d2, []byte(`{"usage":{"prompt_tokens":50,"prompt_tokens_details":{"cached_tokens":50}}}`))
	e.Done(d2)
	if got := checked(); got != 1 {
		t.Fatalf("%d predictions checked after a request another pod served, want 1", got)
	}
	if got := belief().GetSampleCount(); got != 1 {
		t.Fatalf("cache belief checked %d times after a request another pod served, want 1", got)
	}
}
