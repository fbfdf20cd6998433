// Package endpoints says which backend pods a cluster has.
//
// The load balancer only needs Source; where the answer comes from (Envoy's
// admin API in the mesh, static lists in the standalone gateway and tests) is
// the business of the implementations in this package.
package endpoints

import "slices"

// Endpoint is one healthy backend pod.
type Endpoint struct {
	Address string            // always "ip:port"
	Labels  map[string]string // from endpoint metadata; used by label selectors (LoRA, pools)
	// Adapters are the LoRA adapters the pod registered with the metadata
	// center: the selector LoRALabel=<name> matches a pod that has <name>
	// here as well as one labelled so.
	Adapters []string
}

// LoRALabel is the label a request's "lora" field selects on.
const LoRALabel = "lora"

// Matches reports whether the endpoint carries every label of sel.
func (e Endpoint) Matches(sel map[string]string) bool {
	for k, v := range sel {
		if got, ok := e.Labels[k]; ok && got == v {
			continue
		}
		if k == LoRALabel && slices.Contains(e.Adapters, v) {
			continue
		}
		return false
	}
	return true
}

// Serves an adapter: labelled lora=<name> or registered with adapters.
func (e Endpoint) AdapterPod() bool {
	return e.Labels[LoRALabel] != "" || len(e.Adapters) > 0
}

// Source answers the healthy endpoints of an Envoy cluster name such as
// "outbound|8000||qwen.llm.svc.cluster.local". An unknown cluster has none.
// Implementations are safe for concurrent use and must not block on I/O:
// polling happens in the background.
type Source interface {
	Endpoints(cluster string) []Endpoint
}

// Appender is a Source that copies a cluster's endpoints into a slice the
// caller reuses: a copy of a 256-pod list per request was most of the
// gateway's allocation per decision, and with it of its garbage collections.
type Appender interface {
	AppendEndpoints(dst []Endpoint, cluster string) []Endpoint
}

// Append appends src's endpoints of cluster to dst.
func Append(dst []Endpoint, src Source, cluster string) []Endpoint {
	if a, ok := src.(Appender); ok {
		return a.AppendEndpoints(dst, cluster)
	}
	return append(dst, src.Endpoints(cluster)...)
}
