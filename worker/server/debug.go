package server

import (
	"context"
	"net/http"
	"slices"
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
	slices.Sort(hs)
	hs = slices.Compact(hs)
	out.Prefixes = make([]string, len(hs))
	for i, h := range hs {
		out.Prefixes[i] = h.String()
	}
	openai.WriteJSON(w, http.StatusOK, out)
}
