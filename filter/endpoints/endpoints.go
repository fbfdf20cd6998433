// Package endpoints says which backend pods a cluster has.
//
// The load balancer only needs Source; where the answer comes from (Envoy's
// admin API in the mesh, static lists in the standalone gateway and tests) is
// the business of the implementations in this package.
package endpoints

// Endpoint is one healthy backend pod.
type Endpoint struct {
	Address string            // always "ip:port"
	Labels  map[string]string // from endpoint metadata; used by label selectors (LoRA, pools)
}

// Source answers the healthy endpoints of an Envoy cluster name such as
// "outbound|8000||qwen.llm.svc.cluster.local". An unknown cluster has none.
// Implementations are safe for concurrent use and must not block on I/O:
// polling happens in the background.
type Source interface {
	Endpoints(cluster string) []Endpoint
}
