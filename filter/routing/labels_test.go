package routing

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode/openai"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
)

func register(t *testing.T, mcURL, cl, host string, reg api.PodRegistration) {
	t.Helper()
	mc, err := client.New(client.Options{Address: mcURL})
	if err != nil {
		t.Fatal(err)
	}
	if err := mc.ReportSignals(context.Background(), api.PodReport{Cluster: cl, Host: host, Register: &reg}); err != nil {
		t.Fatal(err)
	}
}

// TestRegisteredLabels: label selectors, `lora` and a rule's selector match
// the labels and adapters pods registered with the (real) metadata center,
// for endpoints the source lists without labels; the source's own labels
// win over registered ones; an unregistered pod has no labels; base
// requests stay off adapter pods; an adapter nobody serves is 404, and a
// selector that cannot be resolved because the metadata center is down is
// 503.
func TestRegisteredLabels(t *testing.T) {
	if openai.LoRALabel != endpoints.LoRALabel {
		t.Fatalf("the request's lora label %q and the endpoints' %q differ", openai.LoRALabel, endpoints.LoRALabel)
	}
	const a, b, c, d = "10.1.0.1:8000", "10.1.0.2:8000", "10.1.0.3:8000", "10.1.0.4:8000"
	ts := center(t)
	register(t, ts.URL, cluster, a, api.PodRegistration{Models: []string{"qwen"}, Adapters: []string{"sql", "chat"}, Labels: map[string]string{"pool": "gold"}})
	register(t, ts.URL, cluster, b, api.PodRegistration{Models: []string{"qwen"}, Labels: map[string]string{"pool": "silver", "gpu": "l4"}})
	register(t, ts.URL, cluster, d, api.PodRegistration{Models: []string{"qwen"}, Labels: map[string]string{"pool": "gold"}})
	register(t, ts.URL, "elsewhere", c, api.PodRegistration{Labels: map[string]string{"pool": "gold"}}) // another cluster's registration
	src := labelled{cluster: {{Address: a}, {Address: b}, {Address: c}, {Address: d, Labels: map[string]string{"pool": "bronze"}}}}

	for _, policy := range []string{"cache_aware", "round_robin"} {
		t.Run(policy, func(t *testing.T) {
			doc := fmt.Sprintf(`
metadata_center: {address: %q, query_timeout: 2s, update_timeout: 2s}
model_mapping_rule:
  qwen:
    - cluster: %q
  gold:
    - cluster: %q
      selector: {pool: gold}
lb_mapping_rule: {default: {policy: %s}}
`, ts.URL, cluster, cluster, policy)
			cfg, err := config.Parse([]byte(doc))
			if err != nil {
				t.Fatal(err)
			}
			e := newDecider(t, cfg, Options{Endpoints: src})
			hosts := func(body string, n int) map[string]bool {
				t.Helper()
				seen := map[string]bool{}
				for range n {
					dd, err := e.Decide(context.Background(), chatPath(), []byte(body))
					if err != nil {
						t.Fatalf("%s: %v", body, err)
					}
					seen[dd.Host] = true
				}
				return seen
			}
			want := func(body string, hs ...string) {
				t.Helper()
				seen := hosts(body, 24)
				if len(seen) != len(hs) {
					t.Fatalf("%s went to %v, want %v", body, seen, hs)
				}
				for _, h := range hs {
					if !seen[h] {
						t.Fatalf("%s went to %v, want %v", body, seen, hs)
					}
				}
			}
			want(`{"model":"qwen","lora":"sql","messages":[{"role":"user","content":"x"}]}`, a)
			want(`{"model":"qwen","lora":"chat","label_selector":{"pool":"gold"},"messages":[{"role":"user","content":"x"}]}`, a)
			want(`{"model":"qwen","label_selector":{"gpu":"l4"},"messages":[{"role":"user","content":"x"}]}`, b)
			// d registered pool=gold but its static entry says bronze.
			want(`{"model":"qwen","label_selector":{"pool":"bronze"},"messages":[{"role":"user","content":"x"}]}`, d)
			// The rule's selector: pool=gold and no adapter named → d is
			// bronze, a serves adapters only, c never registered here.
			if _, err := e.Decide(context.Background(), chatPath(), []byte(`{"model":"gold","messages":[{"role":"user","content":"x"}]}`)); err == nil ||
				err.(*Error).Status != http.StatusNotFound {
				t.Fatalf("rule selector pool=gold with no base pod of that pool: %v", err)
			}
			want(`{"model":"gold","lora":"sql","messages":[{"role":"user","content":"x"}]}`, a)
			// Base requests stay off the adapter pod, which the route query
			// names. A policy that needs no metadata does not ask for base
			// requests (docs/envoy-filter.md): only the source's labels count.
			base := map[string]bool{}
			for i := range 40 {
				for h := range hosts(fmt.Sprintf(`{"model":"qwen","messages":[{"role":"user","content":"q%d"}]}`, i), 1) {
					base[h] = true
				}
			}
			if policy == "cache_aware" && (base[a] || len(base) < 2) {
				t.Fatalf("base requests went to %v: want pods other than the adapter pod %s", base, a)
			}
			if policy == "round_robin" && len(base) != 4 {
				t.Fatalf("base requests under round_robin went to %v: want every pod", base)
			}

			_, err = e.Decide(context.Background(), chatPath(), []byte(`{"model":"qwen","lora":"nope","messages":[{"role":"user","content":"x"}]}`))
			var ee *Error
			if err == nil || !asError(err, &ee) || ee.Status != http.StatusNotFound || ee.Type != "not_found" ||
				!strings.Contains(ee.Message, `matching label selector {"lora":"nope"}`) || !strings.Contains(string(ee.JSON()), `"code":404`) {
				t.Fatalf("an adapter no pod has: %v", err)
			}
		})
	}

	// The metadata center is down: selectors cannot be resolved (503), base
	// requests still route.
	dead := httptest.NewServer(http.NotFoundHandler())
	dead.Close()
	cfg := configFor(t, dead.URL, "")
	e := newDecider(t, cfg, Options{Endpoints: src})
	_, err := e.Decide(context.Background(), chatPath(), []byte(`{"model":"qwen","lora":"sql","messages":[{"role":"user","content":"x"}]}`))
	var ee *Error
	if err == nil || !asError(err, &ee) || ee.Status != http.StatusServiceUnavailable || !strings.Contains(ee.Message, "did not answer") {
		t.Fatalf("selector with the metadata center down: %v", err)
	}
	if dd, err := e.Decide(context.Background(), chatPath(), []byte(`{"model":"qwen","label_selector":{"pool":"bronze"},"messages":[{"role":"user","content":"x"}]}`)); err != nil || dd.Host != d {
		t.Fatalf("a static label still matches with the metadata center down: %+v %v", dd, err)
	}
	if _, err := e.Decide(context.Background(), chatPath(), chatBody("s", "u")); err != nil {
		t.Fatalf("base request with the metadata center down: %v", err)
	}
}

func asError(err error, out **Error) bool {
	e, ok := err.(*Error)
	*out = e
	return ok
}
