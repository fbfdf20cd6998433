// Package store defines what the metadata center keeps: per-request load
// leases and the prefix-cache index, behind one small interface with an
// in-memory implementation (memstore, the embedded default) and a Redis one
// (redisstore, for replicated deployments).
//
// The HTTP layer validates and canonicalises every input before it reaches a
// Store, so implementations may assume a non-empty cluster, an ip:port host
// and a non-empty request id.
package store

import (
	"context"
	"errors"
	"slices"
	"strings"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// ErrUnavailable marks failures of the backing store itself (Redis down,
// timed out, read-only): the caller answers 503 and may retry later.
// Implementations wrap it, so test with errors.Is.
var ErrUnavailable = errors.New("store unavailable")

// Defaults shared by both implementations (DESIGN §6, issue 2).
const (
	DefaultLeaseTTL = 10 * time.Minute
	DefaultCacheTTL = 30 * time.Minute
)

// Stats are the gauges /metrics exports.
type Stats struct {
	LiveLeases   int64 // request leases that have not expired or been deleted
	IndexEntries int64 // (cluster, host, hash) cache entries that have not expired
}

// Store keeps load leases and the cache index. Every method is safe for
// concurrent use. Errors from the backing store wrap ErrUnavailable.
type Store interface {
	// AddLease records a request in flight on host. Adding an existing
	// lease again replaces its prompt length and restarts its TTL; it is
	// not counted twice.
	AddLease(ctx context.Context, cluster, host, requestID string, promptLength int64) error
	// FirstToken stops counting the lease's prompt length (prefill done).
	// Unknown leases are ignored.
	FirstToken(ctx context.Context, cluster, host, requestID string) error
	// DeleteLease ends a lease. Unknown leases are ignored, so retries and
	// late deletes after expiry never push counts below zero.
	DeleteLease(ctx context.Context, cluster, host, requestID string) error
	// LoadStats returns every host of the cluster with at least one live lease.
	LoadStats(ctx context.Context, cluster string) (api.LoadStats, error)

	// SaveCache records that host holds each of the prefixes and (re)starts
	// their TTL.
	SaveCache(ctx context.Context, cluster, host string, hashes []prefix.Hash) error
	// QueryCache answers, per host, how many leading hashes it holds
	// contiguously from index 0; hosts with none are left out. Sorted by
	// length descending, then host. Matched entries get their TTL refreshed.
	QueryCache(ctx context.Context, cluster string, hashes []prefix.Hash) ([]api.CacheLocation, error)
	// EvictCache forgets the listed prefixes of host.
	EvictCache(ctx context.Context, cluster, host string, hashes []prefix.Hash) error
	// EvictHost forgets every prefix of host in the cluster (pod restart).
	EvictHost(ctx context.Context, cluster, host string) error

	// Route answers LoadStats and QueryCache together, in one round trip
	// to the backing store.
	Route(ctx context.Context, cluster string, hashes []prefix.Hash) (api.RouteAnswer, error)

	// Stats reports the gauges for /metrics.
	Stats(ctx context.Context) (Stats, error)
	// Ping reports whether the backing store is reachable (/readyz).
	Ping(ctx context.Context) error
	// Close releases connections; the Store is unusable afterwards.
	Close() error
}

// SortLocations puts the longest matches first and breaks ties by host, so
// both implementations answer byte-for-byte the same.
func SortLocations(locs []api.CacheLocation) {
	slices.SortFunc(locs, func(a, b api.CacheLocation) int {
		if a.Length != b.Length {
			return b.Length - a.Length
		}
		return strings.Compare(a.Host, b.Host)
	})
}
