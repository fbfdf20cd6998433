package podsignals

import (
	"encoding/json"
	"fmt"
	"slices"

	"sigs.k8s.io/yaml"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
)

// TargetsFromFilterConfig reads the filter's configuration — the gateway's
// file (`filter:` inside) or the bare filter document — and returns, for
// every rule whose backend has /metrics (vllm, sglang, llamacpp), the pods
// its cluster lists under endpoints.static. The backend is the rule's:
// the one place that already says what a cluster runs. Clusters found
// through the Envoy admin API are not listed here.
func TargetsFromFilterConfig(doc []byte) ([]Target, error) {
	j, err := yaml.YAMLToJSON(doc)
	if err != nil {
		return nil, fmt.Errorf("podsignals: scrape config: %w", err)
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(j, &top); err != nil {
		return nil, fmt.Errorf("podsignals: scrape config: want an object: %w", err)
	}
	if f, ok := top["filter"]; ok {
		j = f
	}
	cfg, err := config.Parse(j)
	if err != nil {
		return nil, fmt.Errorf("podsignals: scrape config: %w", err)
	}
	seen := map[Target]bool{}
	var out []Target
	for _, model := range sortedKeys(cfg.ModelMappingRule) {
		for _, r := range cfg.ModelMappingRule[model] {
			if !Scrapable(r.Backend) {
				continue
			}
			for _, host := range cfg.Endpoints.Static[r.Cluster] {
				t := Target{Cluster: r.Cluster, Host: host, Backend: r.Backend}
				if !seen[t] {
					seen[t] = true
					out = append(out, t)
				}
			}
		}
	}
	return out, nil
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}
