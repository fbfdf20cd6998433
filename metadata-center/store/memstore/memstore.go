// Package memstore is the embedded, in-process store.Store: the default when
// one metadata-center replica is enough, and the reference the Redis store
// is tested against.
//
// Leases sit in one list ordered by expiry and cache entries in one LRU list,
// so expiry and the LRU cap cost O(1) per removed item and never need a
// background goroutine. Queries take a read lock; refreshing the TTL of the
// entries a query hit is coalesced to once per TouchInterval per entry, so a
// hot prefix does not turn every read into a write.
package memstore

import (
	"container/list"
	"context"
	"slices"
	"sync"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// DefaultMaxEntries bounds the index when Options.MaxEntries is 0. An entry
// costs about 315 bytes (BenchmarkEntryBytes), so the default keeps the index
// near 315 MiB.
const DefaultMaxEntries = 1 << 20

// DefaultTouchInterval is how stale an entry's TTL refresh may be before a
// hit refreshes it again.
const DefaultTouchInterval = time.Second

// Options configure a Store. Zero values pick the defaults.
type Options struct {
	LeaseTTL      time.Duration    // default store.DefaultLeaseTTL
	CacheTTL      time.Duration    // default store.DefaultCacheTTL
	MaxEntries    int              // LRU cap on (cluster, host, hash) entries; default DefaultMaxEntries
	TouchInterval time.Duration    // default DefaultTouchInterval; negative refreshes on every hit
	SignalMaxAge  time.Duration    // default store.DefaultSignalMaxAge
	Now           func() time.Time // default time.Now; tests inject a fake clock
}

// Store is the in-memory store.Store.
type Store struct {
	leaseTTL, cacheTTL, touch int64 // nanoseconds
	maxEntries                int
	now                       func() time.Time

	mu       sync.RWMutex
	clusters map[string]*cluster
	leases   list.List // *lease, earliest expiry at the front
	lru      list.List // *entry, most recently saved or hit at the front

	evicted evictions // for store.EvictionMemory: late saves stay out

	signals *store.SignalsBook
	pods    *store.RegistryBook
}

// Hosts are interned per cluster as small ids, and each hash keeps its
// holders sorted by id, so a query intersects sorted integer slices
// instead of hashing host strings: the route query is the hot path.
type cluster struct {
	name  string
	ids   map[string]uint32
	hosts []*hostState // by id; nil marks a free id
	free  []uint32
	index map[prefix.Hash]*holders
}

type hostState struct {
	name         string
	id           uint32
	reqs, prompt int64
	leases       map[string]*lease
	entries      map[prefix.Hash]*entry
	lru          list.List // *entry, most recently saved or hit at the front (SaveCacheAs's maxEntries)
}

type holders struct {
	ids  []uint32 // ascending
	ents []*entry // ents[i] belongs to host ids[i]
}

type lease struct {
	c       *cluster
	h       *hostState
	id      string
	prompt  int64 // 0 once the first token was seen
	expires int64
	el      *list.Element
}

type entry struct {
	c       *cluster
	h       *hostState
	hash    prefix.Hash
	expires int64
	touched int64
	saved   int64         // unix nanoseconds of the last save (hits do not count)
	saveID  string        // the last save's id
	el      *list.Element // in Store.lru; nil once removed
	hel     *list.Element // in its host's lru
}

// New returns an empty Store.
func New(o Options) *Store {
	if o.LeaseTTL <= 0 {
		o.LeaseTTL = store.DefaultLeaseTTL
	}
	if o.CacheTTL <= 0 {
		o.CacheTTL = store.DefaultCacheTTL
	}
	if o.MaxEntries <= 0 {
		o.MaxEntries = DefaultMaxEntries
	}
	if o.TouchInterval == 0 {
		o.TouchInterval = DefaultTouchInterval
	}
	if o.TouchInterval < 0 {
		o.TouchInterval = 0
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Store{
		leaseTTL:   int64(o.LeaseTTL),
		cacheTTL:   int64(o.CacheTTL),
		touch:      int64(o.TouchInterval),
		maxEntries: o.MaxEntries,
		now:        o.Now,
		clusters:   make(map[string]*cluster),
		signals:    store.NewSignalsBook(o.SignalMaxAge),
		pods:       store.NewRegistryBook(),
	}
}

var _ store.Store = (*Store)(nil)

// Parts implements store.Store: the store fills every part itself.
func (s *Store) Parts() store.Parts {
	return store.Parts{Leases: s, Index: s, Signals: s, Registry: s, Router: s, Batch: store.Sequential{Leases: s, Index: s}, Health: s}
}

func (s *Store) nanos() int64 { return s.now().UnixNano() }

func (s *Store) cluster(name string) *cluster {
	c := s.clusters[name]
	if c == nil {
		c = &cluster{name: name, ids: make(map[string]uint32), index: make(map[prefix.Hash]*holders)}
		s.clusters[name] = c
	}
	return c
}

func (c *cluster) host(name string) *hostState {
	if id, ok := c.ids[name]; ok {
		return c.hosts[id]
	}
	h := &hostState{name: name, leases: make(map[string]*lease), entries: make(map[prefix.Hash]*entry)}
	if n := len(c.free); n > 0 {
		h.id = c.free[n-1]
		c.free = c.free[:n-1]
		c.hosts[h.id] = h
	} else {
		h.id = uint32(len(c.hosts))
		c.hosts = append(c.hosts, h)
	}
	c.ids[name] = h.id
	return h
}

func (c *cluster) lookup(name string) *hostState {
	if id, ok := c.ids[name]; ok {
		return c.hosts[id]
	}
	return nil
}

// release frees a host that holds nothing any more, and its cluster once
// empty, so pods and clusters that come and go do not accumulate.
func (s *Store) release(c *cluster, h *hostState) {
	if len(h.leases) > 0 || len(h.entries) > 0 {
		return
	}
	delete(c.ids, h.name)
	c.hosts[h.id] = nil
	c.free = append(c.free, h.id)
	if len(c.ids) == 0 {
		delete(s.clusters, c.name)
	}
}

// AddLease implements store.Leases.
func (s *Store) AddLease(_ context.Context, clusterName, host, id string, prompt int64) error {
	now := s.nanos()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sweepLeases(now)
	c := s.cluster(clusterName)
	h := c.host(host)
	if l := h.leases[id]; l != nil {
		h.prompt += prompt - l.prompt
		l.prompt = prompt
		l.expires = now + s.leaseTTL
		s.leases.MoveToBack(l.el)
		return nil
	}
	l := &lease{c: c, h: h, id: id, prompt: prompt, expires: now + s.leaseTTL}
	l.el = s.leases.PushBack(l)
	h.leases[id] = l
	h.reqs++
	h.prompt += prompt
	return nil
}

// findHost returns a host of a cluster, nil if either is unknown.
func (s *Store) findHost(clusterName, host string) *hostState {
	if c := s.clusters[clusterName]; c != nil {
		return c.lookup(host)
	}
	return nil
}

func (s *Store) findLease(clusterName, host, id string) *lease {
	if h := s.findHost(clusterName, host); h != nil {
		return h.leases[id]
	}
	return nil
}

// FirstToken implements store.Leases.
func (s *Store) FirstToken(_ context.Context, clusterName, host, id string) error {
	now := s.nanos()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sweepLeases(now)
	if l := s.findLease(clusterName, host, id); l != nil {
		l.h.prompt -= l.prompt
		l.prompt = 0
	}
	return nil
}

// DeleteLease implements store.Leases.
func (s *Store) DeleteLease(_ context.Context, clusterName, host, id string) error {
	now := s.nanos()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sweepLeases(now)
	if l := s.findLease(clusterName, host, id); l != nil {
		s.removeLease(l)
	}
	return nil
}

func (s *Store) removeLease(l *lease) {
	h := l.h
	h.reqs--
	h.prompt -= l.prompt
	delete(h.leases, l.id)
	s.leases.Remove(l.el)
	s.release(l.c, h)
}

// sweepLeases needs the write lock.
func (s *Store) sweepLeases(now int64) {
	for {
		front := s.leases.Front()
		if front == nil || front.Value.(*lease).expires > now {
			return
		}
		s.removeLease(front.Value.(*lease))
	}
}

func (s *Store) leasesExpired(now int64) bool {
	front := s.leases.Front()
	return front != nil && front.Value.(*lease).expires <= now
}

// rlockSwept returns holding the read lock, with expired leases gone.
func (s *Store) rlockSwept(now int64) {
	s.mu.RLock()
	if !s.leasesExpired(now) {
		return
	}
	s.mu.RUnlock()
	s.mu.Lock()
	s.sweepLeases(now)
	s.mu.Unlock()
	s.mu.RLock()
}

// LoadStats implements store.Leases.
func (s *Store) LoadStats(_ context.Context, clusterName string) (api.LoadStats, error) {
	s.rlockSwept(s.nanos())
	defer s.mu.RUnlock()
	return s.loadLocked(clusterName), nil
}

func (s *Store) loadLocked(clusterName string) api.LoadStats {
	c := s.clusters[clusterName]
	if c == nil {
		return api.LoadStats{}
	}
	out := make(api.LoadStats, len(c.ids))
	for _, h := range c.hosts {
		if h != nil && h.reqs > 0 {
			out[h.name] = api.EndpointStats{TotalReqs: h.reqs, PromptLength: h.prompt}
		}
	}
	return out
}

// RefreshCache implements store.Index.
func (s *Store) RefreshCache(_ context.Context, clusterName, host string, hashes []prefix.Hash, saveID string) error {
	now := s.nanos()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sweepEntries(now)
	h := s.findHost(clusterName, host)
	if h == nil {
		return nil
	}
	for _, hash := range slices.Backward(hashes) { // as SaveCacheAs
		if e := h.entries[hash]; e != nil {
			s.refresh(e, now)
			e.saveID = saveID
		}
	}
	return nil
}

// SaveCacheAs implements store.Index. The hashes are taken last to first,
// so that in the host's LRU order the prompt's first blocks are the most
// recent and its last ones go first (maxEntries).
func (s *Store) SaveCacheAs(_ context.Context, clusterName, host string, hashes []prefix.Hash, saveID string, at int64, maxEntries int) error {
	now := s.nanos()
	saved := now
	if at > 0 && at*int64(time.Millisecond) < now {
		saved = at * int64(time.Millisecond)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sweepEntries(now)
	s.evicted.prune(now - int64(store.EvictionMemory))
	c := s.cluster(clusterName)
	h := c.host(host)
	for _, hash := range slices.Backward(hashes) {
		if s.evicted.since(clusterName, host, hash) >= saved/int64(time.Millisecond) {
			continue // the pod dropped it after this save was made (ties: as savedBy)
		}
		if e := h.entries[hash]; e != nil {
			s.refresh(e, now)
			if saved >= e.saved { // a late save of an earlier decision is not the last save
				e.saved, e.saveID = saved, saveID
			}
			continue
		}
		hl := c.index[hash]
		if hl == nil {
			hl = &holders{}
			c.index[hash] = hl
		}
		e := &entry{c: c, h: h, hash: hash, expires: now + s.cacheTTL, touched: now, saved: saved, saveID: saveID}
		e.el = s.lru.PushFront(e)
		e.hel = h.lru.PushFront(e)
		i, _ := slices.BinarySearch(hl.ids, h.id)
		hl.ids = slices.Insert(hl.ids, i, h.id)
		hl.ents = slices.Insert(hl.ents, i, e)
		h.entries[hash] = e
	}
	for maxEntries > 0 && h.lru.Len() > maxEntries {
		s.removeEntry(h.lru.Back().Value.(*entry))
	}
	for s.lru.Len() > s.maxEntries {
		s.removeEntry(s.lru.Back().Value.(*entry))
	}
	// The cap may have taken every entry of this very save.
	s.release(c, h)
	return nil
}

func (s *Store) refresh(e *entry, now int64) {
	e.touched = now
	e.expires = now + s.cacheTTL
	s.lru.MoveToFront(e.el)
	e.h.lru.MoveToFront(e.hel)
}

func (s *Store) removeEntry(e *entry) {
	c, h := e.c, e.h
	if hl := c.index[e.hash]; hl != nil {
		if i, ok := slices.BinarySearch(hl.ids, h.id); ok {
			hl.ids = slices.Delete(hl.ids, i, i+1)
			hl.ents = slices.Delete(hl.ents, i, i+1)
		}
		if len(hl.ids) == 0 {
			delete(c.index, e.hash)
		}
	}
	delete(h.entries, e.hash)
	s.lru.Remove(e.el)
	h.lru.Remove(e.hel)
	e.el = nil
	s.release(c, h)
}

// sweepEntries relies on the LRU order being the expiry order: every entry
// expires one CacheTTL after it was last moved to the front.
func (s *Store) sweepEntries(now int64) {
	for {
		back := s.lru.Back()
		if back == nil || back.Value.(*entry).expires > now {
			return
		}
		s.removeEntry(back.Value.(*entry))
	}
}

// QueryCache implements store.Index.
func (s *Store) QueryCache(_ context.Context, clusterName string, hashes []prefix.Hash) ([]api.CacheLocation, error) {
	now := s.nanos()
	s.mu.RLock()
	locs, stale := s.queryLocked(clusterName, hashes, now)
	s.mu.RUnlock()
	s.touchEntries(stale, now)
	return locs, nil
}

type hit struct {
	id uint32
	n  int
}

// queryLocked walks the hashes once, narrowing the sorted list of hosts
// that held every hash so far; a host leaves the list at the first hash it
// lacks, and that index is its match length. Cost follows the matches, not
// the index size.
func (s *Store) queryLocked(clusterName string, hashes []prefix.Hash, now int64) (locs []api.CacheLocation, stale []*entry) {
	c := s.clusters[clusterName]
	if c == nil || len(hashes) == 0 {
		return []api.CacheLocation{}, nil
	}
	var cands []uint32
	if hl := c.index[hashes[0]]; hl != nil {
		cands = make([]uint32, 0, len(hl.ids))
		for j, e := range hl.ents {
			if e.expires > now {
				cands = append(cands, hl.ids[j])
				if now-e.touched >= s.touch {
					stale = append(stale, e)
				}
			}
		}
	}
	hits := make([]hit, 0, len(cands))
	for i := 1; i < len(hashes) && len(cands) > 0; i++ {
		var ids []uint32
		var ents []*entry
		if hl := c.index[hashes[i]]; hl != nil {
			ids, ents = hl.ids, hl.ents
		}
		keep := cands[:0]
		jump := len(ids) > 8*len(cands)
		j := 0
		for _, id := range cands {
			if jump {
				// Far more holders than candidates: jump instead of walking.
				k, _ := slices.BinarySearch(ids[j:], id)
				j += k
			}
			for j < len(ids) && ids[j] < id {
				j++
			}
			if j < len(ids) && ids[j] == id && ents[j].expires > now {
				keep = append(keep, id)
				if now-ents[j].touched >= s.touch {
					stale = append(stale, ents[j])
				}
				j++
				continue
			}
			hits = append(hits, hit{id: id, n: i})
		}
		cands = keep
	}
	for _, id := range cands {
		hits = append(hits, hit{id: id, n: len(hashes)})
	}
	locs = make([]api.CacheLocation, len(hits))
	for i, h := range hits {
		locs[i] = api.CacheLocation{Host: c.hosts[h.id].name, Length: h.n}
	}
	store.SortLocations(locs)
	return locs, stale
}

func (s *Store) touchEntries(stale []*entry, now int64) {
	if len(stale) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range slices.Backward(stale) { // a host's first blocks last: the most recent (SaveCacheAs)
		// Removed or already refreshed by someone else meanwhile.
		if e.el != nil && e.expires > now && now-e.touched >= s.touch {
			s.refresh(e, now)
		}
	}
}

// savedBy reports whether e was last saved at or before before (unix
// milliseconds; <= 0: always).
func savedBy(e *entry, before int64) bool {
	return before <= 0 || e.saved/int64(time.Millisecond) <= before
}

// EvictCacheBefore implements store.Index.
func (s *Store) EvictCacheBefore(_ context.Context, clusterName, host string, hashes []prefix.Hash, before int64) error {
	now := s.nanos()
	s.mu.Lock()
	defer s.mu.Unlock()
	if before > 0 {
		s.evicted.prune(now - int64(store.EvictionMemory))
		for _, hash := range hashes {
			s.evicted.record(evictedKey{cluster: clusterName, host: host, hash: hash}, before, now)
		}
	}
	h := s.findHost(clusterName, host)
	if h == nil {
		return nil
	}
	for _, hash := range hashes {
		if e := h.entries[hash]; e != nil && savedBy(e, before) {
			s.removeEntry(e)
		}
	}
	return nil
}

// RetractCache implements store.Index.
func (s *Store) RetractCache(_ context.Context, clusterName, host string, hashes []prefix.Hash, saveID string) error {
	if saveID == "" {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	h := s.findHost(clusterName, host)
	if h == nil {
		return nil
	}
	for _, hash := range hashes {
		if e := h.entries[hash]; e != nil && e.saveID == saveID {
			s.removeEntry(e)
		}
	}
	return nil
}

// EvictHostBefore implements store.Index.
func (s *Store) EvictHostBefore(_ context.Context, clusterName, host string, before int64) error {
	now := s.nanos()
	s.mu.Lock()
	defer s.mu.Unlock()
	if before > 0 {
		s.evicted.prune(now - int64(store.EvictionMemory))
		s.evicted.record(evictedKey{cluster: clusterName, host: host, all: true}, before, now)
	}
	h := s.findHost(clusterName, host)
	if h == nil {
		return nil
	}
	for _, e := range h.entries {
		if savedBy(e, before) {
			s.removeEntry(e)
		}
	}
	return nil
}

// Route implements store.Router.
func (s *Store) Route(_ context.Context, clusterName string, hashes []prefix.Hash) (api.RouteAnswer, error) {
	now := s.nanos()
	s.rlockSwept(now)
	load := s.loadLocked(clusterName)
	locs, stale := s.queryLocked(clusterName, hashes, now)
	s.mu.RUnlock()
	s.touchEntries(stale, now)
	return api.RouteAnswer{Load: load, Cache: locs, Signals: s.signals.Fresh(clusterName, now),
		Pods: s.pods.Labels(clusterName, now)}, nil
}

// Register implements store.Registry.
func (s *Store) Register(_ context.Context, clusterName, host string, reg api.PodRegistration, ttl time.Duration) error {
	s.pods.Register(clusterName, host, reg, ttl, s.nanos())
	return nil
}

// Pods implements store.Registry.
func (s *Store) Pods(_ context.Context, clusterName string) (map[string]api.PodRegistration, error) {
	return s.pods.Live(clusterName, s.nanos()), nil
}

// ReportSignals implements store.Signals.
func (s *Store) ReportSignals(_ context.Context, clusterName, host string, sig api.PodSignals) error {
	s.signals.Report(clusterName, host, sig, s.nanos())
	return nil
}

// Signals implements store.Signals.
func (s *Store) Signals(_ context.Context, clusterName string) (map[string]api.PodSignals, error) {
	return s.signals.Fresh(clusterName, s.nanos()), nil
}

// Stats implements store.Health.
func (s *Store) Stats(context.Context) (store.Stats, error) {
	now := s.nanos()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sweepLeases(now)
	s.sweepEntries(now)
	return store.Stats{LiveLeases: int64(s.leases.Len()), IndexEntries: int64(s.lru.Len())}, nil
}

// Ping implements store.Health: memory is always reachable.
func (s *Store) Ping(context.Context) error { return nil }

// Close implements store.Store.
func (s *Store) Close() error { return nil }
