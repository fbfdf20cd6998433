package memstore

import (
	"context"
	"slices"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// CacheIndex implements store.Index.
func (s *Store) CacheIndex(_ context.Context, clusterName string) (map[string][]prefix.Hash, error) {
	now := s.nanos()
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := map[string][]prefix.Hash{}
	c := s.clusters[clusterName]
	if c == nil {
		return out, nil
	}
	for _, h := range c.hosts {
		if h == nil {
			continue
		}
		var hs []prefix.Hash
		for hash, e := range h.entries {
			if e.expires > now {
				hs = append(hs, hash)
			}
		}
		if len(hs) > 0 {
			slices.Sort(hs)
			out[h.name] = hs
		}
	}
	return out, nil
}
