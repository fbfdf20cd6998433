package server

import (
	"context"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
	"github.com/istio-llm-filter/istio-llm-filter/worker/scheduler"
)

// PathDebugKVPrefixes answers the prefixes this worker's KV cache holds,
// in the router's wire form, so the router's index can be checked against
// the pod's own view (docs/operations.md, "Chaos and soak").
const PathDebugKVPrefixes = "/debug/kv/prefixes"

// KVPrefixes is the answer of PathDebugKVPrefixes.
type KVPrefixes struct {
	Entries int `json:"entries"` // cache entries, running and idle
	InUse   int `json:"in_use"`  // of which held by a running request
	// Prefixes are the chained prompt hashes of every entry, deduplicated
	// and sorted: what the worker would report evicted if it dropped them.
	Prefixes []string `json:"prefixes"`
	// Pending are the prompt hashes of requests accepted and not answered
	// yet (queued, or running with their prompt not all written): what the
	// worker is about to hold, and what the router saved when it routed
	// them here. Deduplicated and sorted; they may overlap Prefixes.
	Pending []string `json:"pending"`
	// Evicted are the prompt hashes no entry holds any more (evicted, or
	// carried by a request that left without running), the latest
	// eviction of each, with when the metadata center acknowledged its
	// report: an index entry of one is in transit until then. Complete
	// for the evictions after EvictedSince; empty without a metadata
	// center (Config.Evictions).
	Evicted      []Gone `json:"evicted,omitempty"`
	EvictedSince int64  `json:"evicted_since_ms,omitempty"`
	// Refused are the prompt hashes of requests this worker refused
	// lately (429 and every other answer before accepting one), with
	// when: the router saved them when it routed the request here and
	// withdraws them when it sees the refusal. Complete for the last
	// refusedFor.
	Refused []Gone `json:"refused,omitempty"`
}

// Gone is one prefix of KVPrefixes.Evicted or Refused; times in Unix ms.
type Gone struct {
	Hash     string `json:"hash"`
	At       int64  `json:"at_ms"`
	Reported int64  `json:"reported_ms,omitempty"` // 0: not acknowledged yet
}

// pending tracks the hashes of the requests a Server has accepted and not
// yet answered, and of those it refused lately. Its own lock: handlers
// add and remove, the debug listing reads.
type pending struct {
	mu      sync.Mutex
	m       map[string][]prefix.Hash
	refused []Gone // in the order refused, the last refusedFor, at most refusedMax
}

// Bounds of the refusals kept for the debug listing: a checker needs those
// of the last retraction bound (bench/chaos, about a second).
const (
	refusedFor = 10 * time.Second
	refusedMax = 4096
)

// refuse records the hashes of a request refused at at.
func (p *pending) refuse(hs []prefix.Hash, at time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, h := range hs {
		p.refused = append(p.refused, Gone{Hash: h.String(), At: at.UnixMilli()})
	}
	i := 0
	for i < len(p.refused) && (len(p.refused)-i > refusedMax || at.UnixMilli()-p.refused[i].At > refusedFor.Milliseconds()) {
		i++
	}
	p.refused = p.refused[i:]
}

// listRefused lists the latest refusal of each hash within refusedFor.
func (p *pending) listRefused(now time.Time) []Gone {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []Gone
	latest := map[string]int{}
	for _, g := range p.refused {
		if now.UnixMilli()-g.At > refusedFor.Milliseconds() {
			continue
		}
		if i, ok := latest[g.Hash]; ok {
			out[i] = g
			continue
		}
		latest[g.Hash] = len(out)
		out = append(out, g)
	}
	return out
}

func (p *pending) add(id string, hs []prefix.Hash) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.m == nil {
		p.m = map[string][]prefix.Hash{}
	}
	p.m[id] = hs
}

func (p *pending) remove(id string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.m, id)
}

func (p *pending) list() []string {
	p.mu.Lock()
	var hs []prefix.Hash
	for _, h := range p.m {
		hs = append(hs, h...)
	}
	p.mu.Unlock()
	return wire(hs)
}

func wire(hs []prefix.Hash) []string {
	slices.Sort(hs)
	hs = slices.Compact(hs)
	out := make([]string, len(hs))
	for i, h := range hs {
		out[i] = h.String()
	}
	return out
}

// inspectTimeout bounds the wait for the scheduler loop, which answers
// between two steps; a step of a long prefill can take a while.
const inspectTimeout = 10 * time.Second

func (s *Server) kvPrefixes(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), inspectTimeout)
	defer cancel()
	var out KVPrefixes
	var hs []prefix.Hash
	// Read on the scheduler's goroutine, the KV state's one owner: the
	// books change only there, so the listing is one consistent moment.
	err := s.sched.Inspect(ctx, func(v scheduler.View) {
		for _, e := range v.KV.Entries() {
			out.Entries++
			if e.InUse {
				out.InUse++
			}
			hs = append(hs, e.Hashes...)
		}
	})
	if err != nil {
		openai.WriteError(w, &openai.Error{Status: http.StatusServiceUnavailable, Type: openai.TypeUnavailable,
			Message: "the scheduler did not answer: " + err.Error()})
		return
	}
	out.Prefixes = wire(hs)
	// After the KV state: a request that left meanwhile is held, or gone
	// without running, and then its hashes are listed evicted.
	out.Pending = s.pending.list()
	// After the KV state: the scheduler queues an eviction before it
	// answers, so every prefix the KV state no longer holds is listed.
	if s.cfg.Evictions != nil {
		evs, since := s.cfg.Evictions()
		out.EvictedSince = since.UnixMilli()
		for _, e := range evs {
			g := Gone{Hash: e.Hash.String(), At: e.At.UnixMilli()}
			if !e.Reported.IsZero() {
				g.Reported = e.Reported.UnixMilli()
			}
			out.Evicted = append(out.Evicted, g)
		}
	}
	out.Refused = s.pending.listRefused(time.Now())
	openai.WriteJSON(w, http.StatusOK, out)
}
