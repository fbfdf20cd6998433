package config

import (
	"reflect"
	"strings"
	"testing"
	"time"
)

// designDoc is the filter document of the design, verbatim.
const designDoc = `
protocol: openai
metadata_center:
  address: http://127.0.0.1:8080
  query_timeout: 100ms
  update_timeout: 500ms
prompt_hash: {chunk_size: 512}
model_mapping_rule:
  qwen:
    - headers: {x-env: prod}
      cluster: outbound|8000||qwen-prod.llm.svc.cluster.local
      backend: vllm
      scene_name: prod
    - cluster: outbound|8000||qwen.llm.svc.cluster.local
      backend: vllm
lb_mapping_rule:
  default: {policy: cache_aware, cache_ratio_weight: 2, request_load_weight: 1, prefill_load_weight: 3, candidate_percent: 10}
endpoints:
  envoy_admin: {address: http://127.0.0.1:15000, refresh: 1s}
  static: {tiny-pool: [127.0.0.1:9001, 127.0.0.1:9002]}
`

func TestParseDesignDocument(t *testing.T) {
	cfg, err := Parse([]byte(designDoc))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Protocol != "openai" || cfg.MetadataCenter.Address != "http://127.0.0.1:8080" ||
		cfg.MetadataCenter.QueryTimeout != 100*time.Millisecond || cfg.MetadataCenter.UpdateTimeout != 500*time.Millisecond {
		t.Fatalf("metadata center: %+v", cfg.MetadataCenter)
	}
	rules := cfg.ModelMappingRule["qwen"]
	if len(rules) != 2 || rules[0].Headers["x-env"] != "prod" || rules[0].SceneName != "prod" ||
		rules[1].Cluster != "outbound|8000||qwen.llm.svc.cluster.local" || rules[1].Headers != nil {
		t.Fatalf("rules: %+v", rules)
	}
	if d := cfg.LBMappingRule.Default; d.Policy != PolicyCacheAware || d.CacheRatioWeight != 2 || d.RequestLoadWeight != 1 ||
		d.PrefillLoadWeight != 3 || d.CandidatePercent != 10 {
		t.Fatalf("lb default: %+v", d)
	}
	if ea := cfg.Endpoints.EnvoyAdmin; ea == nil || ea.Address != "http://127.0.0.1:15000" || ea.Refresh != time.Second {
		t.Fatalf("envoy admin: %+v", ea)
	}
	if s := cfg.Endpoints.Static["tiny-pool"]; len(s) != 2 || s[1] != "127.0.0.1:9002" {
		t.Fatalf("static: %v", s)
	}
}

func TestDefaults(t *testing.T) {
	cfg, err := Parse([]byte(`{"model_mapping_rule": {"m": [{"cluster": "c"}]}}`))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Protocol != DefaultProtocol || cfg.PromptHash.ChunkSize != 512 || cfg.MaxBodyBytes != DefaultMaxBodyBytes ||
		cfg.MetadataCenter.QueryTimeout != DefaultQueryTimeout || cfg.MetadataCenter.UpdateTimeout != DefaultUpdateTimeout ||
		cfg.Async != (Async{QueueSize: DefaultQueueSize, Workers: DefaultWorkers, DrainTimeout: DefaultDrainTimeout, BatchWindow: DefaultBatchWindow, BatchMaxOps: DefaultBatchMaxOps}) {
		t.Fatalf("defaults not applied: %+v", cfg)
	}
	if r := cfg.ModelMappingRule["m"][0]; r.Backend != "vllm" {
		t.Fatalf("backend default: %q", r.Backend)
	}
	if cfg.Tracing != (Tracing{SampleRatio: DefaultSampleRatio}) {
		t.Fatalf("tracing default: %+v (want off, ratio 1)", cfg.Tracing)
	}
	want := LBRule{Policy: "cache_aware", CacheRatioWeight: 2, RequestLoadWeight: 1, PrefillLoadWeight: 3, CandidatePercent: 10, TieEpsilon: 0.05, DefaultPrefillRate: 5000, DefaultDecodeStep: 0.025}
	if !reflect.DeepEqual(cfg.LBMappingRule.For("anything"), want) {
		t.Fatalf("lb default: %+v", cfg.LBMappingRule.For("anything"))
	}
}

func TestPerClusterLBOverridesOnlyWhatItSets(t *testing.T) {
	cfg, err := Parse([]byte(`
model_mapping_rule: {m: [{cluster: c}]}
lb_mapping_rule:
  default: {cache_ratio_weight: 4}
  "outbound|8000||a": {policy: round_robin}
  b: {candidate_percent: 50, request_load_weight: 0, tie_epsilon: 0, default_prefill_rate: 12000, default_decode_step: 0.01}
`))
	if err != nil {
		t.Fatal(err)
	}
	a := cfg.LBMappingRule.For("outbound|8000||a")
	if a.Policy != PolicyRoundRobin || a.CacheRatioWeight != 4 || a.CandidatePercent != 10 || a.TieEpsilon != 0.05 {
		t.Fatalf("a: %+v", a)
	}
	b := cfg.LBMappingRule.For("b")
	if b.Policy != PolicyCacheAware || b.CandidatePercent != 50 || b.RequestLoadWeight != 0 || b.CacheRatioWeight != 4 || b.TieEpsilon != 0 || b.DefaultPrefillRate != 12000 || b.DefaultDecodeStep != 0.01 {
		t.Fatalf("b: %+v", b)
	}
}

func TestInvalidValuesNameTheirKey(t *testing.T) {
	base := "model_mapping_rule: {m: [{cluster: c}]}\n"
	cases := []struct{ doc, want string }{
		{base + "lb_mapping_rule: {default: {candidate_percent: 0}}", "lb_mapping_rule.default.candidate_percent: must be in 1..100"},
		{base + "lb_mapping_rule: {default: {candidate_percent: 101}}", "lb_mapping_rule.default.candidate_percent: must be in 1..100"},
		{base + "lb_mapping_rule: {default: {candidate_percent: 1.5}}", "lb_mapping_rule.default.candidate_percent: must be an integer"},
		{base + "lb_mapping_rule: {default: {tie_epsilon: 1.5}}", "lb_mapping_rule.default.tie_epsilon: must be in 0..1"},
		{base + "lb_mapping_rule: {default: {tie_epsilon: -0.1}}", "lb_mapping_rule.default.tie_epsilon: must be in 0..1"},
		{base + "lb_mapping_rule: {default: {default_prefill_rate: 5}}", "lb_mapping_rule.default.default_prefill_rate: must be in 10..1e+07"},
		{base + "lb_mapping_rule: {default: {default_decode_step: 0}}", "lb_mapping_rule.default.default_decode_step: must be in 0.0001..10"},
		{base + "lb_mapping_rule: {default: {herd_share: 2}}", "herd_share"},
		{base + "lb_mapping_rule: {default: {cache_ratio_weight: -1}}", "lb_mapping_rule.default.cache_ratio_weight: must be in 0..1000"},
		{base + "lb_mapping_rule: {default: {prefill_load_weight: x}}", "lb_mapping_rule.default.prefill_load_weight: must be a number"},
		{base + "lb_mapping_rule: {default: {policy: Fastest!}}", "lb_mapping_rule.default.policy: must be a policy name"},
		{base + "lb_mapping_rule: {c1: {policy: ''}}", "lb_mapping_rule.c1.policy"},
		{base + "lb_mapping_rule: {default: {scorers: {prefix: 2000}}}", "lb_mapping_rule.default.scorers.prefix: must be in 0..1000"},
		{base + "lb_mapping_rule: {default: {scorers: [prefix]}}", "lb_mapping_rule.default.scorers: must be an object"},
		{base + "lb_mapping_rule: {default: {scorers: {'A b': 1}}}", `lb_mapping_rule.default.scorers: invalid scorer name "A b"`},
		{base + "lb_mapping_rule: {default: {filters: kv_full}}", "lb_mapping_rule.default.filters: must be a list"},
		{base + "lb_mapping_rule: {default: {picker: 3}}", "lb_mapping_rule.default.picker: must be a string"},
		{base + "lb_mapping_rule: {\"outbound|1||x\": {weight: 1}}", `lb_mapping_rule["outbound|1||x"].weight: unknown key`},
		{base + "metadata_center: {address: ftp://x}", "metadata_center.address: must be an http(s) URL"},
		{base + "tracing: {otlp_endpoint: 'collector:4318'}", "tracing.otlp_endpoint: must be an http or https URL with a host"},
		{base + "tracing: {otlp_endpoint: 'http://'}", "tracing.otlp_endpoint: must be an http or https URL with a host"},
		{base + "tracing: {sample_ratio: 2}", "tracing.sample_ratio: must be in 0..1"},
		{base + "tracing: {endpoint: 'http://c:4318'}", "tracing.endpoint: unknown key"},
		{base + "metadata_center: {address: 'http://'}", "metadata_center.address: must name a host"},
		{base + "metadata_center: {address: 'http://x:99999'}", "metadata_center.address"},
		{base + "metadata_center: {address: 'http://x/?a=1'}", "metadata_center.address: must not carry a query"},
		{base + "metadata_center: {query_timeout: 100}", "metadata_center.query_timeout: must be a duration string"},
		{base + "metadata_center: {query_timeout: soon}", "metadata_center.query_timeout: must be a duration"},
		{base + "metadata_center: {query_timeout: 0s}", "metadata_center.query_timeout: must be in 1ms..10s"},
		{base + "metadata_center: {update_timeout: -1s}", "metadata_center.update_timeout: must be in"},
		{base + "metadata_center: {adress: http://x}", "metadata_center.adress: unknown key"},
		{base + "metadata_center: {auth_token: a, auth_token_file: /f}", "metadata_center.auth_token_file: set auth_token or auth_token_file, not both"},
		{base + "metadata_center: {address: 'http://x', tls: {ca_file: /ca}}", "metadata_center.tls: needs an https:// address"},
		{base + "metadata_center: {address: 'https://x', tls: {ca_file: /ca, insecure_skip_verify: true}}", "metadata_center.tls.insecure_skip_verify: skips the verification ca_file is for"},
		{base + "metadata_center: {address: 'https://x', tls: {insecure_skip_verify: 'no'}}", `metadata_center.tls.insecure_skip_verify: must be true or false, got "no"`},
		{base + "metadata_center: {address: 'https://x', tls: {ca: /ca}}", "metadata_center.tls.ca: unknown key"},
		{base + "prompt_hash: {chunk_size: 8}", "prompt_hash.chunk_size: must be in 16..1048576"},
		{base + "protocol: ''", "protocol: must not be empty"},
		{base + "protocol: 3", "protocol: must be a string"},
		{base + "colour: blue", "colour: unknown key"},
		{base + "max_body_bytes: 0", "max_body_bytes: must be in 1..1073741824"},
		{base + "async: {workers: 0}", "async.workers: must be in 1..1024"},
		{base + "async: {queue_size: 2, workers: 4}", "async.workers: must not exceed async.queue_size"},
		{base + "async: {drain_timeout: 2h}", "async.drain_timeout: must be in"},
		{base + "async: {batch_window: 2s}", "async.batch_window: must be in"},
		{base + "async: {batch_max_ops: 2000}", "async.batch_max_ops: must be in"},
		{base + "endpoints: {static: {p: [localhost:80]}}", "endpoints.static.p[0]: address \"localhost:80\" is not a literal ip:port"},
		{base + "endpoints: {static: {p: ['10.0.0.1:0']}}", "endpoints.static.p[0]: address \"10.0.0.1:0\" has port 0"},
		{base + "endpoints: {static: {p: 10.0.0.1:80}}", "endpoints.static.p: must be a list"},
		{base + "endpoints: {envoy_admin: {refresh: 1s}}", "endpoints.envoy_admin.address: is required"},
		{base + "endpoints: {envoy_admin: {address: http://a, refresh: 1ms}}", "endpoints.envoy_admin.refresh: must be in 10ms..10m0s"},
		{base + "endpoints: {dns: {}}", "endpoints.dns: unknown key"},
		{"protocol: openai", "model_mapping_rule: is required"},
		{"model_mapping_rule: {}", "model_mapping_rule: must list at least one model"},
		{"model_mapping_rule: {m: []}", "model_mapping_rule.m: must have at least one rule"},
		{"model_mapping_rule: {m: {cluster: c}}", "model_mapping_rule.m: must be a list of rules"},
		{"model_mapping_rule: {m: [{backend: vllm}]}", "model_mapping_rule.m[0].cluster: is required"},
		{"model_mapping_rule: {m: [{cluster: c, backend: tgi}]}", "model_mapping_rule.m[0].backend: must be one of vllm, sglang, llamacpp, triton"},
		{"model_mapping_rule: {m: [{cluster: c, header: {a: b}}]}", "model_mapping_rule.m[0].header: unknown key"},
		{"model_mapping_rule: {m: [{cluster: c}, {cluster: d}]}", "model_mapping_rule.m[1]: second rule without headers"},
		{"model_mapping_rule: {m: [{cluster: c, headers: {X-Env: a}}, {cluster: d, headers: {x-env: a}}]}", "model_mapping_rule.m[1].headers: same conditions as rule 0"},
		{"model_mapping_rule: {m: [{cluster: c, headers: {a: [1]}}]}", "model_mapping_rule.m[0].headers.a: must be a string"},
		{`model_mapping_rule: {"qwen2.5": [{}]}`, `model_mapping_rule["qwen2.5"][0].cluster: is required`},
		{"[1, 2]", "must be an object"},
		{"a: [", "config: not valid YAML or JSON"},
	}
	for _, c := range cases {
		_, err := Parse([]byte(c.doc))
		if err == nil {
			t.Errorf("%q: accepted", c.doc)
			continue
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q:\n got  %v\n want %s", c.doc, err, c.want)
		}
	}
}

func TestAllErrorsReportedAtOnce(t *testing.T) {
	_, err := Parse([]byte(`
model_mapping_rule: {m: [{cluster: c}]}
metadata_center: {query_timeout: x}
lb_mapping_rule: {default: {candidate_percent: 0}}
`))
	if err == nil || !strings.Contains(err.Error(), "metadata_center.query_timeout") || !strings.Contains(err.Error(), "candidate_percent") {
		t.Fatalf("want both errors, got %v", err)
	}
}

func TestHeaderNamesLowercasedAndScalarsAccepted(t *testing.T) {
	cfg, err := Parse([]byte(`model_mapping_rule: {m: [{cluster: c, headers: {X-Tier: 1, X-Beta: true}, selector: {pool: a}}]}`))
	if err != nil {
		t.Fatal(err)
	}
	r := cfg.ModelMappingRule["m"][0]
	if r.Headers["x-tier"] != "1" || r.Headers["x-beta"] != "true" || r.Selector["pool"] != "a" {
		t.Fatalf("rule: %+v", r)
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(designDoc))
	f.Add([]byte(`{"model_mapping_rule": {"m": [{"cluster": "c"}]}, "lb_mapping_rule": {"default": {"candidate_percent": 5}}}`))
	f.Add([]byte("model_mapping_rule: {m: [{cluster: c, headers: {a: b}}, {cluster: d}]}\nasync: {workers: 3}"))
	f.Fuzz(func(t *testing.T, doc []byte) {
		cfg, err := Parse(doc)
		if err != nil {
			if cfg != nil {
				t.Fatal("config returned with an error")
			}
			return
		}
		// Whatever is accepted must satisfy every documented invariant.
		if cfg.Protocol == "" || cfg.PromptHash.ChunkSize < 16 || cfg.MaxBodyBytes < 1 || len(cfg.ModelMappingRule) == 0 ||
			cfg.MetadataCenter.QueryTimeout < time.Millisecond || cfg.Async.Workers < 1 || cfg.Async.Workers > cfg.Async.QueueSize {
			t.Fatalf("invalid config accepted: %+v", cfg)
		}
		for model, rules := range cfg.ModelMappingRule {
			defaults := 0
			for _, r := range rules {
				if r.Cluster == "" {
					t.Fatalf("%s: rule without cluster", model)
				}
				if len(r.Headers) == 0 {
					defaults++
				}
			}
			if defaults > 1 {
				t.Fatalf("%s: %d default rules", model, defaults)
			}
		}
		for _, r := range append([]LBRule{cfg.LBMappingRule.Default}, mapValues(cfg.LBMappingRule.Clusters)...) {
			if r.CandidatePercent < 1 || r.CandidatePercent > 100 || r.CacheRatioWeight < 0 || r.Policy == "" {
				t.Fatalf("invalid lb rule accepted: %+v", r)
			}
		}
	})
}

// Profiles are composed in the lb rule: scorer weights, filters and the
// picker, with per-cluster entries inheriting the default's.
func TestLBRuleComposesProfiles(t *testing.T) {
	cfg, err := Parse([]byte(`
model_mapping_rule: {m: [{cluster: c}]}
lb_mapping_rule:
  default: {policy: epp, scorers: {prefix: 3, queue: 2, kv_cache: 2}, picker: max_score, filters: [kv_full]}
  c2: {policy: my_policy}
  c3: {filters: []}
`))
	if err != nil {
		t.Fatal(err)
	}
	d := cfg.LBMappingRule.Default
	if d.Policy != "epp" || !reflect.DeepEqual(d.Scorers, map[string]float64{"prefix": 3, "queue": 2, "kv_cache": 2}) ||
		d.Picker != "max_score" || !reflect.DeepEqual(d.Filters, []string{"kv_full"}) {
		t.Fatalf("default: %+v", d)
	}
	if c2 := cfg.LBMappingRule.For("c2"); c2.Policy != "my_policy" || c2.Picker != "max_score" || len(c2.Scorers) != 3 {
		t.Fatalf("c2 should inherit the default's parts: %+v", c2)
	}
	if c3 := cfg.LBMappingRule.For("c3"); c3.Filters == nil || len(c3.Filters) != 0 {
		t.Fatalf("c3: an empty filter list removes the filters: %+v", c3)
	}
}

func mapValues(m map[string]LBRule) []LBRule {
	var out []LBRule
	for _, v := range m {
		out = append(out, v)
	}
	return out
}

func TestStaticEntriesWithLabels(t *testing.T) {
	c, err := Parse([]byte(`
model_mapping_rule: {m: [{cluster: pool}]}
endpoints:
  static:
    pool:
      - 10.0.0.5:8000
      - {address: "10.0.0.6:8000", labels: {lora: support, tier: a100}}
`))
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Endpoints.Static["pool"]; len(got) != 2 || got[1] != "10.0.0.6:8000" {
		t.Fatalf("static = %v", got)
	}
	if l := c.Endpoints.StaticLabels["pool"]["10.0.0.6:8000"]; l["lora"] != "support" || l["tier"] != "a100" {
		t.Fatalf("labels = %v", c.Endpoints.StaticLabels)
	}
	if _, ok := c.Endpoints.StaticLabels["pool"]["10.0.0.5:8000"]; ok {
		t.Fatal("a plain entry got labels")
	}
	for doc, want := range map[string]string{
		`{labels: {a: b}}`:                        "endpoints.static.pool[0].address: is required",
		`{address: "10.0.0.6:8000", lbl: {}}`:     "endpoints.static.pool[0]",
		`{address: "10.0.0.6:8000", labels: [a]}`: "endpoints.static.pool[0].labels",
		`7`: "endpoints.static.pool[0]: must be an \"ip:port\" string or {address, labels}",
	} {
		_, err := Parse([]byte("model_mapping_rule: {m: [{cluster: pool}]}\nendpoints: {static: {pool: [" + doc + "]}}\n"))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: error %v, want it to mention %q", doc, err, want)
		}
	}
}
