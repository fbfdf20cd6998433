package rules

import (
	"net/http"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
)

// httpHeaders adapts net/http headers (canonical-case keys) the way the
// standalone gateway does; Envoy's header map is already lower case.
type httpHeaders http.Header

func (h httpHeaders) Get(k string) (string, bool) {
	v := http.Header(h).Values(k)
	if len(v) == 0 {
		return "", false
	}
	return v[0], true
}

func hdr(kv ...string) httpHeaders {
	h := http.Header{}
	for i := 0; i < len(kv); i += 2 {
		h.Set(kv[i], kv[i+1])
	}
	return httpHeaders(h)
}

func table(t *testing.T) *Table {
	t.Helper()
	cfg, err := config.Parse([]byte(`
model_mapping_rule:
  qwen:
    - cluster: default
    - headers: {x-env: test}
      cluster: test
    - headers: {X-Env: prod, x-tier: gold}
      cluster: prod-gold
    - headers: {x-env: prod}
      cluster: prod
  strict:
    - headers: {x-env: prod}
      cluster: strict-prod
`))
	if err != nil {
		t.Fatal(err)
	}
	return New(cfg.ModelMappingRule)
}

func TestMatch(t *testing.T) {
	tb := table(t)
	cases := []struct {
		model   string
		h       Headers
		cluster string
		res     Result
	}{
		{"qwen", hdr(), "default", Matched},
		{"qwen", hdr("x-env", "test"), "test", Matched},
		{"qwen", hdr("x-env", "prod"), "prod", Matched},
		// Two conditions outrank one whatever the configured order.
		{"qwen", hdr("x-env", "prod", "x-tier", "gold"), "prod-gold", Matched},
		{"qwen", hdr("x-env", "prod", "x-tier", "silver"), "prod", Matched},
		{"qwen", hdr("x-env", "staging"), "default", Matched},
		{"qwen", hdr("X-ENV", "test"), "test", Matched},
		{"qwen", hdr("x-env", "TEST"), "default", Matched}, // values are exact
		{"strict", hdr("x-env", "prod"), "strict-prod", Matched},
		{"strict", hdr(), "", NoRuleMatched},
		{"llama", hdr("x-env", "prod"), "", UnknownModel},
		{"Qwen", hdr(), "", UnknownModel}, // model names are exact
	}
	for _, c := range cases {
		r, res := tb.Match(c.model, c.h)
		if res != c.res || (r != nil) != (c.res == Matched) || (r != nil && r.Cluster != c.cluster) {
			t.Errorf("%s %v: got %v %+v, want %v %s", c.model, c.h, res, r, c.res, c.cluster)
		}
	}
	if m := tb.Models(); len(m) != 2 || m[0] != "qwen" {
		t.Fatalf("Models() = %v", m)
	}
}

func BenchmarkMatch(b *testing.B) {
	cfg, _ := config.Parse([]byte(`model_mapping_rule: {qwen: [{cluster: d}, {headers: {x-env: prod, x-tier: gold}, cluster: g}, {headers: {x-env: prod}, cluster: p}]}`))
	tb := New(cfg.ModelMappingRule)
	h := hdr("x-env", "prod", "x-tier", "silver")
	b.ReportAllocs()
	for b.Loop() {
		if r, _ := tb.Match("qwen", h); r.Cluster != "p" {
			b.Fatal(r.Cluster)
		}
	}
}
