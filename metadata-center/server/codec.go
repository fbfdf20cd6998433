package server

import (
	"encoding/json"
	"slices"
	"strconv"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// The route and cache queries are on every inference request's critical
// path; encoding/json spent a third of the server's CPU on them (reflection,
// one string per hash, sorting map keys). These hand-written paths produce
// exactly what encoding/json would (tests compare byte for byte) and fall
// back to it for anything unusual.

// appendString appends s as a JSON string. Hosts are canonical ip:port,
// which never need escaping; anything else goes through encoding/json.
func appendString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			q, _ := json.Marshal(s)
			return append(b, q...)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}

// appendObject writes m as a JSON object with sorted keys, as
// encoding/json does, so that answers are deterministic; value writes one
// entry's value.
func appendObject[V any](b []byte, m map[string]V, value func([]byte, V) []byte) []byte {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	b = append(b, '{')
	for i, k := range keys {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendString(b, k)
		b = append(b, ':')
		b = value(b, m[k])
	}
	return append(b, '}')
}

func appendLoad(b []byte, l api.LoadStats) []byte {
	return appendObject(b, l, func(b []byte, st api.EndpointStats) []byte {
		b = append(b, `{"total_reqs":`...)
		b = strconv.AppendInt(b, st.TotalReqs, 10)
		b = append(b, `,"prompt_length":`...)
		b = strconv.AppendInt(b, st.PromptLength, 10)
		return append(b, '}')
	})
}

func appendLocations(b []byte, locs []api.CacheLocation) []byte {
	b = append(b, '[')
	for i, l := range locs {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"host":`...)
		b = appendString(b, l.Host)
		b = append(b, `,"length":`...)
		b = strconv.AppendInt(b, int64(l.Length), 10)
		b = append(b, '}')
	}
	return append(b, ']')
}

func appendRoute(b []byte, a api.RouteAnswer) []byte {
	b = append(b, `{"load":`...)
	if a.Load == nil {
		b = append(b, "null"...)
	} else {
		b = appendLoad(b, a.Load)
	}
	b = append(b, `,"cache":`...)
	if a.Cache == nil {
		b = append(b, "null"...)
	} else {
		b = appendLocations(b, a.Cache)
	}
	return appendRouteTail(b, a)
}

// appendCompactRoute writes a as api.CompactRouteAnswer. The cache's
// hosts come first, in the cache's order (itself deterministic), so its
// lengths need no index; then the hosts that only have load, sorted, so
// that the same answer is always the same bytes.
func appendCompactRoute(b []byte, a api.RouteAnswer) []byte {
	b = append(b, `{"hosts":[`...)
	for i, l := range a.Cache {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendString(b, l.Host)
	}
	var only []string // hosts with load and no cache entry
	inCache := 0
	for _, l := range a.Cache {
		if _, ok := a.Load[l.Host]; ok {
			inCache++
		}
	}
	if inCache < len(a.Load) {
		cached := make(map[string]bool, len(a.Cache))
		for _, l := range a.Cache {
			cached[l.Host] = true
		}
		for h := range a.Load {
			if !cached[h] {
				only = append(only, h)
			}
		}
		slices.Sort(only)
	}
	for i, h := range only {
		if i > 0 || len(a.Cache) > 0 {
			b = append(b, ',')
		}
		b = appendString(b, h)
	}
	b = append(b, `],"cache":[`...)
	for i, l := range a.Cache {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(l.Length), 10)
	}
	b = append(b, `],"load":[`...)
	n := 0
	triple := func(i int, st api.EndpointStats) {
		if n > 0 {
			b = append(b, ',')
		}
		n++
		b = strconv.AppendInt(b, int64(i), 10)
		b = append(b, ',')
		b = strconv.AppendInt(b, st.TotalReqs, 10)
		b = append(b, ',')
		b = strconv.AppendInt(b, st.PromptLength, 10)
	}
	for i, l := range a.Cache {
		if st, ok := a.Load[l.Host]; ok {
			triple(i, st)
		}
	}
	for i, h := range only {
		triple(len(a.Cache)+i, a.Load[h])
	}
	b = append(b, ']')
	return appendRouteTail(b, a)
}

// appendRouteTail writes what both forms of a route answer end with: the
// signals and pods (left out when empty) and the closing brace.
func appendRouteTail(b []byte, a api.RouteAnswer) []byte {
	if len(a.Signals) > 0 {
		b = append(b, `,"signals":`...)
		b = appendSignals(b, a.Signals)
	}
	if len(a.Pods) > 0 {
		b = append(b, `,"pods":`...)
		b = appendPods(b, a.Pods)
	}
	return append(b, '}')
}

// appendSignals writes host -> signals.
func appendSignals(b []byte, m map[string]api.PodSignals) []byte {
	return appendObject(b, m, func(b []byte, sig api.PodSignals) []byte {
		b = append(b, `{"waiting":`...)
		b = strconv.AppendInt(b, sig.Waiting, 10)
		b = append(b, `,"running":`...)
		b = strconv.AppendInt(b, sig.Running, 10)
		b = append(b, `,"kv_cache_util":`...)
		b = appendFloat(b, sig.KVCacheUtil)
		b = append(b, `,"prefill_tokens":`...)
		b = strconv.AppendInt(b, sig.PrefillTokens, 10)
		if sig.KVCapacity != 0 {
			b = append(b, `,"kv_capacity":`...)
			b = strconv.AppendInt(b, sig.KVCapacity, 10)
		}
		if sig.MaxRunning != 0 {
			b = append(b, `,"max_running":`...)
			b = strconv.AppendInt(b, sig.MaxRunning, 10)
		}
		if len(sig.PrefillQueue) > 0 {
			b = append(b, `,"prefill_queue":[`...)
			for i, q := range sig.PrefillQueue {
				if i > 0 {
					b = append(b, ',')
				}
				b = append(b, `{"tokens":`...)
				b = strconv.AppendInt(b, q.Tokens, 10)
				b = append(b, `,"seconds":`...)
				b = appendFloat(b, q.Seconds)
				b = append(b, '}')
			}
			b = append(b, ']')
		}
		for _, f := range []struct {
			key string
			v   float64
		}{{`,"token_seconds":`, sig.TokenSeconds}, {`,"attention_seconds":`, sig.AttentionSeconds},
			{`,"step_seconds":`, sig.StepSeconds}, {`,"step_left_seconds":`, sig.StepLeftSeconds},
			{`,"held_step_seconds":`, sig.HeldStepSeconds}, {`,"hold_left_seconds":`, sig.HoldLeftSeconds}} {
			if f.v != 0 {
				b = append(b, f.key...)
				b = appendFloat(b, f.v)
			}
		}
		if sig.HeldTokens != 0 {
			b = append(b, `,"held_tokens":`...)
			b = strconv.AppendInt(b, sig.HeldTokens, 10)
		}
		if sig.ReportsEvictions {
			b = append(b, `,"reports_evictions":true`...)
		}
		if sig.Draining {
			b = append(b, `,"draining":true`...)
		}
		if sig.AgeMS != 0 {
			b = append(b, `,"age_ms":`...)
			b = strconv.AppendInt(b, sig.AgeMS, 10)
		}
		return append(b, '}')
	})
}

// appendFloat writes f as encoding/json does for the values a utilization
// takes; anything else goes through encoding/json.
func appendFloat(b []byte, f float64) []byte {
	if f == 0 || (f >= 1e-6 && f < 1e21) {
		return strconv.AppendFloat(b, f, 'f', -1, 64)
	}
	q, _ := json.Marshal(f)
	return append(b, q...)
}

// parseQuery is the fast path for {"cluster":"...","hashes":["...",...]}
// (RouteQuery and CacheQuery share the shape). It reports ok=false for
// anything it does not handle — escapes, unknown or repeated keys, null,
// a malformed hash, bad syntax — and the caller then decodes with
// encoding/json, which also produces the precise error message.
func parseQuery(data []byte, buf []prefix.Hash) (cluster string, hashes []prefix.Hash, ok bool) {
	p := parser{data: data}
	if !p.byte('{') {
		return "", nil, false
	}
	var seenCluster, seenHashes bool
	for first := true; ; first = false {
		if p.byte('}') {
			break
		}
		if !first && !p.byte(',') {
			return "", nil, false
		}
		key, ok := p.str()
		if !ok || !p.byte(':') {
			return "", nil, false
		}
		switch key {
		case "cluster":
			if seenCluster {
				return "", nil, false
			}
			seenCluster = true
			if cluster, ok = p.str(); !ok {
				return "", nil, false
			}
		case "hashes":
			if seenHashes || !p.byte('[') {
				return "", nil, false
			}
			seenHashes = true
			hashes = buf[:0]
			if !p.byte(']') {
				for {
					raw, ok := p.raw()
					if !ok || len(hashes) >= api.MaxHashes {
						return "", nil, false
					}
					h, ok := prefix.ParseHashBytes(raw)
					if !ok {
						return "", nil, false
					}
					hashes = append(hashes, h)
					if p.byte(']') {
						break
					}
					if !p.byte(',') {
						return "", nil, false
					}
				}
			}
		default:
			return "", nil, false
		}
	}
	p.space()
	if p.i != len(p.data) || !seenHashes {
		return "", nil, false
	}
	if hashes == nil {
		hashes = []prefix.Hash{}
	}
	return cluster, hashes, true
}

type parser struct {
	data []byte
	i    int
}

func (p *parser) space() {
	for p.i < len(p.data) {
		switch p.data[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

// byte consumes c (after whitespace) if it is next.
func (p *parser) byte(c byte) bool {
	p.space()
	if p.i < len(p.data) && p.data[p.i] == c {
		p.i++
		return true
	}
	return false
}

// str reads a string without escapes or control characters; bytes >= 0x80
// bail out so that UTF-8 validity is left to encoding/json.
func (p *parser) str() (string, bool) {
	raw, ok := p.raw()
	return string(raw), ok
}

// raw is str without the copy.
func (p *parser) raw() ([]byte, bool) {
	if !p.byte('"') {
		return nil, false
	}
	start := p.i
	for p.i < len(p.data) {
		c := p.data[p.i]
		switch {
		case c == '"':
			s := p.data[start:p.i]
			p.i++
			return s, true
		case c == '\\' || c < 0x20 || c >= 0x80:
			return nil, false
		}
		p.i++
	}
	return nil, false
}
