// Package envoyhost runs the real bin/llm-filter.so the way Envoy v1.36.2's
// golang HTTP filter does. A Go c-shared library cannot be loaded into a Go
// process, so the library lives in a small C program (chost/host.c) that
// reproduces Envoy's side of the ABI: worker threads owning their streams,
// direct and posted calls, the filter state machine, config lifecycle. This
// package is the rest of Envoy around it: the HTTP/1.1 listener clients
// connect to, and the router with its clusters (host map, health, override
// host with strict and non-strict semantics, retries). docs/envoy-filter.md
// lists what is reproduced, with Envoy's source locations.
package envoyhost

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"

	xdstype "github.com/cncf/xds/go/xds/type/v3"
	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
	"sigs.k8s.io/yaml"
)

// Options configure a host.
type Options struct {
	HostBin string // bin/envoyhost (make envoyhost)
	SO      string // bin/llm-filter.so (make filter-so)
	// Concurrency is Envoy's --concurrency: worker threads (default 2).
	Concurrency int
	// LogLevel is Envoy's level for the golang logger: 0 trace … 5 critical (default 2, info).
	LogLevel int
	// BufferLimit is per_connection_buffer_limit_bytes (default 1 MiB).
	BufferLimit int
	// Clusters maps a cluster name to its hosts ("ip:port").
	Clusters map[string][]string
	// DefaultCluster is the route's cluster when the request names none
	// in x-llm-cluster (the route's cluster_header).
	DefaultCluster string
	// Retries is the route's retry policy num_retries for connect failures.
	Retries int
	// Listen is the listener address (default 127.0.0.1:0).
	Listen string
	// Stderr also receives the host's stderr as it is written.
	Stderr io.Writer
	Logger *slog.Logger
}

// Destroyed is one config destruction reported by the host.
type Destroyed struct {
	ID       uint64
	Took     time.Duration
	OnWorker bool // the last reference was dropped by a worker thread
}

// Host is a running C host with its listener and router.
type Host struct {
	opts   Options
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	wmu    sync.Mutex
	stderr lockedBuffer
	ln     net.Listener
	srv    *http.Server
	log    *slog.Logger

	nextID   atomic.Uint64
	nextConn atomic.Uint32
	mu       sync.Mutex
	streams  map[uint64]*stream
	replies  map[uint64]chan frame
	destroys []Destroyed
	exited   chan struct{}
	exitErr  error
	closing  atomic.Bool

	router *router

	bodyRead atomic.Int64 // request body bytes read, over all streams
}

// BodyBytesRead is how many request body bytes the connection manager has
// read so far, over all streams: a test sending a body in pieces sends the
// next once the one before was read.
func (h *Host) BodyBytesRead() int64 { return h.bodyRead.Load() }

type lockedBuffer struct {
	mu  sync.Mutex
	b   bytes.Buffer
	out io.Writer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.out != nil {
		_, _ = l.out.Write(p)
	}
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Start launches the host, loads the library and serves HTTP. Push a config
// before sending requests.
func Start(opts Options) (*Host, error) {
	if opts.Concurrency <= 0 {
		opts.Concurrency = 2
	}
	if opts.LogLevel == 0 {
		opts.LogLevel = 2
	}
	if opts.BufferLimit <= 0 {
		opts.BufferLimit = 1 << 20
	}
	if opts.Listen == "" {
		opts.Listen = "127.0.0.1:0"
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	for _, p := range []string{opts.HostBin, opts.SO} {
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("envoyhost: %w (make envoyhost filter-so)", err)
		}
	}
	h := &Host{
		opts:    opts,
		log:     opts.Logger,
		streams: map[uint64]*stream{},
		replies: map[uint64]chan frame{},
		exited:  make(chan struct{}),
	}
	h.stderr.out = opts.Stderr
	h.router = newRouter(h, opts.Clusters, opts.DefaultCluster, opts.Retries)
	h.cmd = exec.Command(opts.HostBin, "--so", opts.SO,
		"--concurrency", strconv.Itoa(opts.Concurrency),
		"--log-level", strconv.Itoa(opts.LogLevel),
		"--buffer-limit", strconv.Itoa(opts.BufferLimit))
	h.cmd.Stderr = &h.stderr
	var err error
	if h.stdin, err = h.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	stdout, err := h.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := h.cmd.Start(); err != nil {
		return nil, err
	}
	go h.readLoop(bufio.NewReaderSize(stdout, 64<<10))
	go func() {
		err := h.cmd.Wait()
		h.mu.Lock()
		if !h.closing.Load() || err != nil {
			if err == nil {
				err = errors.New("exited")
			}
			h.exitErr = fmt.Errorf("envoyhost: the host process died (%v); its stderr:\n%s", err, h.stderr.String())
		}
		h.mu.Unlock()
		close(h.exited)
	}()
	h.ln, err = net.Listen("tcp", opts.Listen)
	if err != nil {
		h.kill()
		return nil, err
	}
	h.srv = &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		ConnContext: func(ctx context.Context, _ net.Conn) context.Context {
			return context.WithValue(ctx, connKey{}, h.nextConn.Add(1))
		},
		ErrorLog: slog.NewLogLogger(opts.Logger.Handler(), slog.LevelDebug),
	}
	go func() { _ = h.srv.Serve(h.ln) }()
	return h, nil
}

type connKey struct{}

// URL is the listener's base URL.
func (h *Host) URL() string { return "http://" + h.ln.Addr().String() }

// Stderr is everything the host wrote to stderr so far (its log).
func (h *Host) Stderr() string { return h.stderr.String() }

// Err is non-nil once the host process died without Close: a crash, an
// abort (a panic that escaped the Go runtime of the library), an exit.
func (h *Host) Err() error {
	select {
	case <-h.exited:
		h.mu.Lock()
		defer h.mu.Unlock()
		return h.exitErr
	default:
		return nil
	}
}

// Destroyed lists the config destructions reported so far.
func (h *Host) Destroyed() []Destroyed {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]Destroyed(nil), h.destroys...)
}

// Router gives tests access to cluster membership and health.
func (h *Host) Router() *router { return h.router }

func (h *Host) send(f frame) error {
	h.wmu.Lock()
	defer h.wmu.Unlock()
	return writeFrame(h.stdin, f)
}

// call sends a control frame and waits for its answer (the host's main
// thread answers in order; a hang there is a test failure, not a wait).
func (h *Host) call(typ uint8, payload []byte, timeout time.Duration) (frame, error) {
	id := h.nextID.Add(1)
	ch := make(chan frame, 1)
	h.mu.Lock()
	h.replies[id] = ch
	h.mu.Unlock()
	if err := h.send(frame{typ: typ, id: id, p: payload}); err != nil {
		return frame{}, h.deadErr(err)
	}
	select {
	case f := <-ch:
		return f, nil
	case <-h.exited:
		select {
		case f := <-ch: // answered, then exited: both were ready
			return f, nil
		default:
		}
		if typ == fShutdown && h.Err() == nil {
			// A clean exit is the shutdown's answer; its reply frame may
			// not have been read before the exit was seen.
			return frame{}, nil
		}
		return frame{}, h.deadErr(nil)
	case <-time.After(timeout):
		return frame{}, fmt.Errorf("envoyhost: the host's main thread did not answer in %v (hung); stderr:\n%s", timeout, h.Stderr())
	}
}

func (h *Host) deadErr(err error) error {
	select {
	case <-h.exited:
		if e := h.Err(); e != nil {
			return e
		}
	case <-time.After(2 * time.Second):
	}
	if err == nil {
		err = errors.New("host gone")
	}
	return fmt.Errorf("envoyhost: %w; stderr:\n%s", err, h.Stderr())
}

// Build makes bin/envoyhost and bin/llm-filter.so with the project's
// Makefile in the repository at root and returns their paths.
func Build(root string) (hostBin, so string, err error) {
	cmd := exec.Command("make", "-s", "filter-so", "envoyhost")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", "", fmt.Errorf("make filter-so envoyhost: %v\n%s", err, out)
	}
	return root + "/bin/envoyhost", root + "/bin/llm-filter.so", nil
}

// MarshalPluginConfig turns the filter document (YAML or JSON) into the
// serialized Any Envoy hands the library: a TypedStruct, as istio/ sends it.
func MarshalPluginConfig(doc []byte) ([]byte, error) {
	j, err := yaml.YAMLToJSON(doc)
	if err != nil {
		return nil, err
	}
	var st structpb.Struct
	if err := st.UnmarshalJSON(j); err != nil {
		return nil, err
	}
	a, err := anypb.New(&xdstype.TypedStruct{TypeUrl: "type.googleapis.com/llm-filter.Config", Value: &st})
	if err != nil {
		return nil, err
	}
	return proto.Marshal(a)
}

// PushConfig is an xDS push of the listener: the library parses a new
// config, streams started from now on use it, and the previous one is
// destroyed once its last stream is gone (as Envoy drains the old listener).
// It returns the new config's id.
func (h *Host) PushConfig(doc []byte) (uint64, error) {
	b, err := MarshalPluginConfig(doc)
	if err != nil {
		return 0, err
	}
	f, err := h.call(fCfgPush, b, 30*time.Second)
	if err != nil {
		return 0, err
	}
	d := &dec{b: f.p}
	id := d.u64()
	if id == 0 {
		return 0, fmt.Errorf("envoyhost: the library refused the config (Envoy rejects the update); stderr:\n%s", lastLines(h.Stderr(), 5))
	}
	return id, nil
}

// LocalReply is the HTTP connection manager's local_reply_config in the
// shape istio/envoyfilter.yaml ships (docs/envoy-filter.md): replies whose
// dynamic metadata has SkipNamespace.SkipKey = true are left alone; every
// other local reply with status >= MinStatus gets JSONFormat (the
// json_format as JSON text) with %RESPONSE_CODE%, %RESPONSE_CODE_DETAILS%,
// %LOCAL_REPLY_BODY% and %REQ(X-REQUEST-ID)% substituted.
type LocalReply struct {
	SkipNamespace, SkipKey string
	MinStatus              int
	JSONFormat             string
}

// SetLocalReply installs the connection manager's local reply mapper
// (nil removes it).
func (h *Host) SetLocalReply(lr *LocalReply) error {
	e := &enc{}
	if lr == nil {
		lr = &LocalReply{}
	}
	e.str(lr.SkipNamespace)
	e.str(lr.SkipKey)
	e.u32(uint32(lr.MinStatus))
	e.str(lr.JSONFormat)
	_, err := h.call(fLocalReplyCfg, e.b, 10*time.Second)
	return err
}

// DropConfig removes the listener's config (listener removed).
func (h *Host) DropConfig() error {
	_, err := h.call(fCfgDrop, nil, 30*time.Second)
	return err
}

// SetRouteConfig sets (or, with nil, removes) the route-level plugin config
// of the route; Envoy merges it with the listener config per stream.
func (h *Host) SetRouteConfig(doc []byte) (uint64, error) {
	var b []byte
	if doc != nil {
		var err error
		if b, err = MarshalPluginConfig(doc); err != nil {
			return 0, err
		}
	}
	f, err := h.call(fRouteCfg, b, 30*time.Second)
	if err != nil {
		return 0, err
	}
	d := &dec{b: f.p}
	return d.u64(), nil
}

// Metrics returns Envoy's stats the library defined (name → value).
func (h *Host) Metrics() (map[string]int64, error) {
	f, err := h.call(fMetrics, nil, 10*time.Second)
	if err != nil {
		return nil, err
	}
	m := map[string]int64{}
	for _, line := range strings.Split(string(f.p), "\n") {
		k, v, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		n, _ := strconv.ParseInt(v, 10, 64)
		m[k] = n
	}
	return m, nil
}

// AccessRecord is one line of the host's HCM access log: the response code
// and the stream's dynamic metadata, "namespace:key" -> value.
type AccessRecord struct {
	Code     int
	Metadata map[string]any
}

// AccessLog returns the access log so far, oldest first.
func (h *Host) AccessLog() ([]AccessRecord, error) {
	var out []AccessRecord
	for _, line := range strings.Split(h.Stderr(), "\n") {
		rest, ok := strings.CutPrefix(line, "envoyhost: access-log ")
		if !ok {
			continue
		}
		rec := AccessRecord{Metadata: map[string]any{}}
		for i, field := range strings.Fields(rest) {
			k, v, _ := strings.Cut(field, "=")
			if i == 0 && k == "code" {
				rec.Code, _ = strconv.Atoi(v)
				continue
			}
			raw, err := hex.DecodeString(v)
			if err != nil {
				return nil, fmt.Errorf("access log %q: %w", field, err)
			}
			var pv structpb.Value
			if err := proto.Unmarshal(raw, &pv); err != nil {
				return nil, fmt.Errorf("access log %q: %w", field, err)
			}
			rec.Metadata[k] = pv.AsInterface()
		}
		out = append(out, rec)
	}
	return out, nil
}

// ForceGC runs a Go GC cycle in the library and waits for its finalizers
// (envoyGoFilterCleanUp, Envoy's ASan hook; it also makes every later config
// destruction force one).
func (h *Host) ForceGC() error {
	_, err := h.call(fGC, nil, 30*time.Second)
	return err
}

// Close stops the listener, destroys the configs and ends the host. It
// returns the host's crash, if it crashed.
func (h *Host) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = h.srv.Shutdown(ctx)
	if err := h.Err(); err != nil {
		return err
	}
	h.closing.Store(true)
	if _, err := h.call(fShutdown, nil, 15*time.Second); err != nil {
		h.kill()
		return err
	}
	select {
	case <-h.exited:
	case <-time.After(10 * time.Second):
		h.kill()
		return fmt.Errorf("envoyhost: the host did not exit after shutdown; stderr:\n%s", h.Stderr())
	}
	return h.Err()
}

func (h *Host) kill() {
	h.closing.Store(true)
	if h.cmd.Process != nil {
		_ = h.cmd.Process.Kill()
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func (h *Host) readLoop(r *bufio.Reader) {
	for {
		f, err := readFrame(r)
		if err != nil {
			return
		}
		switch f.typ {
		case fCfgPushed, fRouteSet, fMetricsOut, fBye, fGCDone, fLocalReplySet:
			h.mu.Lock()
			ch := h.replies[f.id]
			delete(h.replies, f.id)
			h.mu.Unlock()
			if ch != nil {
				ch <- f
			}
		case fCfgDestroyed:
			d := &dec{b: f.p}
			us := d.u64()
			onWorker := d.u8() == 1
			h.mu.Lock()
			h.destroys = append(h.destroys, Destroyed{ID: f.id, Took: time.Duration(us) * time.Microsecond, OnWorker: onWorker})
			h.mu.Unlock()
		case fFwdHeaders, fFwdData, fFwdTrailers, fUpstreamCancel:
			h.router.handle(f)
		default:
			h.mu.Lock()
			s := h.streams[f.id]
			h.mu.Unlock()
			if s != nil {
				s.events <- f
			}
		}
	}
}

// --- the listener (downstream) ---

type stream struct {
	id     uint64
	conn   uint32
	events chan frame
}

func (h *Host) streamFrame(s *stream, typ uint8, build func(e *enc)) error {
	e := &enc{}
	e.u32(s.conn)
	build(e)
	return h.send(frame{typ: typ, id: s.id, p: e.b})
}

// ServeHTTP is the HTTP connection manager: one stream per request, the
// request's events to the host's worker owning the connection, the
// filter's output back to the client.
func (h *Host) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// Full duplex, as Envoy is: the answer (a 413 over the buffer limit, a
	// local reply) goes out while the body is still being read. Without it
	// net/http, writing the answer's headers, first reads the unread body
	// to its end, holding it from pumpBody, and a client that sends its
	// body only as it is consumed is never answered.
	_ = http.NewResponseController(w).EnableFullDuplex()
	conn, _ := r.Context().Value(connKey{}).(uint32)
	s := &stream{id: h.nextID.Add(1), conn: conn, events: make(chan frame, 256)}
	h.mu.Lock()
	h.streams[s.id] = s
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		delete(h.streams, s.id)
		h.mu.Unlock()
	}()

	hs := []header{{":method", r.Method}, {":path", r.URL.RequestURI()}, {":authority", r.Host}, {":scheme", "http"}}
	for k, vs := range r.Header {
		for _, v := range vs {
			hs = append(hs, header{strings.ToLower(k), v})
		}
	}
	if r.Header.Get(headers.RequestID) == "" { // the connection manager's request id
		hs = append(hs, header{headers.RequestID, uuid.NewString()})
	}
	hasBody := r.ContentLength != 0
	if err := h.streamFrame(s, fReqHeaders, func(e *enc) {
		e.u8(b2u(!hasBody))
		e.headers(hs)
	}); err != nil {
		http.Error(w, "host gone", http.StatusBadGateway)
		return
	}
	if hasBody {
		go h.pumpBody(s, r)
	}

	wroteHeaders := false
	clientGone := r.Context().Done()
	for {
		select {
		case <-h.exited:
			if !wroteHeaders {
				http.Error(w, "envoyhost died", http.StatusBadGateway)
			}
			return
		case <-clientGone:
			clientGone = nil
			_ = h.streamFrame(s, fReset, func(*enc) {})
		case f := <-s.events:
			d := &dec{b: f.p}
			switch f.typ {
			case fClientHeaders:
				d.u8()
				status := 200
				for _, hd := range d.headers() {
					if hd.k == ":status" {
						status, _ = strconv.Atoi(hd.v)
						continue
					}
					w.Header().Add(hd.k, hd.v)
				}
				w.WriteHeader(status)
				wroteHeaders = true
			case fClientData:
				d.u8()
				if b := d.rest(); len(b) > 0 {
					_, _ = w.Write(b)
				}
				if fl, ok := w.(http.Flusher); ok {
					fl.Flush()
				}
			case fClientTrailers:
				for _, hd := range d.headers() {
					w.Header().Add(http.TrailerPrefix+hd.k, hd.v)
				}
			case fStreamEnd:
				if d.u8() == 1 {
					// A reset after the response started: the client
					// sees a broken body, never a clean end.
					panic(http.ErrAbortHandler)
				}
				return
			}
		}
	}
}

// pumpBody streams the request body as data frames; the last one carries
// end_stream, unless trailers follow (HTTP/1.1 chunked trailers).
func (h *Host) pumpBody(s *stream, r *http.Request) {
	buf := make([]byte, 64<<10)
	var pending []byte
	havePending := false
	for {
		n, err := r.Body.Read(buf)
		h.bodyRead.Add(int64(n))
		if n > 0 {
			if havePending {
				_ = h.streamFrame(s, fReqData, func(e *enc) { e.u8(0); e.b = append(e.b, pending...) })
			}
			pending = append(pending[:0], buf[:n]...)
			havePending = true
		}
		if err != nil {
			if err != io.EOF {
				_ = h.streamFrame(s, fReset, func(*enc) {})
				return
			}
			break
		}
	}
	var trailers []header
	for k, vs := range r.Trailer {
		for _, v := range vs {
			if v != "" {
				trailers = append(trailers, header{strings.ToLower(k), v})
			}
		}
	}
	_ = h.streamFrame(s, fReqData, func(e *enc) { e.u8(b2u(len(trailers) == 0)); e.b = append(e.b, pending...) })
	if len(trailers) > 0 {
		_ = h.streamFrame(s, fReqTrailers, func(e *enc) { e.headers(trailers) })
	}
}

func b2u(b bool) uint8 {
	if b {
		return 1
	}
	return 0
}
