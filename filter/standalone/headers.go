package standalone

import (
	"net/http"
	"strconv"
	"strings"
	"sync"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
)

// HeaderMap is an ordered multi-map with lower-case keys and HTTP/2 pseudo
// headers (":method", ":path", ":authority", ":scheme", ":status"), which is
// what a filter sees in Envoy whatever the downstream protocol. It is safe for
// concurrent use because Envoy allows a filter to touch headers from its own
// goroutine while a phase is in Go.
type HeaderMap struct {
	mu sync.Mutex
	kv []kv
}

type kv struct{ k, v string }

// NewHeaderMap returns a map holding a copy of h with lower-cased keys.
func NewHeaderMap(h http.Header) *HeaderMap {
	m := &HeaderMap{}
	for k, vs := range h {
		for _, v := range vs {
			m.kv = append(m.kv, kv{strings.ToLower(k), v})
		}
	}
	return m
}

var (
	_ api.RequestHeaderMap   = (*RequestHeaders)(nil)
	_ api.ResponseHeaderMap  = (*ResponseHeaders)(nil)
	_ api.RequestTrailerMap  = (*HeaderMap)(nil)
	_ api.ResponseTrailerMap = (*HeaderMap)(nil)
)

func (m *HeaderMap) GetRaw(name string) string {
	v, _ := m.Get(name)
	return v
}

func (m *HeaderMap) Get(key string) (string, bool) {
	key = strings.ToLower(key)
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, p := range m.kv {
		if p.k == key {
			return p.v, true
		}
	}
	return "", false
}

func (m *HeaderMap) Values(key string) []string {
	key = strings.ToLower(key)
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for _, p := range m.kv {
		if p.k == key {
			out = append(out, p.v)
		}
	}
	return out
}

func (m *HeaderMap) Set(key, value string) {
	key = strings.ToLower(key)
	m.mu.Lock()
	defer m.mu.Unlock()
	for i, p := range m.kv {
		if p.k == key {
			m.kv[i].v = value
			m.kv = deleteKey(m.kv, key, i+1)
			return
		}
	}
	m.kv = append(m.kv, kv{key, value})
}

func (m *HeaderMap) Add(key, value string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.kv = append(m.kv, kv{strings.ToLower(key), value})
}

func (m *HeaderMap) Del(key string) {
	key = strings.ToLower(key)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.kv = deleteKey(m.kv, key, 0)
}

func deleteKey(s []kv, key string, from int) []kv {
	out := s[:from]
	for _, p := range s[from:] {
		if p.k != key {
			out = append(out, p)
		}
	}
	return out
}

// Range iterates over a snapshot, so f may modify the map.
func (m *HeaderMap) Range(f func(key, value string) bool) {
	for _, p := range m.snapshot() {
		if !f(p.k, p.v) {
			return
		}
	}
}

func (m *HeaderMap) RangeWithCopy(f func(key, value string) bool) { m.Range(f) }

func (m *HeaderMap) GetAllHeaders() map[string][]string {
	out := map[string][]string{}
	for _, p := range m.snapshot() {
		out[p.k] = append(out[p.k], p.v)
	}
	return out
}

func (m *HeaderMap) snapshot() []kv {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]kv(nil), m.kv...)
}

// httpHeader renders the map as net/http headers without pseudo headers and
// without the hop-by-hop headers a proxy must not forward (RFC 9110 §7.6.1).
func (m *HeaderMap) httpHeader() http.Header {
	h := http.Header{}
	conn := map[string]bool{}
	for _, v := range m.Values("connection") {
		for _, tok := range strings.Split(v, ",") {
			conn[strings.ToLower(strings.TrimSpace(tok))] = true
		}
	}
	for _, p := range m.snapshot() {
		if strings.HasPrefix(p.k, ":") || hopByHop[p.k] || conn[p.k] {
			continue
		}
		h.Add(p.k, p.v)
	}
	return h
}

var hopByHop = map[string]bool{
	"connection": true, "keep-alive": true, "proxy-connection": true, "proxy-authenticate": true,
	"proxy-authorization": true, "te": true, "trailer": true, "transfer-encoding": true, "upgrade": true,
	"content-length": true, // recomputed from the body actually sent
}

// RequestHeaders adds the request pseudo-header accessors.
type RequestHeaders struct{ HeaderMap }

// NewRequestHeaders builds Envoy's view of r: pseudo headers first, then the
// regular headers lower-cased.
func NewRequestHeaders(r *http.Request) *RequestHeaders {
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	h := &RequestHeaders{}
	h.kv = append(h.kv,
		kv{":authority", r.Host},
		kv{":path", r.URL.RequestURI()},
		kv{":method", r.Method},
		kv{":scheme", scheme})
	h.kv = append(h.kv, NewHeaderMap(r.Header).kv...)
	if r.ContentLength > 0 {
		if _, ok := r.Header["Content-Length"]; !ok {
			h.kv = append(h.kv, kv{"content-length", strconv.FormatInt(r.ContentLength, 10)})
		}
	}
	return h
}

func (h *RequestHeaders) Scheme() string      { return h.GetRaw(":scheme") }
func (h *RequestHeaders) Method() string      { return h.GetRaw(":method") }
func (h *RequestHeaders) Host() string        { return h.GetRaw(":authority") }
func (h *RequestHeaders) Path() string        { return h.GetRaw(":path") }
func (h *RequestHeaders) SetMethod(m string)  { h.Set(":method", m) }
func (h *RequestHeaders) SetHost(host string) { h.Set(":authority", host) }
func (h *RequestHeaders) SetPath(path string) { h.Set(":path", path) }

// ResponseHeaders adds the ":status" accessor.
type ResponseHeaders struct{ HeaderMap }

// NewResponseHeaders builds Envoy's view of a response head.
func NewResponseHeaders(status int, hdr http.Header) *ResponseHeaders {
	h := &ResponseHeaders{}
	h.kv = append(h.kv, kv{":status", strconv.Itoa(status)})
	h.kv = append(h.kv, NewHeaderMap(hdr).kv...)
	return h
}

func (h *ResponseHeaders) Status() (int, bool) {
	v, ok := h.Get(":status")
	if !ok {
		return 0, false
	}
	n, err := strconv.Atoi(v)
	return n, err == nil
}
