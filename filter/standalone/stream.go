package standalone

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
)

// Errors a filter gets (as a panic, like from Envoy's cgo shim) when it
// touches the callbacks at the wrong time.
var (
	// ErrFilterDestroyed: the stream is over (OnDestroy ran).
	ErrFilterDestroyed = errors.New("golang filter has been destroyed")
	// ErrNotInGo: Continue/SendLocalReply/SetUpstreamOverrideHost while no
	// phase is waiting on the filter (a second Continue, say).
	ErrNotInGo = errors.New("golang filter is not processing Go")
	// ErrInvalidPhase: SetUpstreamOverrideHost outside the decode phases.
	ErrInvalidPhase = errors.New("golang filter invoked an API in an invalid phase")
)

type localReply struct {
	code    int
	body    string
	headers map[string][]string
	details string
}

// event ends a phase that the filter took async (Running).
type event struct {
	status api.StatusType
	reply  *localReply
}

// stream is one request: it implements every callback interface Envoy hands
// a filter, with Envoy's rules about when each may be called.
type stream struct {
	host  *Host
	r     *http.Request
	start time.Time
	log   *slog.Logger

	mu             sync.Mutex
	inGo           bool   // a phase is waiting on the filter (sync call or Running)
	async          bool   // the phase returned Running: calls come from goroutines
	phaseG         uint64 // the goroutine that runs phases: Envoy's worker thread
	encoding       bool   // current phase is an encode phase
	destroyed      bool
	override       string
	strict         bool
	respCode       int
	details        string
	upstream       string
	upstreamFailed bool   // the backend could not be reached (passive health)
	trailersPhase  bool   // EncodeTrailers is running: AddData appends to the body
	added          []byte // what AddData appended in that phase
	events         chan event

	dyn   map[string]map[string]any
	state map[string]string

	decoding decoderCallbacks
	encoder  encoderCallbacks
}

type decoderCallbacks struct{ s *stream }
type encoderCallbacks struct{ s *stream }

var (
	_ api.FilterCallbackHandler  = (*stream)(nil)
	_ api.DecoderFilterCallbacks = decoderCallbacks{}
	_ api.EncoderFilterCallbacks = encoderCallbacks{}
	_ api.StreamInfo             = (*streamInfo)(nil)
)

func newStream(h *Host, r *http.Request) *stream {
	s := &stream{host: h, r: r, start: time.Now(), log: h.log, events: make(chan event, 1),
		dyn: map[string]map[string]any{}, state: map[string]string{}}
	s.decoding = decoderCallbacks{s}
	s.encoder = encoderCallbacks{s}
	return s
}

// call runs one filter phase and, when the filter answers Running, waits for
// its Continue or SendLocalReply from another goroutine. A panic in the
// filter turns into a 500 local reply, as Envoy's shim does. ok is false
// when the client went away while waiting.
func (s *stream) call(ctx context.Context, encoding bool, fn func() api.StatusType) (st api.StatusType, reply *localReply, ok bool) {
	s.mu.Lock()
	s.inGo, s.encoding, s.async, s.phaseG = true, encoding, false, goid()
	s.mu.Unlock()
	st = s.protect(fn)
	if st == api.Running {
		s.mu.Lock()
		s.async = true // callbacks now come from the filter's goroutines
		s.mu.Unlock()
		select {
		case ev := <-s.events:
			if ev.reply != nil {
				return api.LocalReply, ev.reply, true
			}
			return ev.status, nil, true
		case <-ctx.Done():
			return api.Running, nil, false
		}
	}
	s.mu.Lock()
	s.inGo = false
	s.mu.Unlock()
	select {
	case ev := <-s.events: // Continue/SendLocalReply called synchronously
		if ev.reply != nil {
			return api.LocalReply, ev.reply, true
		}
	default:
	}
	if st == api.LocalReply {
		// LocalReply without a SendLocalReply: Envoy would leave the stream
		// hanging; answering 500 is the useful version of that bug.
		return api.LocalReply, &localReply{code: 500, body: "filter returned LocalReply without SendLocalReply", details: "filter_bug"}, true
	}
	return st, nil, true
}

func (s *stream) protect(fn func() api.StatusType) (st api.StatusType) {
	defer func() {
		if e := recover(); e != nil {
			s.log.Error("panic in filter", "panic", e, "stack", string(debug.Stack()))
			s.mu.Lock()
			s.inGo = false
			s.mu.Unlock()
			s.drainEvents()
			s.events <- event{reply: &localReply{code: 500, body: "error happened in filter\r\n", details: "filter_panic"}}
			st = api.LocalReply
		}
	}()
	return fn()
}

func (s *stream) drainEvents() {
	for {
		select {
		case <-s.events:
		default:
			return
		}
	}
}

// finishPhase claims the phase for a Continue or SendLocalReply, with the
// panics Envoy's shim raises for calls that come too late or twice.
func (s *stream) finishPhase(ev event) {
	s.mu.Lock()
	switch {
	case s.destroyed:
		s.mu.Unlock()
		panic(ErrFilterDestroyed)
	case !s.inGo:
		s.mu.Unlock()
		panic(ErrNotInGo)
	}
	s.inGo = false
	s.mu.Unlock()
	s.events <- ev
}

func (s *stream) destroy() (reason api.DestroyReason) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.destroyed = true
	if s.inGo {
		return api.Terminate
	}
	return api.Normal
}

// --- FilterProcessCallbacks, shared by both directions ---

func (s *stream) continueWith(st api.StatusType) {
	if st == api.LocalReply {
		return // Envoy ignores it too: the reply was already sent
	}
	s.finishPhase(event{status: st})
}

func (s *stream) sendLocalReply(code int, body string, headers map[string][]string, _ int64, details string) {
	s.finishPhase(event{reply: &localReply{code: code, body: body, headers: headers, details: details}})
}

// recoverPanic must be the deferred function itself for recover to work,
// hence the two thin methods below calling into it with the recovered value.
func (s *stream) handlePanic(e any) {
	if e == nil {
		return
	}
	if e == ErrFilterDestroyed {
		s.log.Info("filter goroutine touched a finished stream (client gone?)", "panic", e)
		return
	}
	s.log.Error("panic in filter goroutine", "panic", e, "stack", string(debug.Stack()))
	func() {
		defer func() { _ = recover() }() // the stream may be gone or not in Go
		s.sendLocalReply(500, "error happened in filter\r\n", nil, 0, "filter_panic")
	}()
}

func (d decoderCallbacks) Continue(st api.StatusType) { d.s.continueWith(st) }
func (d decoderCallbacks) SendLocalReply(code int, body string, h map[string][]string, g int64, det string) {
	d.s.sendLocalReply(code, body, h, g, det)
}
func (d decoderCallbacks) RecoverPanic()               { d.s.handlePanic(recover()) }
func (d decoderCallbacks) AddData(data []byte, _ bool) { d.s.addData(data) }
func (d decoderCallbacks) InjectData(data []byte)      { d.s.addData(data) }
func (e encoderCallbacks) Continue(st api.StatusType)  { e.s.continueWith(st) }
func (e encoderCallbacks) RecoverPanic()               { e.s.handlePanic(recover()) }
func (e encoderCallbacks) AddData(data []byte, _ bool) { e.s.addData(data) }
func (e encoderCallbacks) InjectData(data []byte)      { e.s.addData(data) }
func (e encoderCallbacks) SendLocalReply(code int, body string, h map[string][]string, g int64, det string) {
	e.s.sendLocalReply(code, body, h, g, det)
}

// addData appends to the response body during EncodeTrailers, where the
// filter adds a transcoded stream's tail (Envoy's addEncodedData). Elsewhere
// it is accepted and ignored with a warning: no filter of this project
// injects bodies there, and a silent half-implementation would be worse.
func (s *stream) addData(data []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.trailersPhase && s.inGo {
		s.added = append(s.added, data...)
		return
	}
	s.log.Warn("AddData/InjectData is supported by the standalone host only in EncodeTrailers; data dropped", "bytes", len(data))
}

func (d decoderCallbacks) SetUpstreamOverrideHost(host string, strict bool) error {
	s := d.s
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.destroyed:
		panic(ErrFilterDestroyed)
	case !s.inGo:
		panic(ErrNotInGo)
	case s.encoding:
		panic(ErrInvalidPhase)
	}
	norm, err := normalizeHost(host)
	if err != nil {
		return api.ErrInvalidIPAddress
	}
	// Envoy posts an override made from a goroutine to the worker thread
	// and applies it with strict=false (golang_filter.cc
	// setUpstreamOverrideHost); only a phase's own synchronous call keeps
	// strict. Envoy tells the two apart by thread, not by time: a goroutine
	// may call before its phase has returned Running.
	s.override, s.strict = norm, strict && !s.async && goid() == s.phaseG
	return nil
}

// goid is the calling goroutine's id, the standalone host's stand-in for
// Envoy's "am I on the worker thread" check (golang_filter.cc isThreadSafe).
func goid() uint64 {
	var buf [32]byte
	b := bytes.TrimPrefix(buf[:runtime.Stack(buf[:], false)], []byte("goroutine "))
	if i := bytes.IndexByte(b, ' '); i > 0 {
		b = b[:i]
	}
	id, _ := strconv.ParseUint(string(b), 10, 64)
	return id
}

// --- StreamFilterCallbacks ---

func (s *stream) StreamInfo() api.StreamInfo                         { return &streamInfo{s} }
func (s *stream) ClearRouteCache()                                   {}
func (s *stream) RefreshRouteCache()                                 {}
func (s *stream) DecoderFilterCallbacks() api.DecoderFilterCallbacks { return s.decoding }
func (s *stream) EncoderFilterCallbacks() api.EncoderFilterCallbacks { return s.encoder }
func (s *stream) SecretManager() api.SecretManager                   { return noSecrets{} }

func (s *stream) Log(level api.LogType, msg string) {
	s.log.Log(context.Background(), slogLevel(level), msg)
}

func (s *stream) LogLevel() api.LogType {
	for _, l := range []api.LogType{api.Trace, api.Debug, api.Info, api.Warn, api.Error} {
		if s.log.Enabled(context.Background(), slogLevel(l)) {
			return l
		}
	}
	return api.Critical
}

func slogLevel(l api.LogType) slog.Level {
	switch l {
	case api.Trace:
		return slog.LevelDebug - 4
	case api.Debug:
		return slog.LevelDebug
	case api.Info:
		return slog.LevelInfo
	case api.Warn:
		return slog.LevelWarn
	default:
		return slog.LevelError
	}
}

// GetProperty answers the request.* attributes of Envoy's attribute list that
// a host without Envoy knows; everything else is ErrValueNotFound.
func (s *stream) GetProperty(key string) (string, error) {
	switch key {
	case "request.path":
		return s.r.URL.RequestURI(), nil
	case "request.url_path":
		return s.r.URL.Path, nil
	case "request.host":
		return s.r.Host, nil
	case "request.method":
		return s.r.Method, nil
	case "request.scheme":
		if s.r.TLS != nil {
			return "https", nil
		}
		return "http", nil
	case "request.protocol":
		return s.r.Proto, nil
	case "request.id":
		return s.r.Header.Get(headers.RequestID), nil
	case "request.time":
		return s.start.UTC().Format("2006-01-02T15:04:05.999999-07:00"), nil
	case "source.address":
		return s.r.RemoteAddr, nil
	case "response.code":
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.respCode == 0 {
			return "", api.ErrValueNotFound
		}
		return fmt.Sprint(s.respCode), nil
	}
	return "", api.ErrValueNotFound
}

type noSecrets struct{}

func (noSecrets) GetGenericSecret(string) (string, bool) { return "", false }

// --- StreamInfo ---

type streamInfo struct{ s *stream }

func (i *streamInfo) GetRouteName() string    { return "" }
func (i *streamInfo) FilterChainName() string { return "" }
func (i *streamInfo) Protocol() (string, bool) {
	return i.s.r.Proto, true
}
func (i *streamInfo) ResponseCode() (uint32, bool) {
	i.s.mu.Lock()
	defer i.s.mu.Unlock()
	return uint32(i.s.respCode), i.s.respCode != 0
}
func (i *streamInfo) ResponseCodeDetails() (string, bool) {
	i.s.mu.Lock()
	defer i.s.mu.Unlock()
	return i.s.details, i.s.details != ""
}
func (i *streamInfo) AttemptCount() uint32 {
	i.s.mu.Lock()
	defer i.s.mu.Unlock()
	if i.s.upstream == "" {
		return 0
	}
	return 1
}
func (i *streamInfo) DynamicMetadata() api.DynamicMetadata { return dynMeta{i.s} }
func (i *streamInfo) DownstreamLocalAddress() string {
	if a, ok := i.s.r.Context().Value(http.LocalAddrContextKey).(interface{ String() string }); ok {
		return a.String()
	}
	return ""
}
func (i *streamInfo) DownstreamRemoteAddress() string { return i.s.r.RemoteAddr }
func (i *streamInfo) UpstreamLocalAddress() (string, bool) {
	return "", false
}
func (i *streamInfo) UpstreamRemoteAddress() (string, bool) {
	i.s.mu.Lock()
	defer i.s.mu.Unlock()
	return i.s.upstream, i.s.upstream != ""
}
func (i *streamInfo) UpstreamClusterName() (string, bool) { return "", false }
func (i *streamInfo) FilterState() api.FilterState        { return filterState{i.s} }
func (i *streamInfo) VirtualClusterName() (string, bool)  { return "", false }
func (i *streamInfo) WorkerID() uint32                    { return 0 }

type dynMeta struct{ s *stream }

func (d dynMeta) Get(filterName string) map[string]any {
	d.s.mu.Lock()
	defer d.s.mu.Unlock()
	out := map[string]any{}
	for k, v := range d.s.dyn[filterName] {
		out[k] = v
	}
	return out
}

func (d dynMeta) Set(filterName, key string, value any) {
	d.s.mu.Lock()
	defer d.s.mu.Unlock()
	if d.s.dyn[filterName] == nil {
		d.s.dyn[filterName] = map[string]any{}
	}
	d.s.dyn[filterName][key] = value
}

type filterState struct{ s *stream }

func (f filterState) SetString(key, value string, _ api.StateType, _ api.LifeSpan, _ api.StreamSharing) {
	f.s.mu.Lock()
	defer f.s.mu.Unlock()
	f.s.state[key] = value
}

func (f filterState) GetString(key string) string {
	f.s.mu.Lock()
	defer f.s.mu.Unlock()
	return f.s.state[key]
}

func normalizeHost(host string) (string, error) {
	if strings.TrimSpace(host) != host || host == "" {
		return "", api.ErrInvalidIPAddress
	}
	return normalizeAddress(host)
}
