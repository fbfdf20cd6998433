package routing

import (
	"maps"

	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// withRegistered gives each endpoint the labels and LoRA adapters its pod
// registered with the metadata center. The endpoint source's own labels
// (static entries) win over registered ones of the same key: they are the
// operator's word about the pod. A pod that has not registered keeps only
// the source's labels. eps is the source's copy; its label maps are shared
// with the source and never written.
func withRegistered(eps []endpoints.Endpoint, pods map[string]api.PodLabels) []endpoints.Endpoint {
	if len(pods) == 0 {
		return eps
	}
	for i := range eps {
		p, ok := pods[eps[i].Address]
		if !ok {
			continue
		}
		switch {
		case len(eps[i].Labels) == 0:
			// Nothing to merge (pods discovered through Envoy carry no
			// labels): share the answer's map, which nothing writes,
			// rather than copy it per pod and decision.
			eps[i].Labels = p.Labels
		case len(p.Labels) > 0:
			merged := make(map[string]string, len(p.Labels)+len(eps[i].Labels))
			maps.Copy(merged, p.Labels)
			maps.Copy(merged, eps[i].Labels)
			eps[i].Labels = merged
		}
		eps[i].Adapters = p.Adapters
	}
	return eps
}
