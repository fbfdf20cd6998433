package store

import (
	"context"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// IndexLister is an optional, read-only view of the cache index that
// stores may offer for debugging and for checking the index against what
// the workers really hold (the chaos run, docs/operations.md). It is kept
// out of Store so that the hot-path contract stays small.
type IndexLister interface {
	// CacheIndex returns, per host of the cluster, every prefix it is
	// recorded to hold that a query would answer now (live entries only),
	// each host's hashes sorted. Hosts holding nothing are left out.
	CacheIndex(ctx context.Context, cluster string) (map[string][]prefix.Hash, error)
}
