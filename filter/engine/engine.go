// Package engine is the filter's decision engine, independent of Envoy: the
// Envoy StreamFilter and the standalone gateway both hand it a complete
// request and get back where to send it (docs/envoy-filter.md), then report
// the request's lifecycle (docs/envoy-filter.md, "Phases") so that the metadata center's
// load and cache figures stay true.
//
// Decide runs: trace id → transcoder → parse → rule match → prompt hash →
// endpoints and label selectors → one route query to the metadata center
// (bounded by query_timeout; on failure equal load and zero cache) → policy → upstream body. Lifecycle reports are queued on a
// bounded dispatcher and never block.
//
// Metrics (Options.Metrics.Count) are counted under these names:
//
//	routed                  a decision was made
//	cache_hit_routes        ... to a pod holding part of the prompt (CacheRatio > 0)
//	fallbacks               ... without metadata (query failed or no metadata center)
//	metadata_center_errors  a route query or an update failed
//	async_dropped           an update was dropped: queue full or engine closed
//	async_errors            an update ran and failed
//	rejected                Decide refused the request (any *Error)
//	retractions             a request that failed before its first token withdrew its saves
//	served_elsewhere        the pod that answered was not the chosen one (Served)
package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-llm-filter/istio-llm-filter/filter/balancer"
	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/filter/rules"
	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode"
	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode/openai"
	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode/triton"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// Headers is satisfied by Envoy's api.RequestHeaderMap (Get(key string) (string, bool)).
// Keys are asked in lower case; ":path" is read to tell the endpoints apart.
type Headers interface {
	Get(key string) (string, bool)
}

// Metrics counts events by name (see the package doc). nil = no-op.
type Metrics interface {
	Count(name string, delta int64)
}

// Router answers the route query; *client.Client is the real one.
type Router interface {
	Route(ctx context.Context, cluster string, hashes []string) (*api.RouteAnswer, error)
}

// Updater sends the lifecycle updates; *client.Client is the real one.
type Updater interface {
	AddRequest(ctx context.Context, r api.AddRequest) error
	FirstToken(ctx context.Context, r api.RequestRef) error
	DeleteRequest(ctx context.Context, r api.RequestRef) error
	SaveCache(ctx context.Context, r api.CacheSave) error
}

// Options of New. Only Endpoints is required.
type Options struct {
	Endpoints  endpoints.Source
	Metrics    Metrics
	Logger     *slog.Logger // default slog.Default()
	HTTPClient *http.Client // for the metadata center; default client.NewTransport
	// IntN replaces the balancer's random source (tests); must be safe for
	// concurrent use.
	IntN func(n int) int
	// Router and Updater replace the metadata-center client (benchmarks
	// without network, tests). Either may be set alone.
	Router  Router
	Updater Updater
	// Transcoders adds or replaces protocols by name.
	Transcoders map[string]transcode.Transcoder
	// Policies adds or replaces load-balancing policies by name; Scorers
	// adds scorers for the lb rule's `scorers` key.
	Policies map[string]balancer.Policy
	Scorers  map[string]balancer.Scorer
	// Registerer, if set, gets the balancer's per-stage latency histogram.
	Registerer prometheus.Registerer
}

// Engine is safe for concurrent use.
type Engine struct {
	cfg     *config.Config
	log     *slog.Logger
	metrics Metrics
	src     endpoints.Source
	codecs  transcode.Registry
	rules   *rules.Table
	hasher  prefix.Hasher
	bal     *balancer.Balancer
	router  Router
	updater Updater
	disp    *client.Dispatcher
	batch   *client.Batcher // set when updates are batched (async.batch_window)
	qto     time.Duration

	// scratch pools per-decision buffers (*scratch). Garbage is what sets
	// a decision's tail: on two cores every collection cycle's mark phase
	// slows the decisions it overlaps, so fewer bytes mean fewer cycles.
	scratch sync.Pool

	// Failure logs are rate-limited: with the metadata center down every
	// request fails its query, and one line per second says as much.
	lastWarn   atomic.Int64 // unix nanos
	suppressed atomic.Int64
}

// scratch is what one decision needs only until it returns: the prompt
// texts and canonical prompt (until hashed), its block sums (until
// rendered to wire form) and the cache view of the route answer (until
// scored).
type scratch struct {
	texts []byte // the parsed request's prompt texts (bufferedParser)
	canon []byte
	sums  []prefix.Hash
	cache map[string]int
	eps   []endpoints.Endpoint // the cluster's endpoints (endpoints.Append)
}

// bufferedParser is a transcoder that decodes prompt texts into a buffer
// the caller owns (openai.Transcoder.ParseBuffered).
type bufferedParser interface {
	ParseBuffered(path string, body []byte, texts *[]byte) (*transcode.Request, error)
}

// maxPooledCanonical keeps one huge prompt from pinning its buffers forever.
const maxPooledCanonical = 1 << 20

// maxPooledEndpoints does the same for a huge cluster's endpoint list.
const maxPooledEndpoints = 4096

func (e *Engine) getScratch() *scratch {
	if sc, _ := e.scratch.Get().(*scratch); sc != nil {
		return sc
	}
	return &scratch{}
}

func (e *Engine) putScratch(sc *scratch) {
	if cap(sc.canon) > maxPooledCanonical {
		sc.canon = nil
		sc.sums = nil
	}
	if cap(sc.texts) > maxPooledCanonical {
		sc.texts = nil
	}
	sc.texts, sc.canon, sc.sums = sc.texts[:0], sc.canon[:0], sc.sums[:0]
	if len(sc.cache) > 4096 {
		sc.cache = nil // a map never shrinks: do not keep a giant one
	}
	clear(sc.cache)
	clear(sc.eps) // do not pin labels of pods that may be gone
	if cap(sc.eps) > maxPooledEndpoints {
		sc.eps = nil
	}
	sc.eps = sc.eps[:0]
	e.scratch.Put(sc)
}

type nopMetrics struct{}

func (nopMetrics) Count(string, int64) {}

// New builds an engine and starts its dispatcher.
func New(cfg *config.Config, opts Options) (*Engine, error) {
	if cfg == nil {
		return nil, errors.New("engine: nil config")
	}
	if opts.Endpoints == nil {
		return nil, errors.New("engine: Options.Endpoints is required")
	}
	e := &Engine{
		cfg:     cfg,
		log:     opts.Logger,
		metrics: opts.Metrics,
		src:     opts.Endpoints,
		rules:   rules.New(cfg.ModelMappingRule),
		hasher:  prefix.Hasher{ChunkSize: cfg.PromptHash.ChunkSize},
		bal: balancer.New(balancer.Options{IntN: opts.IntN, Policies: opts.Policies, Scorers: opts.Scorers,
			Logger: opts.Logger, Registerer: opts.Registerer}),
		router:  opts.Router,
		updater: opts.Updater,
		qto:     cfg.MetadataCenter.QueryTimeout,
	}
	if e.log == nil {
		e.log = slog.Default()
	}
	if e.metrics == nil {
		e.metrics = nopMetrics{}
	}
	if e.qto <= 0 {
		e.qto = config.DefaultQueryTimeout
	}
	if err := e.bal.Check(cfg.LBMappingRule.Default); err != nil {
		return nil, fmt.Errorf("engine: lb_mapping_rule.default: %w", err)
	}
	for cluster, r := range cfg.LBMappingRule.Clusters {
		if err := e.bal.Check(r); err != nil {
			return nil, fmt.Errorf("engine: lb_mapping_rule.%s: %w", cluster, err)
		}
	}
	oa := openai.Transcoder{LazyCanonical: true}
	e.codecs = transcode.Registry{"openai": oa, "triton": triton.New(oa)}
	for name, t := range opts.Transcoders {
		e.codecs[name] = t
	}
	if _, err := e.codecs.Lookup(cfg.Protocol); err != nil {
		// The seed answers 400 per request (step 2); say it once up front too.
		e.log.Warn("configured protocol has no transcoder: every request will get 400", "protocol", cfg.Protocol)
	}
	if cfg.MetadataCenter.Address != "" && (e.router == nil || e.updater == nil) {
		c, err := client.New(client.Options{
			Address:       cfg.MetadataCenter.Address,
			AuthToken:     cfg.MetadataCenter.AuthToken,
			QueryTimeout:  cfg.MetadataCenter.QueryTimeout,
			UpdateTimeout: cfg.MetadataCenter.UpdateTimeout,
			HTTPClient:    opts.HTTPClient,
		})
		if err != nil {
			return nil, fmt.Errorf("engine: %w", err)
		}
		if e.router == nil {
			e.router = c
		}
		if e.updater == nil {
			e.updater = c
		}
	}
	if bs, ok := e.updater.(client.BatchSender); ok && cfg.Async.BatchWindow > 0 {
		e.batch = e.newBatcher(bs)
	} else if e.updater != nil {
		e.disp = client.NewDispatcher(client.DispatcherOptions{
			Workers:   cfg.Async.Workers,
			QueueSize: cfg.Async.QueueSize,
			Timeout:   cfg.MetadataCenter.UpdateTimeout,
			OnDrop: func(t client.Task) {
				e.metrics.Count("async_dropped", 1)
				e.warn("metadata-center update dropped (queue full or closed)", "task", t.Name, "request_id", t.Key)
			},
			OnResult: func(t client.Task, err error, took time.Duration) {
				if err != nil {
					e.metrics.Count("async_errors", 1)
					e.metrics.Count("metadata_center_errors", 1)
					e.warn("metadata-center update failed", "task", t.Name, "request_id", t.Key, "took", took, "err", err)
				}
			},
		})
	}
	return e, nil
}

// Close stops the dispatcher, draining queued updates for at most
// async.drain_timeout. Decide keeps working; later updates are dropped.
func (e *Engine) Close() {
	if e.disp != nil {
		e.disp.Close(e.cfg.Async.DrainTimeout)
	}
	if e.batch != nil {
		e.batch.Close(e.cfg.Async.DrainTimeout)
	}
}

// warn logs at most one line per second, counting what it held back.
func (e *Engine) warn(msg string, args ...any) {
	now := time.Now().UnixNano()
	last := e.lastWarn.Load()
	if now-last < int64(time.Second) || !e.lastWarn.CompareAndSwap(last, now) {
		e.suppressed.Add(1)
		return
	}
	if n := e.suppressed.Swap(0); n > 0 {
		args = append(args, "suppressed_since_last", n)
	}
	e.log.Warn(msg, args...)
}

// Config returns the engine's configuration (read only).
func (e *Engine) Config() *config.Config { return e.cfg }

// Error is a refused request: Status 400/404/413/..., Type as in docs/metadata-center.md, "Errors".
type Error struct {
	Status  int
	Type    string
	Message string
	TraceID string
}

func (e *Error) Error() string { return fmt.Sprintf("%d %s: %s", e.Status, e.Type, e.Message) }

// JSON renders the error body (docs/envoy-filter.md):
// {"error":{"code":N,"type":"...","message":"..."},"trace_id":"..."}.
func (e *Error) JSON() []byte {
	b, _ := json.Marshal(api.Error{
		Error:   api.ErrorDetail{Code: e.Status, Type: e.Type, Message: e.Message},
		TraceID: e.TraceID,
	})
	return b
}

// Decision is where one request goes and how.
type Decision struct {
	TraceID, Model, Cluster, Backend, SceneName, Policy string
	// Host is the chosen "ip:port" for SetUpstreamOverrideHost.
	Host string
	// Hashes are the prompt's chained block hashes, wire form.
	Hashes []string
	// PromptLength is the canonical prompt's size in bytes.
	PromptLength int
	Stream       bool
	// CacheRatio is the chosen host's matched share of the prompt's blocks.
	CacheRatio float64
	// PrefillLength is the prefill this request adds to its pod: the part
	// of the prompt the pod does not hold, PromptLength·(1−CacheRatio).
	// It is what the metadata center's prompt_length counts, so the score's
	// prefill term measures work still to do, not prompt bytes a cache will
	// skip — otherwise a pod serving cache hits would look as busy as one
	// prefilling cold prompts and repel the next request of its prefix.
	PrefillLength int
	// Degraded: the metadata center was not consulted successfully.
	Degraded bool
	// Candidates is the number of endpoints left after selector filtering.
	Candidates int
	// Body is the body to send upstream; nil = unchanged.
	Body []byte
	// Path is the new :path ("" = unchanged), e.g. Triton's generate.
	Path string
	// Response turns the backend's answers back into OpenAI form; nil for
	// pass-through backends.
	Response transcode.ResponseTranscoder
	// RouteQueryTook is how long the route query took, failures included
	// (0: the policy needs no metadata).
	RouteQueryTook time.Duration
	// RequestID names this request's lease at the metadata center; unique
	// per decision even when clients reuse trace ids.
	RequestID string

	flight *balancer.Flight
	state  atomic.Uint32 // lifecycle bits below
	// matched is the leading run of Hashes the index held for Host when
	// the request was routed: what a retraction must leave alone.
	matched int
	// served is the pod that really answered when it is not Host (Envoy's
	// non-strict override fell back to the cluster's load balancing); set
	// once by Served, before the lifecycle calls that follow it.
	served atomic.Pointer[string]
}

const (
	stClaimed uint32 = 1 << iota // Started is running: d.flight not yet published
	stStarted
	stFirstToken
	stSaved
	stDone
	stEarlySave // Started saved the prefix at routing time
	stServed    // Served moved the request to another pod
)

// mark sets bit and reports whether this call set it.
func (d *Decision) mark(bit uint32) bool {
	for {
		old := d.state.Load()
		if old&bit != 0 {
			return false
		}
		if d.state.CompareAndSwap(old, old|bit) {
			return true
		}
	}
}

func (d *Decision) has(bit uint32) bool { return d.state.Load()&bit != 0 }

type noHeaders struct{}

func (noHeaders) Get(string) (string, bool) { return "", false }

// traceID picks the request's trace id (docs/envoy-filter.md).
func traceID(h Headers) string {
	for _, k := range [...]string{"x-request-id", "x-trace-id", "x-amzn-trace-id"} {
		if v, ok := h.Get(k); ok && v != "" {
			return v
		}
	}
	return uuid.NewString()
}

func (e *Engine) reject(status int, typ, trace, format string, args ...any) *Error {
	e.metrics.Count("rejected", 1)
	return &Error{Status: status, Type: typ, Message: fmt.Sprintf(format, args...), TraceID: trace}
}

// Decide runs the decision (docs/envoy-filter.md) on a complete request body. The
// error, if any, is an *Error. It blocks at most for the route query's
// timeout (and never past ctx).
func (e *Engine) Decide(ctx context.Context, h Headers, body []byte) (*Decision, error) {
	if h == nil {
		h = noHeaders{}
	}
	trace := traceID(h)

	codec, err := e.codecs.Lookup(e.cfg.Protocol)
	if err != nil {
		return nil, e.reject(http.StatusBadRequest, transcode.TypeBadRequest, trace, "unsupported protocol %q", e.cfg.Protocol)
	}
	if len(body) > e.cfg.MaxBodyBytes {
		return nil, e.reject(http.StatusRequestEntityTooLarge, transcode.TypeTooLarge, trace,
			"request body of %d bytes exceeds max_body_bytes (%d)", len(body), e.cfg.MaxBodyBytes)
	}
	sc := e.getScratch()
	defer e.putScratch(sc)
	path, _ := h.Get(":path")
	var req *transcode.Request
	if bp, ok := codec.(bufferedParser); ok {
		// The prompt texts live in sc.texts: nothing of them outlives this
		// call, as the decision keeps the hashes, the model (decoded apart)
		// and upstream's own body.
		req, err = bp.ParseBuffered(path, body, &sc.texts)
	} else {
		req, err = codec.Parse(path, body)
	}
	if err != nil {
		return nil, e.fromTranscode(err, trace)
	}

	rule, res := e.rules.Match(req.Model, h)
	switch res {
	case rules.UnknownModel:
		return nil, e.reject(http.StatusNotFound, transcode.TypeNotFound, trace, "model not found: %q", req.Model)
	case rules.NoRuleMatched:
		return nil, e.reject(http.StatusNotFound, transcode.TypeNotFound, trace,
			"model not found: no rule of model %q matches the request headers", req.Model)
	}
	lb := e.cfg.LBMappingRule.For(rule.Cluster)

	sc.canon = req.AppendCanonical(sc.canon[:0])
	sc.sums = e.hasher.AppendSum(sc.sums[:0], req.Model, sc.canon)
	sums, promptLen := sc.sums, len(sc.canon)
	d := &Decision{
		TraceID:      trace,
		Model:        req.Model,
		Cluster:      rule.Cluster,
		Backend:      rule.Backend,
		SceneName:    rule.SceneName,
		Policy:       lb.Policy,
		Hashes:       prefix.Wire(sums),
		PromptLength: promptLen,
		Stream:       req.Stream,
	}

	policy, err := e.bal.Policy(lb.Policy)
	if err != nil {
		return nil, e.reject(http.StatusInternalServerError, transcode.TypeInternal, trace, "%v", err)
	}
	sc.eps = endpoints.Append(sc.eps[:0], e.src, rule.Cluster)
	all := sc.eps
	// Selectors match the labels pods registered with the metadata center
	// (docs/envoy-filter.md, label selectors), which the route query
	// answers: a selecting request asks even under a policy that needs no
	// load or cache.
	selecting := len(rule.Selector)+len(req.Selector) > 0
	view := balancer.View{Degraded: true}
	queried := false
	if len(all) > 0 && (policy.NeedsMetadata() || selecting) {
		t0 := time.Now()
		var pods map[string]api.PodLabels
		view, pods = e.query(ctx, trace, rule.Cluster, d.Hashes, sc)
		d.RouteQueryTook = time.Since(t0)
		queried = true
		all = withRegistered(all, pods)
	}
	cands := balancer.Filter(all, rule.Selector, req.Selector)
	cands = withoutAdapterPods(cands, rule.Selector, req.Selector)
	if len(cands) == 0 {
		if selecting && queried && view.Degraded && e.router != nil {
			return nil, e.reject(http.StatusServiceUnavailable, transcode.TypeUnavailable, trace,
				"no available endpoint in cluster %q%s: the metadata center, which holds the pods' registered labels, did not answer",
				rule.Cluster, selectorNote(rule.Selector, req.Selector))
		}
		return nil, e.reject(http.StatusNotFound, transcode.TypeNotFound, trace,
			"no available endpoint in cluster %q%s", rule.Cluster, selectorNote(rule.Selector, req.Selector))
	}
	choice, err := e.bal.Choose(rule.Cluster, lb, cands, view, balancer.Request{Blocks: len(sums), PromptLength: int64(promptLen)})
	if err != nil {
		if errors.Is(err, balancer.ErrNoEndpoint) {
			return nil, e.reject(http.StatusNotFound, transcode.TypeNotFound, trace, "no available endpoint in cluster %q", rule.Cluster)
		}
		return nil, e.reject(http.StatusInternalServerError, transcode.TypeInternal, trace, "%v", err)
	}
	d.Host = choice.Host.Address
	d.matched = view.Cache[d.Host]
	d.CacheRatio = choice.Host.CacheRatio
	d.PrefillLength = int(choice.Prefill)
	d.Degraded = policy.NeedsMetadata() && view.Degraded
	d.Candidates = choice.Candidates

	up, err := codec.Upstream(req, rule.Backend)
	if err != nil {
		return nil, e.fromTranscode(err, trace)
	}
	d.Body, d.Path, d.Response = up.Body, up.Path, up.Response
	d.RequestID = uuid.NewString()

	e.metrics.Count("routed", 1)
	if d.CacheRatio > 0 {
		e.metrics.Count("cache_hit_routes", 1)
	}
	if d.Degraded {
		e.metrics.Count("fallbacks", 1)
	}
	return d, nil
}

// withoutAdapterPods drops pods labelled lora=<adapter> unless a selector
// names an adapter: an adapter pod serves only requests for its adapters
// (docs/worker.md), so a base request sent there would get 404.
func withoutAdapterPods(eps []endpoints.Endpoint, sels ...map[string]string) []endpoints.Endpoint {
	for _, s := range sels {
		if _, ok := s[openai.LoRALabel]; ok {
			return eps
		}
	}
	return slices.DeleteFunc(eps, endpoints.Endpoint.AdapterPod)
}

func selectorNote(sels ...map[string]string) string {
	n := 0
	for _, s := range sels {
		n += len(s)
	}
	if n == 0 {
		return ""
	}
	merged := map[string]string{}
	for _, s := range sels {
		for k, v := range s {
			merged[k] = v
		}
	}
	b, _ := json.Marshal(merged)
	return " matching label selector " + string(b)
}

func (e *Engine) fromTranscode(err error, trace string) *Error {
	var te *transcode.Error
	if errors.As(err, &te) {
		return e.reject(te.Status, te.Type, trace, "%s", te.Message)
	}
	return e.reject(http.StatusBadRequest, transcode.TypeBadRequest, trace, "%v", err)
}

// query runs the route query; any failure degrades. It also
// returns the registered pods' labels.
func (e *Engine) query(ctx context.Context, trace, cluster string, hashes []string, sc *scratch) (balancer.View, map[string]api.PodLabels) {
	if e.router == nil {
		return balancer.View{Degraded: true}, nil
	}
	ctx, cancel := context.WithTimeout(ctx, e.qto)
	defer cancel()
	ans, err := e.router.Route(client.WithTraceID(ctx, trace), cluster, hashes)
	if err != nil {
		e.metrics.Count("metadata_center_errors", 1)
		e.warn("route query failed: routing without metadata", "trace_id", trace, "cluster", cluster, "err", err)
		return balancer.View{Degraded: true}, nil
	}
	v := balancer.View{Load: ans.Load, Signals: ans.Signals}
	if len(ans.Cache) > 0 {
		if sc.cache == nil {
			sc.cache = make(map[string]int, len(ans.Cache))
		}
		v.Cache = sc.cache
		for _, c := range ans.Cache {
			v.Cache[c.Host] = max(v.Cache[c.Host], c.Length)
		}
	}
	return v, ans.Pods
}

// Started reports that the request went upstream (addRequest: POST
// /v1/load/stats) and counts it locally until the metadata center has it.
// Each lifecycle method acts once per decision; later calls are no-ops.
func (e *Engine) Started(d *Decision) {
	if d == nil || !d.mark(stClaimed) {
		return
	}
	f := e.bal.Tracker().Begin(d.Cluster, d.Host, d.PrefillLength)
	d.flight = f
	d.mark(stStarted) // publishes d.flight to the other lifecycle calls
	if e.batch != nil && e.placesPrefix(d) {
		d.mark(stEarlySave)
		e.startedUrgent(d, func(err error) {
			if err == nil {
				f.Acked()
			}
		})
		return
	}
	e.addRequest(d, d.Host, f)
	// Record the prefix on its pod now, not only when the answer starts
	// (Saved, the seed's step): a cold prompt prefills for seconds, and every
	// request of the same prefix arriving meanwhile would be routed blind and
	// prefill it again elsewhere. The worker shares a running request's
	// computed cells, so followers really do reuse it. Saved confirms the
	// entry (and refreshes its TTL) once the pod answers; if the request
	// fails before its first token, Done withdraws this save (retract).
	//
	// The save names only the blocks the route answer did not already show
	// on the pod (placed): those it does were vouched for by whoever saved
	// them, and saving them again would make them this request's, so that
	// the retraction of the request whose save they were (refused by the
	// pod as this one may be: a burst) could no longer withdraw them, and
	// this one's retraction leaves them too (docs/metadata-center.md,
	// "Versions"). A fully matched prompt saves nothing; its confirmation
	// is still one that never inserts.
	if len(d.Hashes) > 0 {
		d.mark(stEarlySave)
		e.dispatch("place_cache", d, d.Host)
	}
}

// placed returns the hashes a routing-time save on the chosen pod names:
// those beyond the run the index already held there. A retraction on that
// pod withdraws the same ones (retractable).
func (d *Decision) placed() []string {
	hs := d.Hashes[min(d.matched, len(d.Hashes)):]
	if len(hs) > api.MaxHashes {
		hs = hs[:api.MaxHashes]
	}
	return hs
}

func (e *Engine) addRequest(d *Decision, host string, f *balancer.Flight) {
	e.dispatchDone("add_request", d, host, func(err error) {
		if err == nil {
			f.Acked()
		}
	})
}

// host is the pod the request's reports name: the one that really served
// it once Served said so, else the chosen one.
func (d *Decision) host() string {
	if p := d.served.Load(); p != nil {
		return *p
	}
	return d.Host
}

// Served reports that the pod that really answered is host, not the one
// chosen (Envoy's non-strict override: the chosen pod was not a healthy
// member of the routed cluster, and the cluster's load balancer picked
// another). The lease moves (done on the chosen pod, add on the real one),
// the prefix saved at routing time is withdrawn from the chosen pod, and
// the later reports (first token, save, done, a retraction) name host.
// Only after Started and before Done; once; no-op when host is the chosen
// pod or empty.
func (e *Engine) Served(d *Decision, host string) {
	if d == nil || host == "" || host == d.Host || !d.has(stStarted) || d.has(stDone) || !d.mark(stServed) {
		return
	}
	chosen := d.Host
	e.metrics.Count("served_elsewhere", 1)
	e.release(d, chosen)
	if d.has(stEarlySave) || d.has(stSaved) {
		if len(d.retractable(chosen)) > 0 {
			e.metrics.Count("retractions", 1)
		}
		e.dispatch("retract_cache", d, chosen)
	}
	d.served.Store(&host)
	// The real pod holds nothing of this prompt that we know of: its whole
	// prompt is prefill. Its answer has begun, so Saved (a 2xx) records the
	// prefix there right after this.
	f := e.bal.Tracker().Begin(d.Cluster, host, d.PromptLength)
	d.flight = f
	e.addRequest(d, host, f)
}

// FirstToken reports the end of prefill (deletePromptLength: DELETE
// /v1/load/stats/prompt). Only after Started.
func (e *Engine) FirstToken(d *Decision) {
	if d == nil || !d.has(stStarted) || !d.mark(stFirstToken) {
		return
	}
	d.flight.FirstToken()
	e.dispatch("first_token", d, d.host())
}

// Saved reports that the host now holds the prompt's KV cache (saveKVCache:
// POST /v1/cache/save). Only after Started.
//
// Where the entries are already in the index for that pod, the save is a
// confirmation (refresh_only): it renews them and never inserts. For a
// non-streamed answer the first token is the answer's end, the client's
// next turn may already have made the pod truncate the prompt's tail and
// report that eviction, and a confirmation landing after the report must
// not write the evicted blocks back (docs/metadata-center.md, "Versions").
func (e *Engine) Saved(d *Decision) {
	if d == nil || !d.has(stStarted) || len(d.Hashes) == 0 || !d.mark(stSaved) {
		return
	}
	host := d.host()
	if d.confirms(host) {
		e.dispatch("refresh_cache", d, host)
		return
	}
	e.dispatch("save_cache", d, host)
}

// confirms says whether Saved on host is a confirmation that never
// inserts: on the chosen pod, where the routing-time save put every block
// the index did not already hold. A non-streamed answer starts at its end;
// the client's next turn can make the pod truncate the prompt's tail and
// report that eviction before an inserting save lands, which would write
// the evicted block back. The price: a block the index held at routing
// time that is withdrawn before the confirmation lands (the retraction of
// the request whose save it was) stays out of the index though the pod
// built it — a miss, never a wrong entry. Not on a pod Envoy picked
// instead (Served): nothing was saved there, and the pod has just built
// the whole prompt, so that save inserts.
func (d *Decision) confirms(host string) bool {
	return host == d.Host && d.has(stEarlySave)
}

// Done reports the end of the request (decreaseRequest: DELETE
// /v1/load/stats) and releases the local in-flight count. Only after
// Started. A request that ends before its first token (the pod answered
// 429/5xx/408, the stream reset, no healthy upstream, the client left)
// never built the prompt's cache on its pod: the saves this request made
// are withdrawn first (POST /v1/cache/retract, docs/metadata-center.md),
// for the hashes beyond what the index already held there, and only where
// no other request saved them since.
func (e *Engine) Done(d *Decision) {
	if d == nil || !d.has(stStarted) || !d.mark(stDone) {
		return
	}
	// Served already withdrew the chosen pod's routing-time save.
	if !d.has(stFirstToken) && (d.has(stSaved) || d.has(stEarlySave) && !d.has(stServed)) {
		if len(d.retractable(d.host())) > 0 {
			e.metrics.Count("retractions", 1)
		}
		e.dispatch("retract_cache", d, d.host())
	}
	e.release(d, d.host())
}

// release ends the request's flight on host and reports its end there;
// the tracker keeps it off the metadata center's count of host until the
// report lands.
func (e *Engine) release(d *Decision, host string) {
	f := d.flight
	f.End()
	e.dispatchDone("delete_request", d, host, func(error) { f.Released() })
}

// retractable returns the hashes a retraction on host withdraws: what the
// routing-time save placed on the chosen pod, all of them on a pod Envoy
// picked.
func (d *Decision) retractable(host string) []string {
	if host == d.Host {
		return d.placed()
	}
	hs := d.Hashes
	if len(hs) > api.MaxHashes {
		hs = hs[:api.MaxHashes]
	}
	return hs
}

func (e *Engine) dispatch(name string, d *Decision, host string) {
	e.dispatchDone(name, d, host, nil)
}

// dispatchDone queues the update name of d for host; the batcher and the
// dispatcher both keep one request's updates in order.
func (e *Engine) dispatchDone(name string, d *Decision, host string, done func(error)) {
	if name == "retract_cache" && len(d.retractable(host)) == 0 || name == "place_cache" && len(d.placed()) == 0 {
		return // the index held the whole prompt there already
	}
	queued := false
	switch {
	case e.batch != nil:
		queued = e.batch.Add(e.batchOp(name, d, host), done)
	case e.disp != nil && e.updater != nil:
		trace := d.TraceID
		run := e.updateFor(name, d, host)
		queued = e.disp.Dispatch(client.Task{Name: name, Key: d.RequestID, Done: done,
			Run: func(ctx context.Context) error { return run(client.WithTraceID(ctx, trace)) }})
	}
	if !queued && done != nil {
		done(errNotSent) // dropped, or no metadata center: local accounting only
	}
}

// errNotSent is the outcome of an update that was never sent.
var errNotSent = errors.New("metadata-center update not sent")

// Retracter is implemented by Updaters that can withdraw a save
// (*client.Client); without it a failed request's save is left to the
// worker's eviction reports and the TTL.
type Retracter interface {
	RetractCache(ctx context.Context, r api.CacheRetract) error
}

// updateFor is the single call of update name, for the dispatcher: the
// batch op (batchOp, the one place a step's fields are chosen) as a call
// of the Updater.
func (e *Engine) updateFor(name string, d *Decision, host string) func(context.Context) error {
	u, op := e.updater, e.batchOp(name, d, host)
	ref := api.RequestRef{Cluster: op.Cluster, Host: op.Host, RequestID: op.RequestID}
	switch op.Op {
	case api.OpAddRequest:
		r := api.AddRequest{Cluster: op.Cluster, Host: op.Host, RequestID: op.RequestID, PromptLength: op.PromptLength}
		return func(ctx context.Context) error { return u.AddRequest(ctx, r) }
	case api.OpFirstToken:
		return func(ctx context.Context) error { return u.FirstToken(ctx, ref) }
	case api.OpDone:
		return func(ctx context.Context) error { return u.DeleteRequest(ctx, ref) }
	case api.OpCacheSave:
		r := api.CacheSave{Cluster: op.Cluster, Host: op.Host, Hashes: op.Hashes, ChunkSize: op.ChunkSize, SaveID: op.SaveID, RefreshOnly: op.RefreshOnly}
		return func(ctx context.Context) error { return u.SaveCache(ctx, r) }
	case api.OpCacheRetract:
		r := api.CacheRetract{Cluster: op.Cluster, Host: op.Host, Hashes: op.Hashes, SaveID: op.SaveID}
		return func(ctx context.Context) error {
			if rt, ok := u.(Retracter); ok {
				return rt.RetractCache(ctx, r)
			}
			return nil
		}
	}
	return func(context.Context) error { return fmt.Errorf("engine: unknown update %q", name) }
}

// InFlight returns this engine's local count of requests routed to host
// and not done, and how many of them the metadata center has not yet
// acknowledged (tests, debugging).
func (e *Engine) InFlight(cluster, host string) (inflight, unacked int64) {
	return e.bal.Tracker().InFlight(cluster, host)
}

// Pending is the number of queued metadata-center updates.
func (e *Engine) Pending() int {
	if e.batch != nil {
		return e.batch.Pending()
	}
	if e.disp == nil {
		return 0
	}
	return e.disp.Pending()
}
