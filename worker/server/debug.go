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
}

// pending tracks the hashes of the requests a Server has accepted and not
// yet answered. Its own lock: handlers add and remove, the debug listing
// reads.
type pending struct {
	mu sync.Mutex
	m  map[string][]prefix.Hash
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
	out.Pending = s.pending.list()
	openai.WriteJSON(w, http.StatusOK, out)
}
