package endpoints

import (
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sort"
)

// Static is a fixed cluster -> endpoints table: the standalone gateway, tests,
// and pools pinned in the config. It is immutable after NewStatic, so it needs
// no lock.
type Static struct {
	clusters map[string][]Endpoint
}

// NewStatic validates every address (it must be a literal "ip:port", because
// Envoy's SetUpstreamOverrideHost refuses anything else) and drops duplicates
// while keeping the configured order.
func NewStatic(lists map[string][]string) (*Static, error) {
	return NewStaticLabelled(lists, nil)
}

// NewStaticLabelled is NewStatic with labels per endpoint: cluster ->
// address -> labels (addresses as in lists).
func NewStaticLabelled(lists map[string][]string, labels map[string]map[string]map[string]string) (*Static, error) {
	s := &Static{clusters: make(map[string][]Endpoint, len(lists))}
	names := make([]string, 0, len(lists))
	for name := range lists {
		names = append(names, name)
	}
	sort.Strings(names) // deterministic first error
	for _, name := range names {
		if name == "" {
			return nil, fmt.Errorf("endpoints: static: empty cluster name")
		}
		seen := map[string]bool{}
		var eps []Endpoint
		for _, addr := range lists[name] {
			norm, err := NormalizeAddress(addr)
			if err != nil {
				return nil, fmt.Errorf("endpoints: static cluster %q: %w", name, err)
			}
			if seen[norm] {
				continue
			}
			seen[norm] = true
			l := labels[name][addr]
			if l == nil {
				l = labels[name][norm]
			}
			eps = append(eps, Endpoint{Address: norm, Labels: l})
		}
		s.clusters[name] = eps
	}
	return s, nil
}

// Endpoints returns a copy, so callers may reorder it freely.
func (s *Static) Endpoints(cluster string) []Endpoint {
	if s == nil {
		return nil
	}
	return slices.Clone(s.clusters[cluster])
}

// AppendEndpoints implements Appender.
func (s *Static) AppendEndpoints(dst []Endpoint, cluster string) []Endpoint {
	if s == nil {
		return dst
	}
	return append(dst, s.clusters[cluster]...)
}

// Has reports whether the cluster is listed at all (even with no endpoints).
func (s *Static) Has(cluster string) bool {
	if s == nil {
		return false
	}
	_, ok := s.clusters[cluster]
	return ok
}

// NormalizeAddress checks that addr is a literal IP with a port and returns
// its canonical "ip:port" form ("[v6]:port" for IPv6).
func NormalizeAddress(addr string) (string, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return "", fmt.Errorf("address %q is not a literal ip:port: %w", addr, err)
	}
	if ap.Port() == 0 {
		return "", fmt.Errorf("address %q has port 0", addr)
	}
	return net.JoinHostPort(ap.Addr().Unmap().String(), fmt.Sprint(ap.Port())), nil
}

// Layered answers from Pinned for the clusters it lists and from Dynamic for
// every other cluster: a pinned list is an explicit operator decision and
// wins over discovery.
type Layered struct {
	Pinned  *Static
	Dynamic Source
}

func (l Layered) Endpoints(cluster string) []Endpoint {
	if l.Pinned.Has(cluster) {
		return l.Pinned.Endpoints(cluster)
	}
	if l.Dynamic == nil {
		return nil
	}
	return l.Dynamic.Endpoints(cluster)
}
