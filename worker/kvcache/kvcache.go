// Package kvcache keeps the books of what lives in the llama.cpp KV cache.
//
// Every sequence with cells in the KV cache is an Entry: a running request's
// sequence (InUse, never evicted) or the cells a finished request left behind
// under its seq id, kept so that a later request sharing a token prefix skips
// that part of prefill (multi-turn reuse; llama-server keeps idle slots the same way).
// The manager finds the entry with the longest common token prefix, picks
// idle entries to evict by last use, redundant copies of a shared prefix
// first (LRU, by items or bytes past threshold x limit), and keeps
// per-hash reference counts of the prompt hashes each entry was routed under,
// so that evicting an entry reports to the metadata center only the hashes no
// remaining entry still holds.
//
// Counting is logical: an entry of n tokens counts n items even when part of
// its cells are shared with another entry through KvCacheSeqCp, so Items and
// Bytes are an upper bound of the physical use. The engine's own KV-full
// signal covers the physical limit.
//
// The Manager is the books only. Owner (owner.go) is the one type that
// changes them, together with the seq-id pool and the engine's cells, one
// whole transition at a time; the scheduler talks to the Owner and reads
// the Manager. Both are owned by one goroutine (the scheduler loop) and are
// not safe for concurrent use.
package kvcache

import (
	"errors"
	"fmt"
	"slices"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// Entry is one sequence's cells: Tokens[i] sits at position i of seq Seq.
type Entry struct {
	ID     string
	Seq    int
	Tokens []int
	Hashes []prefix.Hash // prompt prefix hashes the router knows this entry by
	InUse  bool          // held by a PROCESSING request: never evicted

	planned []int  // a running request's whole prompt: what it will write
	leader  string // the running entry this one waits for (Owner.Follow)
	shareTo int    // how many of the leader's cells it will share

	lastUse uint64
}

// Limits bound the cache. Zero limits are unlimited.
type Limits struct {
	MaxItems      int64   // total tokens over all entries (seed: maxKVCachesItems)
	MaxBytes      int64   // kvCacheMaxMemoryMb in bytes
	BytesPerToken int64   // KV bytes one token's cells take (K and V, all layers)
	Threshold     float64 // evict once usage passes Threshold x limit (seed: 0.8)
}

// Validate reports nonsensical limits.
func (l Limits) Validate() error {
	switch {
	case l.MaxItems < 0 || l.MaxBytes < 0 || l.BytesPerToken < 0:
		return errors.New("kvcache: limits must not be negative")
	case l.Threshold <= 0 || l.Threshold > 1:
		return fmt.Errorf("kvcache: eviction threshold must be within (0, 1], got %g", l.Threshold)
	}
	return nil
}

// Manager is the book of entries.
type Manager struct {
	lim     Limits
	entries map[string]*Entry
	refs    map[prefix.Hash]int
	items   int64
	clock   uint64
}

// New returns an empty manager.
func New(lim Limits) (*Manager, error) {
	if err := lim.Validate(); err != nil {
		return nil, err
	}
	return &Manager{lim: lim, entries: map[string]*Entry{}, refs: map[prefix.Hash]int{}}, nil
}

// Limits returns the configured limits.
func (m *Manager) Limits() Limits { return m.lim }

// Add records a new entry and takes references on its hashes. The manager
// keeps e; callers change it only through the manager.
func (m *Manager) Add(e *Entry) error {
	if e.ID == "" {
		return errors.New("kvcache: entry without id")
	}
	if _, ok := m.entries[e.ID]; ok {
		return fmt.Errorf("kvcache: entry %q exists", e.ID)
	}
	m.entries[e.ID] = e
	m.items += int64(len(e.Tokens))
	for _, h := range e.Hashes {
		m.refs[h]++
	}
	m.touch(e)
	return nil
}

// Get returns the entry called id.
func (m *Manager) Get(id string) (*Entry, bool) {
	e, ok := m.entries[id]
	return e, ok
}

// Remove drops id and returns the hashes that no entry holds any more: the
// ones to report as evicted.
func (m *Manager) Remove(id string) (*Entry, []prefix.Hash) {
	e, ok := m.entries[id]
	if !ok {
		return nil, nil
	}
	delete(m.entries, id)
	m.items -= int64(len(e.Tokens))
	return e, m.unref(e.Hashes)
}

func (m *Manager) unref(hs []prefix.Hash) []prefix.Hash {
	var gone []prefix.Hash
	for _, h := range hs {
		switch n := m.refs[h]; {
		case n <= 1:
			if n == 1 {
				gone = append(gone, h)
			}
			delete(m.refs, h)
		default:
			m.refs[h] = n - 1
		}
	}
	return gone
}

// SetHashes replaces id's hashes, returning those no entry holds any more.
// New references are taken before old ones are dropped, so a hash held by
// both never looks unheld.
func (m *Manager) SetHashes(id string, hs []prefix.Hash) []prefix.Hash {
	e, ok := m.entries[id]
	if !ok {
		return nil
	}
	for _, h := range hs {
		m.refs[h]++
	}
	old := e.Hashes
	e.Hashes = hs
	return m.unref(old)
}

// Append records tokens whose cells were just written after id's last one.
func (m *Manager) Append(id string, toks ...int) {
	if e, ok := m.entries[id]; ok {
		e.Tokens = append(e.Tokens, toks...)
		m.items += int64(len(toks))
	}
}

// Truncate keeps id's first n tokens (its cells from n on were removed).
func (m *Manager) Truncate(id string, n int) {
	if e, ok := m.entries[id]; ok && n < len(e.Tokens) {
		if n < 0 {
			n = 0
		}
		m.items -= int64(len(e.Tokens) - n)
		e.Tokens = e.Tokens[:n:n]
	}
}

// SetInUse marks id as held (or not) by a running request and counts as a use.
func (m *Manager) SetInUse(id string, inUse bool) {
	if e, ok := m.entries[id]; ok {
		e.InUse = inUse
		m.touch(e)
	}
}

// Touch counts a use of id for LRU order.
func (m *Manager) Touch(id string) {
	if e, ok := m.entries[id]; ok {
		m.touch(e)
	}
}

func (m *Manager) touch(e *Entry) {
	m.clock++
	e.lastUse = m.clock
}

// Match returns the entry sharing the longest common token prefix with toks
// and that length. Running entries count too: the cells they already wrote
// never change, so a burst of requests with one system prompt shares the
// first one's prefill. Ties go to idle entries, then to the most recently
// used.
func (m *Manager) Match(toks []int) (*Entry, int) {
	var best *Entry
	bestN := 0
	for _, e := range m.entries {
		n := commonPrefix(e.Tokens, toks)
		if n == 0 || n < bestN {
			continue
		}
		if n > bestN || better(e, best) {
			best, bestN = e, n
		}
	}
	return best, bestN
}

func better(e, than *Entry) bool {
	if e.InUse != than.InUse {
		return !e.InUse
	}
	return e.lastUse > than.lastUse
}

func commonPrefix(a, b []int) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// Victim returns the idle entry to evict next, other than the excluded ids,
// or nil if there is none: the least recently used among the redundant
// entries if any, else the least recently used of all. An entry is redundant
// when another entry holds at least three quarters of its tokens as a common
// prefix: evicting it frees a seq id while the shared part (a document, a
// user's history) stays cached. Plain LRU would drop the last holder of a
// prefix as readily as one of its twenty copies: many questions about one
// document leave many entries that differ only in their last few tokens.
func (m *Manager) Victim(exclude ...string) *Entry {
	held := m.heldElsewhere()
	var lru, redundant *Entry
	for _, e := range m.entries {
		if e.InUse || contains(exclude, e.ID) {
			continue
		}
		if lru == nil || e.lastUse < lru.lastUse {
			lru = e
		}
		if 4*held[e] >= 3*len(e.Tokens) && (redundant == nil || e.lastUse < redundant.lastUse) {
			redundant = e
		}
	}
	if redundant != nil {
		return redundant
	}
	return lru
}

// heldElsewhere gives, for every entry, the longest prefix of its tokens
// that some other entry also holds. In lexicographic order an entry's
// longest common prefix with any other is the one with a neighbour, so this
// is a sort and one pass rather than all pairs.
func (m *Manager) heldElsewhere() map[*Entry]int {
	all := m.Entries()
	slices.SortFunc(all, func(a, b *Entry) int { return slices.Compare(a.Tokens, b.Tokens) })
	held := make(map[*Entry]int, len(all))
	for i := 1; i < len(all); i++ {
		n := commonPrefix(all[i-1].Tokens, all[i].Tokens)
		held[all[i-1]] = max(held[all[i-1]], n)
		held[all[i]] = max(held[all[i]], n)
	}
	return held
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

// Items is the total token count over all entries.
func (m *Manager) Items() int64 { return m.items }

// Bytes is Items in KV bytes.
func (m *Manager) Bytes() int64 { return m.items * m.lim.BytesPerToken }

// Len counts entries; Idle counts those not in use.
func (m *Manager) Len() int { return len(m.entries) }

// Idle counts entries no running request holds.
func (m *Manager) Idle() int {
	n := 0
	for _, e := range m.entries {
		if !e.InUse {
			n++
		}
	}
	return n
}

// OverThreshold reports whether items or bytes passed threshold x limit.
func (m *Manager) OverThreshold() bool {
	if m.lim.MaxItems > 0 && float64(m.items) > m.lim.Threshold*float64(m.lim.MaxItems) {
		return true
	}
	if m.lim.MaxBytes > 0 && float64(m.Bytes()) > m.lim.Threshold*float64(m.lim.MaxBytes) {
		return true
	}
	return false
}

// Eviction is one removed entry and the hashes that went with it.
type Eviction struct {
	Entry *Entry
	Freed []prefix.Hash
}

// EvictOverThreshold removes idle entries in Victim order until
// usage is back under the threshold or nothing idle is left. Running entries
// are never touched, so usage may stay above the threshold.
func (m *Manager) EvictOverThreshold() []Eviction {
	var out []Eviction
	for m.OverThreshold() {
		v := m.Victim()
		if v == nil {
			break
		}
		e, freed := m.Remove(v.ID)
		out = append(out, Eviction{Entry: e, Freed: freed})
	}
	return out
}

// Entries returns every entry, for inspection and tests.
func (m *Manager) Entries() []*Entry {
	out := make([]*Entry, 0, len(m.entries))
	for _, e := range m.entries {
		out = append(out, e)
	}
	return out
}

// Refs returns how many entries hold hash h.
func (m *Manager) Refs(h prefix.Hash) int { return m.refs[h] }
