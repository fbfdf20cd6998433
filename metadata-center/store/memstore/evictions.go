package memstore

import "github.com/istio-llm-filter/istio-llm-filter/prefix"

// evictions remembers, for store.EvictionMemory, when each (cluster, host,
// prefix) was last evicted and when each host last evicted everything, so
// that a save dated before an eviction it arrives after is refused
// (docs/metadata-center.md, "Versions"). Records are kept in the order
// they were made, on the store's clock, and dropped from the front.
type evictions struct {
	at    map[evictedKey]evictedAt
	order []evictedRec
	head  int
}

// evictedKey names one prefix of one host, or with all the whole host.
type evictedKey struct {
	cluster, host string
	hash          prefix.Hash
	all           bool
}

type evictedAt struct {
	ms       int64 // the eviction's time (Unix ms, the pod's clock)
	recorded int64 // when it was recorded (store clock, ns)
}

type evictedRec struct {
	key      evictedKey
	recorded int64
}

func (ev *evictions) record(k evictedKey, ms, now int64) {
	if ev.at == nil {
		ev.at = make(map[evictedKey]evictedAt)
	}
	if old, ok := ev.at[k]; ok && old.ms > ms {
		ms = old.ms // a report of an older eviction, late
	}
	ev.at[k] = evictedAt{ms: ms, recorded: now}
	ev.order = append(ev.order, evictedRec{key: k, recorded: now})
}

// since returns the latest eviction time remembered for the prefix of the
// host, or for the whole host (0: none). The caller prunes first.
func (ev *evictions) since(cluster, host string, hash prefix.Hash) int64 {
	if len(ev.at) == 0 {
		return 0
	}
	return max(ev.at[evictedKey{cluster: cluster, host: host, hash: hash}].ms,
		ev.at[evictedKey{cluster: cluster, host: host, all: true}].ms)
}

// prune forgets what was recorded before cutoff (store clock, ns).
func (ev *evictions) prune(cutoff int64) {
	for ev.head < len(ev.order) && ev.order[ev.head].recorded < cutoff {
		r := ev.order[ev.head]
		if cur, ok := ev.at[r.key]; ok && cur.recorded == r.recorded {
			delete(ev.at, r.key)
		}
		ev.order[ev.head] = evictedRec{}
		ev.head++
	}
	if ev.head > len(ev.order)/2 {
		ev.order = append(ev.order[:0], ev.order[ev.head:]...)
		ev.head = 0
	}
}
