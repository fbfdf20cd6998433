package llmfilter

import (
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
)

// fakeEnvoy is the callback side of one stream, with the rules of Envoy
// v1.36's golang filter (contrib/golang/filters/http/source): Continue and
// SendLocalReply end the phase the filter took async and may not be called
// twice; after OnDestroy every call fails as errFilterDestroyed does in the
// real shim (a panic); SetUpstreamOverrideHost takes only an IP with port and
// only while decoding, and when it is called from a goroutine (the phase
// returned Running) Envoy drops strict (golang_filter.cc posts the override
// with strict=false). The upstream host is the override when it is a member
// of the routed cluster (members; nil: any host is), else the cluster's own
// pick, as envoyhost/ reproduces. Every violation is also recorded so tests
// fail on it even when the filter's goroutine swallows the panic.
type fakeEnvoy struct {
	t *testing.T

	mu         sync.Mutex
	inGo       bool
	encoding   bool
	destroyed  bool // Envoy's side: the stream is gone, calls panic
	goDone     bool // the filter's OnDestroy returned: any call is a bug
	violations []string
	override   string
	strict     bool
	async      bool            // the current phase returned Running
	members    map[string]bool // the routed cluster; nil: every host
	added      []byte          // AddData from a header/trailer phase
	events     chan fakeEvent
	meta       map[string]map[string]any // dynamic metadata by namespace
}

type fakeEvent struct {
	status  api.StatusType
	reply   bool
	code    int
	body    string
	headers map[string][]string
	details string
	body2   string // the request body after the decision (set by the test driver)
}

// errFakeDestroyed is the value Envoy's shim panics with (a string there too).
const errFakeDestroyed = "golang filter has been destroyed"

func newFakeEnvoy(t *testing.T) *fakeEnvoy {
	return &fakeEnvoy{t: t, events: make(chan fakeEvent, 4)}
}

func (e *fakeEnvoy) violate(msg string) {
	e.violations = append(e.violations, msg)
}

// enter marks the start of a phase (Envoy calling into Go).
func (e *fakeEnvoy) enter(encoding bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.inGo, e.encoding, e.async = true, encoding, false
}

// leave records the phase's synchronous status.
func (e *fakeEnvoy) leave(st api.StatusType) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if st != api.Running {
		e.inGo = false
	} else {
		e.async = true
	}
}

// upstream is the host Envoy's router would send the request to.
func (e *fakeEnvoy) upstream() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.override == "" || e.members == nil || e.members[e.override] {
		return e.override
	}
	if e.strict {
		return "" // 503 UH
	}
	for h := range e.members {
		return h // the cluster's load balancer
	}
	return ""
}

func (e *fakeEnvoy) finishPhase(ev fakeEvent, what string) {
	e.mu.Lock()
	if e.goDone {
		e.violate(what + " after OnDestroy returned")
	}
	if e.destroyed {
		e.mu.Unlock()
		panic(errFakeDestroyed)
	}
	if !e.inGo {
		e.violate(what + " while no phase waits on Go")
		e.mu.Unlock()
		panic("fake envoy: not processing Go")
	}
	e.inGo = false
	e.mu.Unlock()
	e.events <- ev
}

// wait returns the event ending an async phase.
func (e *fakeEnvoy) wait() fakeEvent {
	e.t.Helper()
	select {
	case ev := <-e.events:
		return ev
	case <-time.After(10 * time.Second):
		e.t.Fatal("filter never continued the phase")
		return fakeEvent{}
	}
}

func (e *fakeEnvoy) destroy() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.destroyed = true
}

// destroyed marks the return of the filter's OnDestroy.
func (e *fakeEnvoy) goDestroyed() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.goDone = true
}

func (e *fakeEnvoy) check() {
	e.t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, v := range e.violations {
		e.t.Errorf("Envoy API misuse: %s", v)
	}
}

// --- api.FilterCallbackHandler ---

func (e *fakeEnvoy) StreamInfo() api.StreamInfo                         { return fakeStreamInfo{e: e} }
func (e *fakeEnvoy) ClearRouteCache()                                   {}
func (e *fakeEnvoy) RefreshRouteCache()                                 {}
func (e *fakeEnvoy) Log(api.LogType, string)                            {}
func (e *fakeEnvoy) LogLevel() api.LogType                              { return api.Error }
func (e *fakeEnvoy) GetProperty(string) (string, error)                 { return "", api.ErrValueNotFound }
func (e *fakeEnvoy) SecretManager() api.SecretManager                   { return nil }
func (e *fakeEnvoy) DecoderFilterCallbacks() api.DecoderFilterCallbacks { return fakeDecoder{e} }
func (e *fakeEnvoy) EncoderFilterCallbacks() api.EncoderFilterCallbacks { return fakeEncoder{e} }

type fakeProcess struct{ e *fakeEnvoy }

func (p fakeProcess) Continue(st api.StatusType) { p.e.finishPhase(fakeEvent{status: st}, "Continue") }
func (p fakeProcess) SendLocalReply(code int, body string, h map[string][]string, _ int64, details string) {
	p.e.finishPhase(fakeEvent{reply: true, code: code, body: body, headers: h, details: details}, "SendLocalReply")
}
func (p fakeProcess) RecoverPanic() { _ = recover() }
func (p fakeProcess) AddData(b []byte, _ bool) {
	p.e.mu.Lock()
	defer p.e.mu.Unlock()
	if !p.e.inGo || p.e.async {
		p.e.violate("AddData outside a synchronous phase")
	}
	p.e.added = append(p.e.added, b...)
}
func (p fakeProcess) InjectData([]byte) { p.e.violate("InjectData is not used by this filter") }

type fakeDecoder struct{ e *fakeEnvoy }
type fakeEncoder struct{ e *fakeEnvoy }

func (d fakeDecoder) Continue(st api.StatusType) { fakeProcess(d).Continue(st) }
func (d fakeDecoder) SendLocalReply(code int, body string, h map[string][]string, g int64, det string) {
	fakeProcess(d).SendLocalReply(code, body, h, g, det)
}
func (d fakeDecoder) RecoverPanic()            { _ = recover() }
func (d fakeDecoder) AddData(b []byte, s bool) { fakeProcess(d).AddData(b, s) }
func (d fakeDecoder) InjectData(b []byte)      { fakeProcess(d).InjectData(b) }

func (d fakeDecoder) SetUpstreamOverrideHost(host string, strict bool) error {
	e := d.e
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.goDone {
		e.violate("SetUpstreamOverrideHost after OnDestroy returned")
	}
	switch {
	case e.destroyed:
		panic(errFakeDestroyed)
	case !e.inGo || e.encoding:
		e.violate("SetUpstreamOverrideHost outside a decode phase in Go")
		panic("fake envoy: invalid phase")
	}
	if _, err := netip.ParseAddrPort(host); err != nil {
		return api.ErrInvalidIPAddress
	}
	e.override, e.strict = host, strict && !e.async
	return nil
}

// fakeStreamInfo answers what the filter reads; anything else panics
// (the embedded interface is nil).
type fakeStreamInfo struct {
	api.StreamInfo
	e *fakeEnvoy
}

func (i fakeStreamInfo) DynamicMetadata() api.DynamicMetadata { return fakeMeta{i.e} }

// ResponseCodeDetails: the fake's responses all come from upstream.
func (i fakeStreamInfo) ResponseCodeDetails() (string, bool) { return "via_upstream", true }

type fakeMeta struct{ e *fakeEnvoy }

func (m fakeMeta) Get(ns string) map[string]any {
	m.e.mu.Lock()
	defer m.e.mu.Unlock()
	out := map[string]any{}
	for k, v := range m.e.meta[ns] {
		out[k] = v
	}
	return out
}

func (m fakeMeta) Set(ns, key string, value any) {
	m.e.mu.Lock()
	defer m.e.mu.Unlock()
	if m.e.meta == nil {
		m.e.meta = map[string]map[string]any{}
	}
	if m.e.meta[ns] == nil {
		m.e.meta[ns] = map[string]any{}
	}
	m.e.meta[ns][key] = value
}

func (i fakeStreamInfo) UpstreamRemoteAddress() (string, bool) {
	h := i.e.upstream()
	return h, h != ""
}

func (c fakeEncoder) Continue(st api.StatusType) { fakeProcess(c).Continue(st) }
func (c fakeEncoder) SendLocalReply(code int, body string, h map[string][]string, g int64, det string) {
	fakeProcess(c).SendLocalReply(code, body, h, g, det)
}
func (c fakeEncoder) RecoverPanic()            { _ = recover() }
func (c fakeEncoder) AddData(b []byte, s bool) { fakeProcess(c).AddData(b, s) }
func (c fakeEncoder) InjectData(b []byte)      { fakeProcess(c).InjectData(b) }
