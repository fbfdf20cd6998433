// Package server is the metadata center's HTTP API v1 (docs/architecture.md) on gin:
// it validates and canonicalises every request, maps it onto the store's parts,
// and answers errors as
// {"error":{"code":N,"type":"...","message":"..."}}.
package server

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/gin-gonic/gin"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/trace"

	"github.com/istio-llm-filter/istio-llm-filter/internal/tracing"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// Defaults of Options.
const (
	DefaultMaxBodyBytes = 1 << 20
	DefaultStoreTimeout = time.Second
)

// Options configure a Server. Zero values pick the defaults.
type Options struct {
	// AuthToken, when set, is required as "Authorization: Bearer <token>"
	// on every call except /healthz, /readyz and /metrics.
	AuthToken string
	// Tokens, when set instead of AuthToken, decides which bearer tokens
	// are accepted (secretfile.Tokens: a rotated token file).
	Tokens TokenChecker
	Logger *slog.Logger // default slog.Default()
	// Registry receives the server's metrics and is what /metrics serves;
	// default a fresh registry (never the process-global one, so several
	// servers can live in one test binary).
	Registry *prometheus.Registry
	// MaxBodyBytes bounds request bodies (413 beyond); default 1 MiB, which
	// holds api.MaxHashes hashes many times over.
	MaxBodyBytes int64
	// StoreTimeout bounds each store call; past it the call answers 503.
	StoreTimeout time.Duration
	// Discovered records the pods gateways announce (POST
	// /v1/pods/discovered) for the scraper; nil answers that path 404.
	Discovered Announcements
	// Tracer, when set, traces every API call as a server span continuing
	// the caller's W3C traceparent (internal/tracing); nil traces nothing.
	Tracer trace.TracerProvider
}

// Announcements keeps the pods gateways announce; *podsignals.Discovered
// is the real one.
type Announcements interface {
	Announce(cluster, backend string, hosts []string, ttl time.Duration)
}

// TokenChecker decides whether a bearer token ("" when the call carries
// none) is accepted; it accepts every call while authentication is off.
type TokenChecker interface {
	Accept(token string) bool
}

// staticToken is AuthToken as a TokenChecker.
type staticToken string

func (s staticToken) Accept(got string) bool {
	return s == "" || subtle.ConstantTimeCompare([]byte(got), []byte(s)) == 1
}

// Server is the metadata-center HTTP API over one store.
type Server struct {
	st      store.Parts
	opts    Options
	log     *slog.Logger
	metrics *metrics
	engine  *gin.Engine
	chunks  chunkSizes
	// bufs recycles the buffer a query's body is read into and its answer
	// is then written to (a route answer for 64 hosts is ≈ 6 KiB):
	// allocating and clearing both per query was an eighth of the bytes a
	// route query allocated.
	bufs sync.Pool
}

// New builds the server. The caller owns st and closes it.
func New(st store.Store, opts Options) *Server {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Registry == nil {
		opts.Registry = prometheus.NewRegistry()
	}
	if opts.MaxBodyBytes <= 0 {
		opts.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if opts.StoreTimeout <= 0 {
		opts.StoreTimeout = DefaultStoreTimeout
	}
	if opts.Tokens == nil {
		opts.Tokens = staticToken(opts.AuthToken)
	}
	s := &Server{st: st.Parts(), opts: opts, log: opts.Logger}
	s.metrics = newMetrics(opts.Registry, s.st.Health, opts.StoreTimeout)

	e := gin.New()
	e.HandleMethodNotAllowed = true
	e.RedirectTrailingSlash = false
	e.RedirectFixedPath = false
	e.Use(s.recoverer, s.instrument)
	if opts.Tracer != nil {
		e.Use(s.traced(opts.Tracer.Tracer(tracing.Scope)))
	}
	e.Use(s.authenticate)
	e.NoRoute(func(c *gin.Context) {
		s.fail(c, http.StatusNotFound, "not_found", "no such path: "+c.Request.URL.Path)
	})
	e.NoMethod(func(c *gin.Context) {
		s.fail(c, http.StatusMethodNotAllowed, "method_not_allowed",
			fmt.Sprintf("%s is not allowed on %s", c.Request.Method, c.Request.URL.Path))
	})

	e.GET(api.PathLoadStats, s.loadStats)
	e.POST(api.PathLoadStats, s.addLease)
	e.DELETE(api.PathLoadStats, s.deleteLease)
	e.DELETE(api.PathLoadStatsPrompt, s.firstToken)
	e.POST(api.PathCacheQuery, s.cacheQuery)
	e.POST(api.PathCacheSave, s.cacheSave)
	e.POST(api.PathCacheEvict, s.cacheEvict)
	e.POST(api.PathCacheRetract, s.cacheRetract)
	e.POST(api.PathRouteQuery, s.routeQuery)
	e.POST(api.PathBatch, s.batch)
	e.POST(api.PathPodSignals, s.reportSignals)
	e.GET(api.PathPodSignals, s.podSignals)
	e.GET(api.PathPods, s.pods)
	e.POST(api.PathPodsDiscovered, s.announcePods)
	e.GET(api.PathHealthz, s.healthz)
	e.GET(api.PathReadyz, s.readyz)
	e.GET(api.PathDebugCacheIndex, s.cacheIndex)
	prom := promhttp.HandlerFor(opts.Registry, promhttp.HandlerOpts{})
	e.GET(api.PathMetrics, gin.WrapH(prom))
	s.engine = e
	return s
}

// Handler returns the http.Handler serving the API.
func (s *Server) Handler() http.Handler { return s.engine }

// open lists the paths that need no token: probes must work for kubelet,
// and Prometheus scrapes in-mesh without credentials; /metrics carries
// only aggregate counts, no hosts, clusters or hashes.
func open(path string) bool {
	return path == api.PathHealthz || path == api.PathReadyz || path == api.PathMetrics
}

func (s *Server) authenticate(c *gin.Context) {
	if open(c.Request.URL.Path) {
		return
	}
	got, ok := strings.CutPrefix(c.GetHeader("Authorization"), "Bearer ")
	if !ok {
		got = ""
	}
	if !s.opts.Tokens.Accept(got) {
		c.Header("WWW-Authenticate", `Bearer realm="metadata-center"`)
		s.fail(c, http.StatusUnauthorized, "unauthorized", "missing or wrong bearer token")
	}
}

func (s *Server) recoverer(c *gin.Context) {
	defer func() {
		if r := recover(); r != nil {
			if r == http.ErrAbortHandler {
				panic(r)
			}
			s.log.Error("handler panic", "path", c.Request.URL.Path, "panic", r)
			s.fail(c, http.StatusInternalServerError, "internal_error", "internal error")
		}
	}()
	c.Next()
}

func (s *Server) instrument(c *gin.Context) {
	start := time.Now()
	c.Next()
	endpoint := c.FullPath()
	if endpoint == "" {
		endpoint = "unmatched" // bounded label set whatever clients send
	}
	took := time.Since(start)
	s.metrics.observe(endpoint, method(c.Request.Method), c.Writer.Status(), took)
	// Per-call lines are debug: the route query runs once per inference
	// request. The gateway's trace id ties them to the request that caused them.
	if s.log.Enabled(c.Request.Context(), slog.LevelDebug) {
		s.log.Debug("call", "endpoint", endpoint, "method", c.Request.Method, "status", c.Writer.Status(),
			"took", took, "trace_id", c.GetHeader("X-Request-Id"))
	}
}

// method keeps the label set bounded: clients may send any token as a
// method.
func method(m string) string {
	switch m {
	case http.MethodGet, http.MethodPost, http.MethodDelete, http.MethodPut, http.MethodPatch, http.MethodHead, http.MethodOptions:
		return m
	}
	return "other"
}

// fail answers an error in the error format and stops the chain.
func (s *Server) fail(c *gin.Context, code int, typ, msg string) {
	body, _ := json.Marshal(api.Error{
		Error:   api.ErrorDetail{Code: code, Type: typ, Message: msg},
		TraceID: c.GetHeader("X-Request-Id"),
	})
	c.Abort()
	c.Data(code, "application/json", body)
}

func (s *Server) ok(c *gin.Context, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		s.fail(c, http.StatusInternalServerError, "internal_error", "encode answer: "+err.Error())
		return
	}
	c.Data(http.StatusOK, "application/json", body)
}

func (s *Server) raw(c *gin.Context, body []byte) {
	c.Data(http.StatusOK, "application/json", body)
}

// storeFailed answers a store error: 503 when the backing store is
// unreachable or slow (clients degrade and retry), 500 otherwise.
func (s *Server) storeFailed(c *gin.Context, op string, err error) {
	s.metrics.storeErrors.WithLabelValues(op).Inc()
	if errors.Is(err, store.ErrUnavailable) || errors.Is(err, context.DeadlineExceeded) {
		s.log.Warn("store unavailable", "op", op, "trace_id", c.GetHeader("X-Request-Id"), "err", err)
		s.fail(c, http.StatusServiceUnavailable, "store_unavailable", op+": "+err.Error())
		return
	}
	s.log.Error("store failed", "op", op, "trace_id", c.GetHeader("X-Request-Id"), "err", err)
	s.fail(c, http.StatusInternalServerError, "internal_error", op+": "+err.Error())
}

func (s *Server) storeCtx(c *gin.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(c.Request.Context(), s.opts.StoreTimeout)
}

// readBody reads the whole body within the size limit, into buf when it
// is large enough; on failure it has already answered.
func (s *Server) readBody(c *gin.Context, buf []byte) ([]byte, bool) {
	r := http.MaxBytesReader(c.Writer, c.Request.Body, s.opts.MaxBodyBytes)
	var body []byte
	var err error
	if n := c.Request.ContentLength; n > 0 && n <= s.opts.MaxBodyBytes {
		// One allocation of the right size instead of ReadAll's doubling.
		if int64(cap(buf)) >= n {
			body = buf[:n]
		} else {
			body = make([]byte, n)
		}
		_, err = io.ReadFull(r, body)
	} else {
		body, err = io.ReadAll(r)
	}
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			s.fail(c, http.StatusRequestEntityTooLarge, "payload_too_large",
				fmt.Sprintf("body larger than %d bytes", tooBig.Limit))
			return nil, false
		}
		s.fail(c, http.StatusBadRequest, "bad_request", "read body: "+err.Error())
		return nil, false
	}
	if len(body) == 0 {
		s.fail(c, http.StatusBadRequest, "bad_request", "invalid JSON: empty body")
		return nil, false
	}
	return body, true
}

func (s *Server) unmarshal(c *gin.Context, body []byte, v any) bool {
	if err := json.Unmarshal(body, v); err != nil {
		s.fail(c, http.StatusBadRequest, "bad_request", "invalid JSON: "+describeJSONError(err))
		return false
	}
	return true
}

// decode reads and unmarshals the body; on failure it has already answered.
func (s *Server) decode(c *gin.Context, v any) bool {
	body, ok := s.readBody(c, nil)
	return ok && s.unmarshal(c, body, v)
}

// decodeQuery reads a RouteQuery/CacheQuery body (into buf if it is large
// enough), through the fast path when it can. Nothing returned refers to
// buf.
func (s *Server) decodeQuery(c *gin.Context, buf []byte) (string, []prefix.Hash, bool) {
	body, ok := s.readBody(c, buf)
	if !ok {
		return "", nil, false
	}
	cluster, hashes, fast := parseQuery(body, make([]prefix.Hash, 0, 64))
	var err error
	if fast {
		cluster, err = validCluster(cluster)
	} else {
		var req api.RouteQuery
		if !s.unmarshal(c, body, &req) {
			return "", nil, false
		}
		cluster, hashes, err = validQuery(req.Cluster, req.Hashes)
	}
	if err != nil {
		s.badRequest(c, err)
		return "", nil, false
	}
	return cluster, hashes, true
}

func describeJSONError(err error) string {
	var typeErr *json.UnmarshalTypeError
	if errors.As(err, &typeErr) && typeErr.Field != "" {
		return fmt.Sprintf("field %q: want %s, got JSON %s", typeErr.Field, typeErr.Type, typeErr.Value)
	}
	return err.Error()
}

func (s *Server) badRequest(c *gin.Context, err error) {
	s.fail(c, http.StatusBadRequest, "bad_request", err.Error())
}

func (s *Server) loadStats(c *gin.Context) {
	clusterGet(s, c, "load stats", s.st.Leases.LoadStats, func(stats api.LoadStats) []byte {
		return appendLoad(make([]byte, 0, 8+64*len(stats)), stats)
	})
}

// clusterGet answers a GET of one cluster's figures (?cluster=): get reads
// them from the store, render writes the answer.
func clusterGet[T any](s *Server, c *gin.Context, op string, get func(context.Context, string) (T, error), render func(T) []byte) {
	cluster, err := validCluster(c.Query("cluster"))
	if err != nil {
		s.badRequest(c, err)
		return
	}
	ctx, cancel := s.storeCtx(c)
	defer cancel()
	v, err := get(ctx, cluster)
	if err != nil {
		s.storeFailed(c, op, err)
		return
	}
	s.raw(c, render(v))
}

func (s *Server) addLease(c *gin.Context) {
	var req api.AddRequest
	if !s.decode(c, &req) {
		return
	}
	ref, err := validRef(req.Cluster, req.Host, req.RequestID)
	if err == nil {
		err = validPromptLength(req.PromptLength)
	}
	if err != nil {
		s.badRequest(c, err)
		return
	}
	ctx, cancel := s.storeCtx(c)
	defer cancel()
	if err := s.st.Leases.AddLease(ctx, ref.Cluster, ref.Host, ref.RequestID, req.PromptLength); err != nil {
		s.storeFailed(c, "add lease", err)
		return
	}
	s.ok(c, struct{}{})
}

func (s *Server) decodeRef(c *gin.Context) (api.RequestRef, bool) {
	var req api.RequestRef
	if !s.decode(c, &req) {
		return req, false
	}
	ref, err := validRef(req.Cluster, req.Host, req.RequestID)
	if err != nil {
		s.badRequest(c, err)
		return ref, false
	}
	return ref, true
}

func (s *Server) deleteLease(c *gin.Context) { s.leaseOp(c, "delete lease", s.st.Leases.DeleteLease) }

func (s *Server) firstToken(c *gin.Context) { s.leaseOp(c, "first token", s.st.Leases.FirstToken) }

// leaseOp runs a store call on the lease a RequestRef body names.
func (s *Server) leaseOp(c *gin.Context, op string, call func(ctx context.Context, cluster, host, requestID string) error) {
	ref, ok := s.decodeRef(c)
	if !ok {
		return
	}
	ctx, cancel := s.storeCtx(c)
	defer cancel()
	if err := call(ctx, ref.Cluster, ref.Host, ref.RequestID); err != nil {
		s.storeFailed(c, op, err)
		return
	}
	s.ok(c, struct{}{})
}

// maxPooledBuf keeps the buffers of rare huge queries out of the pool.
const maxPooledBuf = 64 << 10

func (s *Server) getQueryBuf() *[]byte {
	if b, ok := s.bufs.Get().(*[]byte); ok {
		return b
	}
	b := make([]byte, 0, 8<<10)
	return &b
}

func (s *Server) putQueryBuf(b *[]byte) {
	if cap(*b) <= maxPooledBuf {
		s.bufs.Put(b)
	}
}

func (s *Server) cacheQuery(c *gin.Context) {
	buf := s.getQueryBuf()
	defer s.putQueryBuf(buf)
	cluster, hashes, ok := s.decodeQuery(c, *buf)
	if !ok {
		return
	}
	ctx, cancel := s.storeCtx(c)
	defer cancel()
	locs, err := s.st.Index.QueryCache(ctx, cluster, hashes)
	if err != nil {
		s.storeFailed(c, "cache query", err)
		return
	}
	*buf = appendLocations((*buf)[:0], locs)
	s.raw(c, *buf)
}

func (s *Server) routeQuery(c *gin.Context) {
	buf := s.getQueryBuf()
	defer s.putQueryBuf(buf)
	cluster, hashes, ok := s.decodeQuery(c, *buf)
	if !ok {
		return
	}
	ctx, cancel := s.storeCtx(c)
	defer cancel()
	ans, err := s.st.Router.Route(ctx, cluster, hashes)
	if err != nil {
		s.storeFailed(c, "route query", err)
		return
	}
	// Clients that can read it get the compact form: a third of the bytes,
	// so a 64-host answer leaves in one write instead of two.
	if strings.Contains(c.GetHeader("Accept"), api.MediaRouteCompact) {
		*buf = appendCompactRoute((*buf)[:0], ans)
		c.Data(http.StatusOK, api.MediaRouteCompact, *buf)
		return
	}
	*buf = appendRoute((*buf)[:0], ans)
	s.raw(c, *buf)
}

// announcePods records the pods a gateway routes to in a cluster, for the
// scraper (docs/metadata-center.md, "Pod signals").
func (s *Server) announcePods(c *gin.Context) {
	if s.opts.Discovered == nil {
		s.fail(c, http.StatusNotFound, "not_found", "this metadata center does not scrape announced pods")
		return
	}
	var req api.PodsAnnouncement
	if !s.decode(c, &req) {
		return
	}
	cluster, hosts, ttl, err := validAnnouncement(req)
	if err != nil {
		s.badRequest(c, err)
		return
	}
	s.opts.Discovered.Announce(cluster, req.Backend, hosts, ttl)
	s.ok(c, struct{}{})
}

// reportSignals is a pod's report about itself (our worker pushes it; the
// scrapers of podsignals write third-party pods' through the store).
func (s *Server) reportSignals(c *gin.Context) {
	var req api.PodReport
	if !s.decode(c, &req) {
		return
	}
	cluster, host, err := validClusterHost(req.Cluster, req.Host)
	if err == nil {
		err = validSignals(req.Signals())
	}
	var ttl time.Duration
	if err == nil && req.Register != nil {
		ttl, err = validRegistration(req.Register)
	}
	if err != nil {
		s.badRequest(c, err)
		return
	}
	ctx, cancel := s.storeCtx(c)
	defer cancel()
	if err := s.st.Signals.ReportSignals(ctx, cluster, host, req.Signals()); err != nil {
		s.storeFailed(c, "report signals", err)
		return
	}
	if req.Register != nil {
		if err := s.st.Registry.Register(ctx, cluster, host, *req.Register, ttl); err != nil {
			s.storeFailed(c, "register", err)
			return
		}
		s.metrics.registrations.Inc()
	}
	s.metrics.signalReports.Inc()
	s.ok(c, struct{}{})
}

// podSignals answers the cluster's fresh reports (operators, debugging).
func (s *Server) podSignals(c *gin.Context) {
	clusterGet(s, c, "signals", s.st.Signals.Signals, func(sig map[string]api.PodSignals) []byte {
		return appendSignals(make([]byte, 0, 8+96*len(sig)), sig)
	})
}

func (s *Server) cacheSave(c *gin.Context) {
	received := time.Now()
	var req api.CacheSave
	if !s.decode(c, &req) {
		return
	}
	cluster, host, err := validClusterHost(req.Cluster, req.Host)
	if err != nil {
		s.badRequest(c, err)
		return
	}
	if len(req.Hashes) == 0 {
		s.badRequest(c, errors.New("hashes is required and must not be empty"))
		return
	}
	hashes, err := validHashes(req.Hashes)
	if err != nil {
		s.badRequest(c, err)
		return
	}
	if err := validSaveID(req.SaveID, false); err != nil {
		s.badRequest(c, err)
		return
	}
	at, err := savedAt(req.AgeMS, received)
	if err != nil {
		s.badRequest(c, err)
		return
	}
	if err := validMaxEntries(req.MaxEntries); err != nil {
		s.badRequest(c, err)
		return
	}
	ctx, cancel := s.storeCtx(c)
	defer cancel()
	if req.RefreshOnly {
		err = s.st.Index.RefreshCache(ctx, cluster, host, hashes, req.SaveID)
	} else {
		err = s.st.Index.SaveCacheAs(ctx, cluster, host, hashes, req.SaveID, at, req.MaxEntries)
	}
	if err != nil {
		s.storeFailed(c, "cache save", err)
		return
	}
	s.chunks.learn(cluster, req.ChunkSize)
	s.ok(c, struct{}{})
}

func (s *Server) cacheEvict(c *gin.Context) {
	var req api.CacheEvict
	if !s.decode(c, &req) {
		return
	}
	cluster, host, err := validClusterHost(req.Cluster, req.Host)
	if err != nil {
		s.badRequest(c, err)
		return
	}
	switch {
	case req.All && len(req.Hashes) > 0:
		s.badRequest(c, errors.New("give either hashes or all: true, not both"))
		return
	case !req.All && len(req.Hashes) == 0:
		s.badRequest(c, errors.New("hashes is required unless all is true"))
		return
	}
	if err := validEvictedAt(req.EvictedAt, time.Now()); err != nil {
		s.badRequest(c, err)
		return
	}
	ctx, cancel := s.storeCtx(c)
	defer cancel()
	if req.All {
		if err := s.st.Index.EvictHostBefore(ctx, cluster, host, req.EvictedAt); err != nil {
			s.storeFailed(c, "cache evict", err)
			return
		}
		s.ok(c, struct{}{})
		return
	}
	hashes, err := validHashes(req.Hashes)
	if err != nil {
		s.badRequest(c, err)
		return
	}
	if err := s.chunks.check(cluster, req.ChunkSize); err != nil {
		s.metrics.chunkMismatch.Inc()
		s.log.Error("eviction report refused", "cluster", cluster, "host", host, "trace_id", c.GetHeader("X-Request-Id"), "err", err)
		s.fail(c, http.StatusConflict, "chunk_size_mismatch", err.Error())
		return
	}
	if err := s.st.Index.EvictCacheBefore(ctx, cluster, host, hashes, req.EvictedAt); err != nil {
		s.storeFailed(c, "cache evict", err)
		return
	}
	s.ok(c, struct{}{})
}

// cacheRetract withdraws a save whose request failed before its first
// token (docs/metadata-center.md, "Versions").
func (s *Server) cacheRetract(c *gin.Context) {
	var req api.CacheRetract
	if !s.decode(c, &req) {
		return
	}
	op, err := validRetract(req)
	if err != nil {
		s.badRequest(c, err)
		return
	}
	ctx, cancel := s.storeCtx(c)
	defer cancel()
	if err := s.st.Index.RetractCache(ctx, op.Cluster, op.Host, op.Hashes, op.SaveID); err != nil {
		s.storeFailed(c, "cache retract", err)
		return
	}
	s.ok(c, struct{}{})
}

func (s *Server) healthz(c *gin.Context) { s.ok(c, map[string]string{"status": "ok"}) }

func (s *Server) readyz(c *gin.Context) {
	ctx, cancel := s.storeCtx(c)
	defer cancel()
	if err := s.st.Health.Ping(ctx); err != nil {
		s.fail(c, http.StatusServiceUnavailable, "store_unavailable", "not ready: "+err.Error())
		return
	}
	s.ok(c, map[string]string{"status": "ready"})
}
