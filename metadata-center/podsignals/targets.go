package podsignals

import (
	"fmt"
	"slices"

	"sigs.k8s.io/yaml"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// Config is the metadata center's scrape configuration (--scrape-config):
// the third-party pods whose /metrics report their signals, by routing
// cluster (as the gateways name it), each cluster with the backend its
// pods run. Our own workers push their signals and are not listed.
//
//	clusters:
//	  outbound|8000||vllm.llm.svc.cluster.local:
//	    backend: vllm          # vllm, sglang or llamacpp
//	    pods: [10.0.0.1:8000, 10.0.0.2:8000]
type Config struct {
	Clusters map[string]ClusterTargets `json:"clusters"`
}

// ClusterTargets are one cluster's pods and the backend they run.
type ClusterTargets struct {
	Backend string   `json:"backend"`
	Pods    []string `json:"pods"`
}

// ParseTargets reads a scrape configuration (YAML or JSON; unknown keys
// are refused) and returns its targets, clusters sorted by name, each
// cluster's pods in the order listed (duplicates once), hosts in their
// canonical ip:port spelling (api.CanonicalHost).
func ParseTargets(doc []byte) ([]Target, error) {
	var c Config
	if err := yaml.UnmarshalStrict(doc, &c); err != nil {
		return nil, fmt.Errorf("podsignals: scrape config: %w", err)
	}
	if len(c.Clusters) == 0 {
		return nil, fmt.Errorf("podsignals: scrape config: clusters: list at least one cluster")
	}
	names := make([]string, 0, len(c.Clusters))
	for name := range c.Clusters {
		names = append(names, name)
	}
	slices.Sort(names)
	seen := map[Target]bool{}
	var out []Target
	for _, cluster := range names {
		ct := c.Clusters[cluster]
		if cluster == "" {
			return nil, fmt.Errorf("podsignals: scrape config: clusters: empty cluster name")
		}
		if !Scrapable(ct.Backend) {
			return nil, fmt.Errorf("podsignals: scrape config: clusters.%s.backend: %q has no known /metrics (want %s, %s or %s)",
				cluster, ct.Backend, BackendVLLM, BackendSGLang, BackendLlamaCpp)
		}
		if len(ct.Pods) == 0 {
			return nil, fmt.Errorf("podsignals: scrape config: clusters.%s.pods: list at least one pod", cluster)
		}
		for i, pod := range ct.Pods {
			host, err := api.CanonicalHost(pod)
			if err != nil {
				return nil, fmt.Errorf("podsignals: scrape config: clusters.%s.pods[%d]: %w", cluster, i, err)
			}
			t := Target{Cluster: cluster, Host: host, Backend: ct.Backend}
			if !seen[t] {
				seen[t] = true
				out = append(out, t)
			}
		}
	}
	return out, nil
}
