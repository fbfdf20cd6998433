// Package lifecycle reports what becomes of a routed request — started,
// served elsewhere, first token, cache saved, done (docs/envoy-filter.md,
// "Phases") — to the metadata center, so that its load and cache figures
// stay true, and keeps the local count of requests in flight per pod that
// every decision reads (filter/routing). Reports are queued on a bounded
// dispatcher (or batcher) and never block.
//
// Metrics (Options.Metrics.Count) are counted under these names:
//
//	metadata_center_errors  an update failed
//	async_dropped           an update was dropped: queue full or reporter closed
//	async_errors            an update ran and failed
//	async_batches           a batch of updates was sent
//	retractions             a request that failed before its first token withdrew its saves
//	served_elsewhere        the pod that answered was not the chosen one (Served)
//
// The reports also check the decision's cost model (Options.Checker): the
// first token hands the chosen pod's predicted time to first token and the
// one observed since Started to Balancer.Observe, the answer's
// usage.prompt_tokens (ResponseData) teaches the model's bytes per token,
// and its cached_tokens check what the decision believed the pod held of the
// prompt (Balancer.ObserveCache).
package lifecycle

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/balancer"
	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/internal/ratelog"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
)

// Updater sends the lifecycle updates, one by one or batched (POST
// /v1/batch, async.batch_window); *client.Client is the real one.
type Updater interface {
	AddRequest(ctx context.Context, r api.AddRequest) error
	FirstToken(ctx context.Context, r api.RequestRef) error
	DeleteRequest(ctx context.Context, r api.RequestRef) error
	SaveCache(ctx context.Context, r api.CacheSave) error
	RetractCache(ctx context.Context, r api.CacheRetract) error
	Batch(ctx context.Context, ops []api.BatchOp) error
}

// Options of New.
type Options struct {
	// Tracker is the decider's count of requests in flight
	// (routing.Decider.Tracker); nil = one of the reporter's own.
	Tracker *balancer.Tracker
	// Updater replaces the metadata-center client (tests). Without it and
	// without a configured metadata center, reports are local only.
	Updater    Updater
	HTTPClient *http.Client // for the metadata center; default client.NewTransport
	Metrics    routing.Metrics
	Logger     *slog.Logger // default slog.Default()
	// Checker is the decider's cost model (routing.Decider.Balancer); nil =
	// predictions are not checked.
	Checker Checker
}

// Checker checks predictions against what the gateway observes;
// *balancer.Balancer is the real one.
type Checker interface {
	// Observe checks a decision's prediction against the TTFT observed.
	Observe(p balancer.Prediction, observed time.Duration)
	// BytesPerToken is the model's learnt prompt bytes per token.
	BytesPerToken(model string) *balancer.BytesPerToken
	// ObserveCache checks what a decision believed its pod held of the
	// prompt against what the pod served from its KV cache (the answer's
	// usage: prompt tokens, cached tokens).
	ObserveCache(p balancer.Prediction, promptTokens, cachedTokens int64)
}

// Reporter sends the lifecycle reports of the requests it is given; safe
// for concurrent use.
type Reporter struct {
	cfg     *config.Config
	warn    *ratelog.Logger
	metrics routing.Metrics
	tracker *balancer.Tracker
	updater Updater
	checker Checker
	chunk   int                // the prompt hash's block size, for saves
	disp    *client.Dispatcher // set when updates go one by one
	batch   *client.Batcher    // set when updates are batched (async.batch_window)
}

// New builds a Reporter and starts its dispatcher.
func New(cfg *config.Config, opts Options) (*Reporter, error) {
	if cfg == nil {
		return nil, errors.New("lifecycle: nil config")
	}
	l := &Reporter{
		cfg:     cfg,
		warn:    ratelog.New(opts.Logger),
		metrics: opts.Metrics,
		tracker: opts.Tracker,
		updater: opts.Updater,
		checker: opts.Checker,
		chunk:   cfg.PromptHash.ChunkSize,
	}
	if l.metrics == nil {
		l.metrics = routing.NopMetrics{}
	}
	if l.tracker == nil {
		l.tracker = balancer.NewTracker()
	}
	if l.updater == nil {
		c, err := routing.MetadataCenter(cfg, opts.HTTPClient)
		if err != nil {
			return nil, err
		}
		if c != nil {
			l.updater = c
		}
	}
	switch {
	case l.updater == nil:
	case cfg.Async.BatchWindow > 0:
		l.batch = l.newBatcher(l.updater)
	default:
		l.disp = client.NewDispatcher(client.DispatcherOptions{
			Workers:   cfg.Async.Workers,
			QueueSize: cfg.Async.QueueSize,
			Timeout:   cfg.MetadataCenter.UpdateTimeout,
			OnDrop: func(t client.Task) {
				l.metrics.Count("async_dropped", 1)
				l.warn.Warn("metadata-center update dropped (queue full or closed)", "task", t.Name, "request_id", t.Key)
			},
			OnResult: func(t client.Task, err error, took time.Duration) {
				if err != nil {
					l.metrics.Count("async_errors", 1)
					l.metrics.Count("metadata_center_errors", 1)
					l.warn.Warn("metadata-center update failed", "task", t.Name, "request_id", t.Key, "took", took, "err", err)
				}
			},
		})
	}
	return l, nil
}

// Close stops the dispatcher, draining queued updates for at most
// async.drain_timeout. Later reports keep the local count; their updates
// are dropped.
func (l *Reporter) Close() {
	if l.disp != nil {
		l.disp.Close(l.cfg.Async.DrainTimeout)
	}
	if l.batch != nil {
		l.batch.Close(l.cfg.Async.DrainTimeout)
	}
}

// Request is one routed request's lifecycle: its decision and what has
// been reported of it. Each lifecycle method acts once per request; later
// calls are no-ops.
type Request struct {
	*routing.Decision

	flight *balancer.Flight
	state  atomic.Uint32 // lifecycle bits below
	// served is the pod that really answered when it is not Host (Envoy's
	// non-strict override fell back to the cluster's load balancing); set
	// once by Served, before the lifecycle calls that follow it.
	served atomic.Pointer[string]
	// upstream is when Started sent the request upstream: the first
	// token's observed TTFT counts from it.
	upstream time.Time
	// usage finds usage.prompt_tokens and cached_tokens in the answer
	// (ResponseData, called from the response path only, one call at a
	// time).
	usage usage
}

// NewRequest starts the lifecycle record of a decision.
func NewRequest(d *routing.Decision) *Request { return &Request{Decision: d} }

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
func (d *Request) mark(bit uint32) bool {
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

func (d *Request) has(bit uint32) bool { return d.state.Load()&bit != 0 }

// Started reports that the request went upstream (addRequest: POST
// /v1/load/stats) and counts it locally until the metadata center has it.
// Each lifecycle method acts once per request; later calls are no-ops.
func (l *Reporter) Started(d *Request) {
	if d == nil || !d.mark(stClaimed) {
		return
	}
	f := l.tracker.Begin(d.Cluster, d.Host, d.PrefillLength, d.Prompt())
	d.flight = f
	d.upstream = time.Now()
	d.mark(stStarted) // publishes d.flight and d.upstream to the other lifecycle calls
	if l.batch != nil && l.placesPrefix(d) {
		d.mark(stEarlySave)
		l.startedUrgent(d, func(err error) {
			if err == nil {
				f.Acked()
			}
		})
		return
	}
	l.addRequest(d, d.Host, f)
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
		l.dispatch("place_cache", d, d.Host)
	}
}

// placed returns the hashes a routing-time save on the chosen pod names:
// those beyond the run the index already held there. A retraction on that
// pod withdraws the same ones (retractable).
func (d *Request) placed() []string {
	hs := d.Hashes[min(d.Matched, len(d.Hashes)):]
	if len(hs) > api.MaxHashes {
		hs = hs[:api.MaxHashes]
	}
	return hs
}

func (l *Reporter) addRequest(d *Request, host string, f *balancer.Flight) {
	l.dispatchDone("add_request", d, host, func(err error) {
		if err == nil {
			f.Acked()
		}
	})
}

// host is the pod the request's reports name: the one that really served
// it once Served said so, else the chosen one.
func (d *Request) host() string {
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
func (l *Reporter) Served(d *Request, host string) {
	if d == nil || host == "" || host == d.Host || !d.has(stStarted) || d.has(stDone) || !d.mark(stServed) {
		return
	}
	chosen := d.Host
	l.metrics.Count("served_elsewhere", 1)
	l.release(d, chosen)
	if d.has(stEarlySave) || d.has(stSaved) {
		if len(d.retractable(chosen)) > 0 {
			l.metrics.Count("retractions", 1)
		}
		l.dispatch("retract_cache", d, chosen)
	}
	d.served.Store(&host)
	// The real pod holds nothing of this prompt that we know of: its whole
	// prompt is prefill. Its answer has begun, so Saved (a 2xx) records the
	// prefix there right after this.
	f := l.tracker.Begin(d.Cluster, host, d.PromptLength, d.Prompt())
	d.flight = f
	l.addRequest(d, host, f)
}

// FirstToken reports the end of prefill (deletePromptLength: DELETE
// /v1/load/stats/prompt) and checks the decision's predicted TTFT against
// the time since Started (Checker.Observe), unless another pod served the
// request (Served): its TTFT says nothing of the chosen pod. Only after
// Started.
func (l *Reporter) FirstToken(d *Request) {
	if d == nil || !d.has(stStarted) || !d.mark(stFirstToken) {
		return
	}
	f := d.flight
	f.FirstToken()
	if l.checker != nil && !d.has(stServed) {
		l.checker.Observe(d.Prediction, time.Since(d.upstream))
	}
	l.dispatchDone("first_token", d, d.host(), func(error) { f.FirstTokenLanded() })
}

// ResponseData reads one piece of the answer as the client receives it
// (a JSON body, or a stream's events), in order: the first
// usage.prompt_tokens it finds teaches the request's model its bytes per
// token (Checker.BytesPerToken), against the canonical prompt's bytes; with
// the usage's cached_tokens it checks what the decision believed the pod
// held of the prompt (Checker.ObserveCache), unless another pod served the
// request (Served). Called from the response path, one call at a time per
// request.
func (l *Reporter) ResponseData(d *Request, p []byte) {
	if d == nil || l.checker == nil || d.usage.checked {
		return
	}
	u := &d.usage
	if tokens, ok := u.feed(p); ok {
		l.checker.BytesPerToken(d.Model).Observe(int64(d.PromptLength), tokens)
	}
	if u.prompt.found && u.cached.found {
		u.checked = true
		if !d.has(stServed) {
			l.checker.ObserveCache(d.Prediction, u.promptTokens, u.cachedTokens)
		}
	}
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
func (l *Reporter) Saved(d *Request) {
	if d == nil || !d.has(stStarted) || len(d.Hashes) == 0 || !d.mark(stSaved) {
		return
	}
	host := d.host()
	if d.confirms(host) {
		l.dispatch("refresh_cache", d, host)
		return
	}
	l.dispatch("save_cache", d, host)
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
func (d *Request) confirms(host string) bool {
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
func (l *Reporter) Done(d *Request) {
	if d == nil || !d.has(stStarted) || !d.mark(stDone) {
		return
	}
	// Served already withdrew the chosen pod's routing-time save.
	if !d.has(stFirstToken) && (d.has(stSaved) || d.has(stEarlySave) && !d.has(stServed)) {
		if len(d.retractable(d.host())) > 0 {
			l.metrics.Count("retractions", 1)
		}
		l.dispatch("retract_cache", d, d.host())
	}
	l.release(d, d.host())
}

// release ends the request's flight on host and reports its end there;
// the tracker keeps it off the metadata center's count of host until the
// report lands.
func (l *Reporter) release(d *Request, host string) {
	f := d.flight
	f.End()
	l.dispatchDone("delete_request", d, host, func(error) { f.Released() })
}

// retractable returns the hashes a retraction on host withdraws: what the
// routing-time save placed on the chosen pod, all of them on a pod Envoy
// picked.
func (d *Request) retractable(host string) []string {
	if host == d.Host {
		return d.placed()
	}
	hs := d.Hashes
	if len(hs) > api.MaxHashes {
		hs = hs[:api.MaxHashes]
	}
	return hs
}

func (l *Reporter) dispatch(name string, d *Request, host string) {
	l.dispatchDone(name, d, host, nil)
}

// dispatchDone queues the update name of d for host; the batcher and the
// dispatcher both keep one request's updates in order.
func (l *Reporter) dispatchDone(name string, d *Request, host string, done func(error)) {
	if name == "retract_cache" && len(d.retractable(host)) == 0 || name == "place_cache" && len(d.placed()) == 0 {
		return // the index held the whole prompt there already
	}
	queued := false
	switch {
	case l.batch != nil:
		queued = l.batch.Add(l.batchOp(name, d, host), done)
	case l.disp != nil && l.updater != nil:
		trace := d.TraceID
		run := l.updateFor(name, d, host)
		queued = l.disp.Dispatch(client.Task{Name: name, Key: d.RequestID, Done: done,
			Run: func(ctx context.Context) error { return run(client.WithTraceID(ctx, trace)) }})
	}
	if !queued && done != nil {
		done(errNotSent) // dropped, or no metadata center: local accounting only
	}
}

// errNotSent is the outcome of an update that was never sent.
var errNotSent = errors.New("metadata-center update not sent")

// updateFor is the single call of update name, for the dispatcher: the
// batch op (batchOp, the one place a step's fields are chosen) as a call
// of the Updater.
func (l *Reporter) updateFor(name string, d *Request, host string) func(context.Context) error {
	u, op := l.updater, l.batchOp(name, d, host)
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
		r := api.CacheSave{Cluster: op.Cluster, Host: op.Host, Hashes: op.Hashes, ChunkSize: op.ChunkSize, SaveID: op.SaveID, RefreshOnly: op.RefreshOnly,
			MaxEntries: op.MaxEntries}
		return func(ctx context.Context) error { return u.SaveCache(ctx, r) }
	case api.OpCacheRetract:
		r := api.CacheRetract{Cluster: op.Cluster, Host: op.Host, Hashes: op.Hashes, SaveID: op.SaveID}
		return func(ctx context.Context) error { return u.RetractCache(ctx, r) }
	}
	return func(context.Context) error { return fmt.Errorf("lifecycle: unknown update %q", name) }
}

// InFlight returns this reporter's local count of requests routed to host
// and not done, and how many of them the metadata center has not yet
// acknowledged (tests, debugging).
func (l *Reporter) InFlight(cluster, host string) (inflight, unacked int64) {
	return l.tracker.InFlight(cluster, host)
}

// Pending is the number of queued metadata-center updates.
func (l *Reporter) Pending() int {
	if l.batch != nil {
		return l.batch.Pending()
	}
	if l.disp == nil {
		return 0
	}
	return l.disp.Pending()
}
