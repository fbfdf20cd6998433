// Package store defines what the metadata center keeps: per-request load
// leases, the prefix-cache index, the pods' signals and registrations, each
// behind a small interface (Leases, Index, Signals, Registry), with an
// in-memory implementation (memstore, the embedded default) and a Redis one
// (redisstore, for replicated deployments).
//
// Beside them, Router answers all four at once for a routing decision,
// Batcher applies a batch of updates and Health serves /metrics and
// /readyz. Each implementation is one value that fills every field of
// Parts; a consumer takes only the interface it uses. Every method is safe
// for concurrent use; errors from the backing store wrap ErrUnavailable.
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
	"sync"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// ErrUnavailable marks failures of the backing store itself (Redis down,
// timed out, read-only): the caller answers 503 and may retry later.
// Implementations wrap it, so test with errors.Is.
var ErrUnavailable = errors.New("store unavailable")

// Defaults shared by both implementations (docs/architecture.md).
const (
	DefaultLeaseTTL = 10 * time.Minute
	DefaultCacheTTL = 30 * time.Minute
	// DefaultSignalMaxAge is how old a pod's report may be and still be
	// answered: ten of our workers' 100 ms pushes, four default scrapes.
	DefaultSignalMaxAge = time.Second
	// EvictionMemory is how long a store remembers an eviction (and a
	// host's evict-all) to refuse a save dated before it that arrives
	// after it: the gateways send their routing-time saves asynchronously,
	// batched, and under load a batch can land a second late. A save dated
	// further back than this is checked against nothing.
	EvictionMemory = 30 * time.Second
)

// Stats are the gauges /metrics exports.
type Stats struct {
	LiveLeases   int64 // request leases that have not expired or been deleted
	IndexEntries int64 // (cluster, host, hash) cache entries that have not expired
}

// Leases keeps the requests in flight on each host.
type Leases interface {
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
}

// Index keeps which host holds which prefix (the prefix-cache index).
//
// Versions (docs/metadata-center.md, "Versions"): every (host, prefix)
// entry remembers when it was last saved and the save id that save
// carried (empty when none), so that a late eviction or a withdrawn save
// removes only what it is about; and the store remembers each eviction for
// EvictionMemory, so that a late save does not undo it.
type Index interface {
	// SaveCacheAs records that host holds each of the prefixes and
	// (re)starts their TTL, naming the save (saveID, may be empty) and
	// dating it: at is when the save was made (Unix milliseconds; <= 0 or
	// later than the store's clock: now). A prefix whose eviction from
	// host (or host's evict-all) the store applied with a time at or after
	// at is skipped: the pod dropped it after this save was made.
	//
	// maxEntries > 0 bounds what host holds, as a pod's KV cache bounds
	// what it keeps (vLLM and SGLang evict least recently used blocks and
	// tell nobody): past it, host's least recently saved or refreshed
	// entries are forgotten, and of entries saved together the later ones
	// of the prompt first, as vLLM frees a request's blocks tail first.
	// 0: no bound (a pod that reports its evictions).
	SaveCacheAs(ctx context.Context, cluster, host string, hashes []prefix.Hash, saveID string, at int64, maxEntries int) error
	// RefreshCache confirms an earlier save: of the listed prefixes, those
	// host still holds get their TTL restarted and saveID as their save
	// id; the others are skipped, never inserted. Their save time stays:
	// like a query hit, a refresh is no save, so an eviction the pod made
	// after the save removes the entry whichever of the refresh and the
	// eviction report arrives first.
	RefreshCache(ctx context.Context, cluster, host string, hashes []prefix.Hash, saveID string) error
	// RetractCache withdraws a save: it forgets those of the listed
	// prefixes of host whose last save is the one named saveID (not
	// empty). An entry saved again since, by anyone, stays.
	RetractCache(ctx context.Context, cluster, host string, hashes []prefix.Hash, saveID string) error
	// EvictCacheBefore forgets those of the listed prefixes of host that
	// were last saved at or before before (Unix milliseconds, the
	// evicting pod's clock): an entry saved after the eviction happened
	// stays. before <= 0 forgets them all. With before > 0 the eviction is
	// remembered (SaveCacheAs).
	EvictCacheBefore(ctx context.Context, cluster, host string, hashes []prefix.Hash, before int64) error
	// EvictHostBefore forgets every prefix of host last saved at or
	// before before (a pod's start epoch), and remembers it
	// (SaveCacheAs); before <= 0 forgets every prefix of host (pod
	// restart) and remembers nothing.
	EvictHostBefore(ctx context.Context, cluster, host string, before int64) error
	// QueryCache answers, per host, how many leading hashes it holds
	// contiguously from index 0; hosts with none are left out. Sorted by
	// length descending, then host. Matched entries get their TTL refreshed.
	QueryCache(ctx context.Context, cluster string, hashes []prefix.Hash) ([]api.CacheLocation, error)
	// CacheIndex returns, per host of the cluster, every prefix it is
	// recorded to hold that a query would answer now (live entries only),
	// each host's hashes sorted. Hosts holding nothing are left out. It
	// serves debugging and checking the index against what the workers
	// really hold (the chaos run, docs/operations.md), never routing.
	CacheIndex(ctx context.Context, cluster string) (map[string][]prefix.Hash, error)
}

// Signals keeps the pods' reports about themselves.
type Signals interface {
	// ReportSignals records a pod's report about itself, stamped with the
	// store's clock (the pod's clock is not trusted). It replaces the
	// host's previous report.
	ReportSignals(ctx context.Context, cluster, host string, sig api.PodSignals) error
	// Signals returns the cluster's reports younger than the signal max
	// age, with AgeMS set; older ones are left out, never answered.
	Signals(ctx context.Context, cluster string) (map[string]api.PodSignals, error)
}

// Router answers a routing decision's question in one round trip to the
// backing store.
type Router interface {
	// Route answers LoadStats, QueryCache, Signals and the registered
	// pods' labels together. Signals (Pods) is nil when no report is
	// fresh (no pod registered).
	Route(ctx context.Context, cluster string, hashes []prefix.Hash) (api.RouteAnswer, error)
}

// Health is what /metrics and /readyz read of the backing store.
type Health interface {
	// Stats reports the gauges for /metrics.
	Stats(ctx context.Context) (Stats, error)
	// Ping reports whether the backing store is reachable (/readyz).
	Ping(ctx context.Context) error
}

// Parts are one store's interfaces, each a seam of its own: the HTTP
// server hands each handler the part it uses, and a test may wrap one part
// (count the leases, say) and keep the others.
type Parts struct {
	Leases   Leases
	Index    Index
	Signals  Signals
	Registry Registry
	Router   Router
	// Batch applies /batch: in one round trip (Redis: one pipeline), or
	// one call per op on Leases and Index (Sequential) when a store has
	// no round trips to save. A test that wraps Leases or Index sets
	// Batch to Sequential over its wrappers so batches pass through them.
	Batch  Batcher
	Health Health
}

// Store is what the metadata center runs on: one backing store, its parts,
// and closing it.
type Store interface {
	// Parts returns the store's interfaces, every field set.
	Parts() Parts
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

// SignalsBook keeps the pods' reports for stores that hold them in
// process: per cluster, host -> report and when it arrived. It is bounded
// by api.MaxPodSignals per cluster (stale reports go first, then the
// oldest). Safe for concurrent use.
type SignalsBook struct {
	maxAge int64 // nanoseconds
	mu     sync.RWMutex
	m      map[string]map[string]stamped
}

type stamped struct {
	sig api.PodSignals
	at  int64 // unix nanoseconds
}

// NewSignalsBook returns an empty book; maxAge <= 0 means
// DefaultSignalMaxAge.
func NewSignalsBook(maxAge time.Duration) *SignalsBook {
	if maxAge <= 0 {
		maxAge = DefaultSignalMaxAge
	}
	return &SignalsBook{maxAge: int64(maxAge), m: map[string]map[string]stamped{}}
}

// Report records sig for host at now (unix nanoseconds).
func (b *SignalsBook) Report(cluster, host string, sig api.PodSignals, now int64) {
	sig.AgeMS = 0
	b.mu.Lock()
	defer b.mu.Unlock()
	hosts := b.m[cluster]
	if hosts == nil {
		hosts = map[string]stamped{}
		b.m[cluster] = hosts
	}
	if _, ok := hosts[host]; !ok && len(hosts) >= api.MaxPodSignals {
		oldest, at := "", now
		for h, st := range hosts {
			if now-st.at > b.maxAge {
				delete(hosts, h)
			} else if st.at < at {
				oldest, at = h, st.at
			}
		}
		if len(hosts) >= api.MaxPodSignals {
			delete(hosts, oldest)
		}
	}
	hosts[host] = stamped{sig: sig, at: now}
}

// Fresh returns the cluster's reports no older than the max age at now,
// AgeMS set; nil when there are none.
func (b *SignalsBook) Fresh(cluster string, now int64) map[string]api.PodSignals {
	b.mu.RLock()
	defer b.mu.RUnlock()
	var out map[string]api.PodSignals
	for h, st := range b.m[cluster] {
		age := now - st.at
		if age > b.maxAge {
			continue
		}
		if out == nil {
			out = make(map[string]api.PodSignals, len(b.m[cluster]))
		}
		sig := st.sig
		sig.AgeMS = max(0, age) / int64(time.Millisecond)
		out[h] = sig
	}
	return out
}

// Forget drops a host's report (pod restart or removal).
func (b *SignalsBook) Forget(cluster, host string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.m[cluster], host)
	if len(b.m[cluster]) == 0 {
		delete(b.m, cluster)
	}
}
