// Package routing is the gateway's decision, independent of Envoy and of
// what happens to the request afterwards: the Envoy StreamFilter and the
// standalone gateway both hand a Decider a complete request and get back
// where to send it (docs/envoy-filter.md). Reporting the request's lifecycle
// is filter/lifecycle's.
//
// Decide runs: trace id → transcoder → parse → rule match → prompt hash →
// endpoints and label selectors → one route query to the metadata center
// (bounded by query_timeout; on failure equal load and zero cache) →
// draining pods dropped → policy → upstream body.
//
// Metrics (Options.Metrics.Count) are counted under these names:
//
//	routed                  a decision was made
//	cache_hit_routes        ... to a pod holding part of the prompt (CacheRatio > 0)
//	fallbacks               ... without metadata (query failed or no metadata center)
//	metadata_center_errors  a route query failed
//	rejected                Decide refused the request (any *Error)
package routing

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"sync"
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
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/internal/ratelog"
	"github.com/istio-llm-filter/istio-llm-filter/internal/secretfile"
	"github.com/istio-llm-filter/istio-llm-filter/internal/tracing"
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

// Querier answers the route query and lists a cluster's registered pods;
// *client.Client is the real one.
type Querier interface {
	Route(ctx context.Context, cluster string, hashes []string) (*api.RouteAnswer, error)
	Pods(ctx context.Context, cluster string) (map[string]api.PodRegistration, error)
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
	// Querier replaces the metadata-center client (benchmarks without
	// network, tests).
	Querier Querier
	// Transcoders adds or replaces protocols by name.
	Transcoders map[string]transcode.Transcoder
	// Policies adds or replaces load-balancing policies by name; Scorers
	// adds scorers for the lb rule's `scorers` key.
	Policies map[string]balancer.Policy
	Scorers  map[string]balancer.Scorer
	// Registerer, if set, gets the balancer's per-stage latency histogram.
	Registerer prometheus.Registerer
}

// Decider decides where requests go; safe for concurrent use.
type Decider struct {
	cfg     *config.Config
	log     *slog.Logger
	warn    *ratelog.Logger
	metrics Metrics
	src     endpoints.Source
	codecs  transcode.Registry
	rules   *rules.Table
	hasher  prefix.Hasher
	bal     *balancer.Balancer
	querier Querier
	qto     time.Duration

	// scratch pools per-decision buffers (*scratch). Garbage is what sets
	// a decision's tail: on two cores every collection cycle's mark phase
	// slows the decisions it overlaps, so fewer bytes mean fewer cycles.
	scratch sync.Pool
}

// scratch is what one decision needs only until it returns: the prompt
// texts and canonical prompt (until hashed), its block sums (until
// rendered to wire form) and the cache view of the route answer (until
// scored).
type scratch struct {
	texts []byte // the parsed request's prompt texts (bufferedParser)
	canon []byte
	sums  []prefix.Hash
	ends  []int // where each block of sums ends in canon
	cache map[string]int
	eps   []endpoints.Endpoint // the cluster's endpoints (endpoints.Append)
}

// bufferedParser is a transcoder that reads the content-type (a multipart
// body's boundary) and decodes prompt texts into a buffer the caller owns
// (openai.Transcoder.ParseHTTP).
type bufferedParser interface {
	ParseHTTP(path, contentType string, body []byte, texts *[]byte) (*transcode.Request, error)
}

// maxPooledCanonical keeps one huge prompt from pinning its buffers forever.
const maxPooledCanonical = 1 << 20

// maxPooledEndpoints does the same for a huge cluster's endpoint list.
const maxPooledEndpoints = 4096

func (e *Decider) getScratch() *scratch {
	if sc, _ := e.scratch.Get().(*scratch); sc != nil {
		return sc
	}
	return &scratch{}
}

func (e *Decider) putScratch(sc *scratch) {
	if cap(sc.canon) > maxPooledCanonical {
		sc.canon = nil
		sc.sums = nil
		sc.ends = nil
	}
	if cap(sc.texts) > maxPooledCanonical {
		sc.texts = nil
	}
	sc.texts, sc.canon, sc.sums, sc.ends = sc.texts[:0], sc.canon[:0], sc.sums[:0], sc.ends[:0]
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

// NopMetrics counts nothing.
type NopMetrics struct{}

// Count does nothing.
func (NopMetrics) Count(string, int64) {}

// New builds a Decider. With a metadata center configured and no
// Options.Querier, it queries the metadata center through its own client.
func New(cfg *config.Config, opts Options) (*Decider, error) {
	if cfg == nil {
		return nil, errors.New("routing: nil config")
	}
	if opts.Endpoints == nil {
		return nil, errors.New("routing: Options.Endpoints is required")
	}
	e := &Decider{
		cfg:     cfg,
		log:     opts.Logger,
		metrics: opts.Metrics,
		src:     opts.Endpoints,
		rules:   rules.New(cfg.ModelMappingRule),
		hasher:  prefix.Hasher{ChunkSize: cfg.PromptHash.ChunkSize},
		bal: balancer.New(balancer.Options{IntN: opts.IntN, Policies: opts.Policies, Scorers: opts.Scorers,
			Logger: opts.Logger, Registerer: opts.Registerer}),
		querier: opts.Querier,
		qto:     cfg.MetadataCenter.QueryTimeout,
	}
	if e.log == nil {
		e.log = slog.Default()
	}
	e.warn = ratelog.New(e.log)
	if e.metrics == nil {
		e.metrics = NopMetrics{}
	}
	if e.qto <= 0 {
		e.qto = config.DefaultQueryTimeout
	}
	if err := e.bal.Check(cfg.LBMappingRule.Default); err != nil {
		return nil, fmt.Errorf("routing: lb_mapping_rule.default: %w", err)
	}
	for cluster, r := range cfg.LBMappingRule.Clusters {
		if err := e.bal.Check(r); err != nil {
			return nil, fmt.Errorf("routing: lb_mapping_rule.%s: %w", cluster, err)
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
	if e.querier == nil {
		c, err := MetadataCenter(cfg, opts.HTTPClient)
		if err != nil {
			return nil, err
		}
		if c != nil {
			e.querier = c
		}
	}
	return e, nil
}

// MetadataCenter is the client of the configured metadata center, nil
// when none is configured; routing and the lifecycle reports share one.
func MetadataCenter(cfg *config.Config, hc *http.Client) (*client.Client, error) {
	if cfg.MetadataCenter.Address == "" {
		return nil, nil
	}
	mc := cfg.MetadataCenter
	o := client.Options{
		Address:       mc.Address,
		AuthToken:     mc.AuthToken,
		AuthTokenFile: mc.AuthTokenFile,
		QueryTimeout:  mc.QueryTimeout,
		UpdateTimeout: mc.UpdateTimeout,
		HTTPClient:    hc,
	}
	if mc.TLS != nil {
		tc, err := secretfile.ClientTLS(mc.TLS.CAFile, mc.TLS.ServerName, mc.TLS.InsecureSkipVerify)
		if err != nil {
			return nil, fmt.Errorf("metadata center: tls: %w", err)
		}
		o.TLS = tc
	}
	c, err := client.New(o)
	if err != nil {
		return nil, fmt.Errorf("metadata center: %w", err)
	}
	return c, nil
}

// Config returns the decider's configuration (read only).
func (e *Decider) Config() *config.Config { return e.cfg }

// Tracker is the balancer's count of requests in flight per pod, which
// the lifecycle reports keep (filter/lifecycle) and every decision reads.
func (e *Decider) Tracker() *balancer.Tracker { return e.bal.Tracker() }

// Balancer is the decider's balancer, whose cost model the lifecycle
// reports check against what they observe (filter/lifecycle, Options.Checker).
func (e *Decider) Balancer() *balancer.Balancer { return e.bal }

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

	// Matched is the leading run of Hashes the index held for Host when
	// the request was routed: what a retraction must leave alone.
	Matched int

	// Prediction is Host's predicted time to first token for this request
	// (filter/balancer, ttft.go), whatever the policy: the answer states it
	// (headers.PredictedTTFT) and the first token checks it
	// (filter/lifecycle, Balancer.Observe).
	Prediction balancer.Prediction
	// MaxBlocks bounds what the index keeps of Host (balancer.Choice);
	// the saves of the prompt's prefix on Host carry it. 0: no bound.
	MaxBlocks int
}

// Prompt is the decision's whole prompt as the balancer's tracker counts it
// on its pod (balancer.Tracker.Begin).
func (d *Decision) Prompt() balancer.Request {
	return balancer.Request{PromptLength: int64(d.PromptLength), Hashes: d.Hashes}
}

type subsetKey struct{}

// WithSubset restricts the decisions made under the returned context to
// the endpoints whose "ip:port" allow admits: the endpoint picker's
// subset hint (a gateway naming the pods it may use). When it admits none
// of the rule's cluster, Decide refuses with 503, as the endpoint-picker
// protocol asks.
func WithSubset(ctx context.Context, allow func(addr string) bool) context.Context {
	return context.WithValue(ctx, subsetKey{}, allow)
}

type noHeaders struct{}

func (noHeaders) Get(string) (string, bool) { return "", false }

// traceID picks the request's trace id (docs/envoy-filter.md).
func traceID(h Headers) string {
	for _, k := range headers.TraceIDs {
		if v, ok := h.Get(k); ok && v != "" {
			return v
		}
	}
	return uuid.NewString()
}

func (e *Decider) reject(status int, typ, trace, format string, args ...any) *Error {
	e.metrics.Count("rejected", 1)
	return &Error{Status: status, Type: typ, Message: fmt.Sprintf(format, args...), TraceID: trace}
}

// Decide runs the decision (docs/envoy-filter.md) on a complete request body. The
// error, if any, is an *Error. It blocks at most for the route query's
// timeout (and never past ctx).
func (e *Decider) Decide(ctx context.Context, h Headers, body []byte) (*Decision, error) {
	ctx, span := tracing.Start(ctx, "routing.decide")
	defer span.End()
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
		ct, _ := h.Get("content-type")
		req, err = bp.ParseHTTP(path, ct, body, &sc.texts)
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
	sc.sums, sc.ends = e.hasher.AppendBlocks(sc.sums[:0], sc.ends[:0], req.Model, sc.canon)
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
	if allow, ok := ctx.Value(subsetKey{}).(func(string) bool); ok {
		sc.eps = slices.DeleteFunc(sc.eps, func(ep endpoints.Endpoint) bool { return !allow(ep.Address) })
		if len(sc.eps) == 0 {
			return nil, e.reject(http.StatusServiceUnavailable, transcode.TypeUnavailable, trace,
				"no endpoint of cluster %q is in the subset the gateway allows", rule.Cluster)
		}
	}
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
		view.Asked = t0 // when the query was sent (View.Asked)
		d.RouteQueryTook = time.Since(t0)
		queried = true
		all = withRegistered(all, pods)
	}
	cands := balancer.Filter(all, rule.Selector, req.Selector)
	cands = withoutAdapterPods(cands, rule.Selector, req.Selector)
	cands = e.withoutDraining(cands, view.Signals, trace, rule.Cluster)
	if len(cands) == 0 {
		if selecting && queried && view.Degraded && e.querier != nil {
			return nil, e.reject(http.StatusServiceUnavailable, transcode.TypeUnavailable, trace,
				"no available endpoint in cluster %q%s: the metadata center, which holds the pods' registered labels, did not answer",
				rule.Cluster, selectorNote(rule.Selector, req.Selector))
		}
		return nil, e.reject(http.StatusNotFound, transcode.TypeNotFound, trace,
			"no available endpoint in cluster %q%s", rule.Cluster, selectorNote(rule.Selector, req.Selector))
	}
	// The canonical prompt lives in sc.canon, reused once Decide returns:
	// policies read it during Choose only (the epp stand-in keeps block
	// hashes of it, never the bytes).
	choice, err := e.bal.Choose(rule.Cluster, lb, cands, view, balancer.Request{Blocks: len(sums), Hashes: d.Hashes, PromptLength: int64(promptLen),
		ChunkSize: e.hasher.ChunkSize, Ends: sc.ends, Model: req.Model, Prompt: sc.canon})
	if err != nil {
		if errors.Is(err, balancer.ErrNoEndpoint) {
			return nil, e.reject(http.StatusNotFound, transcode.TypeNotFound, trace, "no available endpoint in cluster %q", rule.Cluster)
		}
		return nil, e.reject(http.StatusInternalServerError, transcode.TypeInternal, trace, "%v", err)
	}
	d.Host = choice.Host.Address
	d.Matched = view.Cache[d.Host]
	d.CacheRatio = choice.Host.CacheRatio
	d.PrefillLength = int(choice.Prefill)
	d.Degraded = policy.NeedsMetadata() && view.Degraded
	d.Candidates = choice.Candidates
	d.Prediction = choice.Prediction
	d.MaxBlocks = choice.MaxBlocks

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

// withoutDraining drops the pods whose report says they drain (a worker
// shutting down answers new requests 503), unless every candidate does:
// then a drained pod's 503 with Retry-After is still the best answer, and
// the client's retry finds the next pod. One debug line per pod dropped.
func (e *Decider) withoutDraining(eps []endpoints.Endpoint, sig map[string]api.PodSignals, trace, cluster string) []endpoints.Endpoint {
	if len(sig) == 0 {
		return eps
	}
	n := 0
	for _, ep := range eps {
		if sig[ep.Address].Draining {
			n++
		}
	}
	if n == 0 || n == len(eps) {
		return eps
	}
	return slices.DeleteFunc(eps, func(ep endpoints.Endpoint) bool {
		if !sig[ep.Address].Draining {
			return false
		}
		e.log.Debug("pod not routed to: it reports that it drains (shutting down, new requests get 503)",
			"trace_id", trace, "cluster", cluster, "host", ep.Address)
		return true
	})
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

func (e *Decider) fromTranscode(err error, trace string) *Error {
	var te *transcode.Error
	if errors.As(err, &te) {
		return e.reject(te.Status, te.Type, trace, "%s", te.Message)
	}
	return e.reject(http.StatusBadRequest, transcode.TypeBadRequest, trace, "%v", err)
}

// query runs the route query; any failure degrades. It also
// returns the registered pods' labels.
func (e *Decider) query(ctx context.Context, trace, cluster string, hashes []string, sc *scratch) (balancer.View, map[string]api.PodLabels) {
	if e.querier == nil {
		return balancer.View{Degraded: true}, nil
	}
	ctx, cancel := context.WithTimeout(ctx, e.qto)
	defer cancel()
	ans, err := e.querier.Route(client.WithTraceID(ctx, trace), cluster, hashes)
	if err != nil {
		e.metrics.Count("metadata_center_errors", 1)
		e.warn.Warn("route query failed: routing without metadata", "trace_id", trace, "cluster", cluster, "err", err)
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
