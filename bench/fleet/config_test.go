package fleet

import (
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/podsignals"
)

// The gateway file the fleet writes must parse with the filter's own
// parser, --query-timeout must reach metadata_center.query_timeout and
// --gateway-log-level the gateway's log_level (warn unless set).
func TestGatewayConfigCarriesTheQueryTimeoutAndLogLevel(t *testing.T) {
	for _, tc := range []struct {
		name     string
		set      time.Duration
		want     time.Duration
		logLevel string
		wantLog  string
	}{
		{"default", 0, config.DefaultQueryTimeout, "", "warn"},
		{"set", 1500 * time.Millisecond, 1500 * time.Millisecond, "debug", "debug"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			doc := gatewayConfig("127.0.0.1:1", "http://127.0.0.1:2", Spec{ModelName: "tiny", Policy: "cache_aware", QueryTimeout: tc.set, GatewayLogLevel: tc.logLevel},
				[]string{"127.0.0.1:3", "127.0.0.1:4"})
			logLevel, cfg, err := parseGatewayConfig(doc)
			if err != nil {
				t.Fatalf("rejected: %v\n%s", err, doc)
			}
			if cfg.MetadataCenter.QueryTimeout != tc.want {
				t.Errorf("query_timeout %v, want %v\n%s", cfg.MetadataCenter.QueryTimeout, tc.want, doc)
			}
			if logLevel != tc.wantLog {
				t.Errorf("log_level %q, want %q\n%s", logLevel, tc.wantLog, doc)
			}
		})
	}
}

// A rule the gateway would reject is caught before any process starts:
// the variant that once read "holder_fair: 1.5; holder_wait: 2" (a
// semicolon inside the flow mapping) cost a run its last two policies.
func TestCheckRuleRejectsWhatTheGatewayWould(t *testing.T) {
	if err := CheckRule(Spec{ModelName: "tiny", Policy: "cache_aware", LBRule: "tie_epsilon: 0.2, default_decode_step: 0.01"}); err != nil {
		t.Fatalf("a valid rule rejected: %v", err)
	}
	for _, rule := range []string{"tie_epsilon: 0.2; default_decode_step: 0.01", "tie_epsilom: 0.2", "tie_epsilon: 2", "herd_wait: 1"} {
		if err := CheckRule(Spec{ModelName: "tiny", Policy: "cache_aware", LBRule: rule}); err == nil {
			t.Errorf("%q accepted", rule)
		}
	}
}

// A vLLM-like fleet's gateway rule says backend vllm, and the metadata
// center's scrape config lists every pod as a vllm target.
func TestVLLMFleetIsScrapedByItsRule(t *testing.T) {
	pods := []string{"127.0.0.1:3", "127.0.0.1:4"}
	doc := gatewayConfig("127.0.0.1:1", "http://127.0.0.1:2", Spec{ModelName: "tiny", Policy: "cache_aware", Engine: EngineVLLM}, pods)
	if _, cfg, err := parseGatewayConfig(doc); err != nil || cfg.ModelMappingRule["tiny"][0].Backend != "vllm" {
		t.Fatalf("vllm fleet rule: %v\n%s", err, doc)
	}
	targets, err := podsignals.ParseTargets(scrapeConfig(pods))
	if err != nil {
		t.Fatal(err)
	}
	if len(targets) != 2 || targets[0].Host != pods[0] || targets[1].Host != pods[1] || targets[0].Backend != "vllm" || targets[0].Cluster != Cluster {
		t.Fatalf("scrape targets %+v, want both pods as vllm", targets)
	}
	ours := gatewayConfig("127.0.0.1:1", "http://127.0.0.1:2", Spec{ModelName: "tiny", Policy: "cache_aware", Engine: "sim"}, pods)
	if _, cfg, _ := parseGatewayConfig(ours); cfg.ModelMappingRule["tiny"][0].Backend != "llamacpp" {
		t.Fatalf("our workers' rule: %s", ours)
	}
}
