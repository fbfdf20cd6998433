// Package mcreport tells the metadata center which prompt prefixes this
// worker no longer holds, so the router's cache index stays true.
//
// At start-up it sends {all: true} for this host: a restarted pod has an
// empty KV cache, and whatever the index remembered about it is stale. After
// that, every hash the KV-cache manager reports (no entry holds it any more)
// is queued and sent in POST /v1/cache/evict batches. Sending is
// asynchronous and never blocks the scheduler: the pending set is bounded,
// coalesces duplicates, and retries with backoff while the metadata center
// is unreachable. Hashes dropped because the set is full are counted; the
// metadata center's TTL ages those index entries out.
package mcreport

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-llm-filter/istio-llm-filter/internal/secretfile"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// sendTimeout bounds one report; a metadata center slower than that is
// treated as down and retried with backoff.
const sendTimeout = 5 * time.Second

// Config of a reporter.
type Config struct {
	URL       string // metadata center base URL, e.g. http://127.0.0.1:8080
	Cluster   string // the Envoy cluster name the router indexes this host under
	Host      string // this worker as ip:port, as the router addresses it
	AuthToken string // optional bearer token
	// AuthTokenFile, instead of AuthToken, is a file holding the token
	// (a mounted Secret), read again when it changes.
	AuthTokenFile string
	// CAFile and ServerName verify an https:// metadata center
	// (secretfile.ClientTLS): the PEM CA bundle (empty: the system's roots)
	// and the name its certificate must carry (empty: the URL's host).
	CAFile, ServerName string
	// ChunkSize is the prompt-hash chunk size the hashes were made with;
	// the metadata center refuses reports whose size its gateways do not use.
	ChunkSize  int
	Client     *http.Client
	MaxPending int // distinct hashes waiting; default 65536
	// MaxBackoff caps the wait between retries; default 500 ms, so that
	// once the center answers again every eviction queued during its
	// outage lands within that and a send (the index is wrong meanwhile;
	// docs/operations.md, "Chaos and soak").
	MaxBackoff time.Duration
	Logger     *slog.Logger
	Registerer prometheus.Registerer
	// Registration, when set, is what RunSignals registers this pod as
	// (labels, models, LoRA adapters): sent with the first signal report
	// and then every RegisterEvery, so the metadata center's TTL
	// (Registration.TTLMS) never lapses while the pod lives.
	Registration *api.PodRegistration
	// RegisterEvery is the registration refresh period; default
	// DefaultRegisterEvery.
	RegisterEvery time.Duration
	// Epoch is when this worker started (default: when New ran). The
	// start-up evict-all carries it as evicted_at, so it removes the index
	// entries of an earlier process on this address and keeps those the
	// gateways saved for this one (docs/metadata-center.md, "Versions").
	Epoch time.Time
}

// Reporter queues and sends eviction reports.
type Reporter struct {
	cfg     Config
	mc      *client.Client
	log     *slog.Logger
	kick    chan struct{}
	nudge   chan struct{} // RunSignals reads the source now (Nudge)
	mu      sync.Mutex
	pending map[prefix.Hash]int64 // hash -> when it was evicted, Unix ms (the latest eviction)
	epoch   time.Time             // this worker's start: the evict-all removes what was saved before it
	cleared chan struct{}         // closed once the start-up evict-all was acknowledged
	idle    *sync.Cond            // signalled when pending empties after a send
	recent  recentLog             // what was evicted lately, for the debug listing

	sent    *prometheus.CounterVec
	dropped prometheus.Counter
	signals *prometheus.CounterVec
}

// New validates cfg.
func New(cfg Config) (*Reporter, error) {
	if cfg.URL == "" || cfg.Cluster == "" || cfg.Host == "" {
		return nil, errors.New("mcreport: metadata center URL, cluster and host are all required")
	}
	o := client.Options{Address: cfg.URL, AuthToken: cfg.AuthToken, AuthTokenFile: cfg.AuthTokenFile, HTTPClient: cfg.Client, UpdateTimeout: sendTimeout}
	if cfg.CAFile != "" || cfg.ServerName != "" {
		tc, err := secretfile.ClientTLS(cfg.CAFile, cfg.ServerName, false)
		if err != nil {
			return nil, fmt.Errorf("mcreport: %w", err)
		}
		o.TLS = tc
	}
	mc, err := client.New(o)
	if err != nil {
		return nil, fmt.Errorf("mcreport: %w", err)
	}
	if cfg.MaxPending <= 0 {
		cfg.MaxPending = 65536
	}
	if cfg.MaxBackoff <= 0 {
		cfg.MaxBackoff = 500 * time.Millisecond
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Epoch.IsZero() {
		cfg.Epoch = time.Now()
	}
	r := &Reporter{
		cfg: cfg, mc: mc, log: cfg.Logger, kick: make(chan struct{}, 1), nudge: make(chan struct{}, 1), pending: map[prefix.Hash]int64{}, epoch: cfg.Epoch,
		cleared: make(chan struct{}),
		sent: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "llmf_worker_evict_reports_total",
			Help: "POST /v1/cache/evict calls by result (ok, error, rejected)."}, []string{"result"}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{Name: "llmf_worker_evict_hashes_dropped_total",
			Help: "Evicted hashes not reported because the pending set was full."}),
		signals: newSignalCounter(),
	}
	r.idle = sync.NewCond(&r.mu)
	if cfg.Registerer != nil {
		cfg.Registerer.MustRegister(r.sent, r.dropped, r.signals)
	}
	return r, nil
}

// Evict queues hashes evicted now; it never blocks.
func (r *Reporter) Evict(hs []prefix.Hash) { r.EvictAt(hs, time.Now()) }

// EvictAt queues hashes evicted at at (the report says so, and the
// metadata center keeps entries saved after it); it never blocks.
func (r *Reporter) EvictAt(hs []prefix.Hash, at time.Time) {
	ms := at.UnixMilli()
	r.mu.Lock()
	r.recent.add(hs, at)
	for _, h := range hs {
		if old, ok := r.pending[h]; ok {
			r.pending[h] = max(old, ms)
			continue
		}
		if len(r.pending) >= r.cfg.MaxPending {
			r.dropped.Inc()
			continue
		}
		r.pending[h] = ms
	}
	r.mu.Unlock()
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// Cached withdraws pending reports of hashes a KV entry holds again: a
// prefix cached again supersedes its eviction, which would otherwise delete
// the index entry the gateway saved when it routed the new request here. A
// report already on the wire cannot be withdrawn; if it fails it is not
// retried for these hashes.
func (r *Reporter) Cached(hs []prefix.Hash) {
	r.mu.Lock()
	for _, h := range hs {
		delete(r.pending, h)
	}
	if len(r.pending) == 0 {
		r.idle.Broadcast()
	}
	r.mu.Unlock()
}

// Cleared is closed once the metadata center acknowledged the start-up
// evict-all: from then on the index holds nothing of an earlier process on
// this address (the worker's readiness waits for it).
func (r *Reporter) Cleared() <-chan struct{} { return r.cleared }

// Pending counts hashes not sent yet.
func (r *Reporter) Pending() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.pending)
}

// Run sends {all:true} and then the queued hashes until ctx ends.
func (r *Reporter) Run(ctx context.Context) {
	backoff := 100 * time.Millisecond
	for {
		err := r.postTimed(ctx, api.CacheEvict{Cluster: r.cfg.Cluster, Host: r.cfg.Host, All: true, EvictedAt: r.epoch.UnixMilli()})
		if err == nil {
			r.log.Info("metadata center: cleared this host's cache index", "host", r.cfg.Host, "cluster", r.cfg.Cluster)
			close(r.cleared)
			break
		}
		r.log.Warn("metadata center: start-up evict-all failed; retrying", "err", err, "in", backoff)
		if !sleep(ctx, backoff) {
			return
		}
		backoff = min(2*backoff, r.cfg.MaxBackoff)
	}
	backoff = 100 * time.Millisecond
	for {
		batch, at := r.next()
		if len(batch) == 0 {
			select {
			case <-r.kick:
				continue
			case <-ctx.Done():
				return
			}
		}
		err := r.postTimed(ctx, api.CacheEvict{Cluster: r.cfg.Cluster, Host: r.cfg.Host, Hashes: prefix.Wire(batch), ChunkSize: r.cfg.ChunkSize,
			EvictedAt: at})
		switch {
		case err == nil || client.Permanent(err):
			if err != nil {
				r.log.Error("metadata center refused an eviction report; dropping it", "err", err, "hashes", len(batch))
			}
			r.done(batch, at)
			backoff = 100 * time.Millisecond
		default:
			r.log.Warn("metadata center: eviction report failed; retrying", "err", err, "in", backoff)
			if !sleep(ctx, backoff) {
				return
			}
			backoff = min(2*backoff, r.cfg.MaxBackoff)
		}
	}
}

// next picks up to api.MaxHashes pending hashes without removing them, so
// a failed send keeps them, the earliest evictions first, and the time the
// report carries: the latest of theirs. A later time than a hash's own
// can only remove a save made between its eviction and that time (an index
// miss until the gateway saves it again), never leave a stale entry.
func (r *Reporter) next() ([]prefix.Hash, int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]prefix.Hash, 0, len(r.pending))
	for h := range r.pending {
		out = append(out, h)
	}
	if len(out) > api.MaxHashes {
		slices.SortFunc(out, func(a, b prefix.Hash) int { return cmp.Compare(r.pending[a], r.pending[b]) })
		out = out[:api.MaxHashes]
	}
	var at int64
	for _, h := range out {
		at = max(at, r.pending[h])
	}
	return out, at
}

// done forgets the hashes of a report sent with time at; one evicted again
// after at stays pending for the next report.
func (r *Reporter) done(batch []prefix.Hash, at int64) {
	r.mu.Lock()
	r.recent.reported(batch, at, time.Now())
	for _, h := range batch {
		if t, ok := r.pending[h]; ok && t <= at {
			delete(r.pending, h)
		}
	}
	if len(r.pending) == 0 {
		r.idle.Broadcast()
	}
	r.mu.Unlock()
}

// Eviction is a hash this worker stopped holding, when, and when the
// metadata center acknowledged a report of it (zero: not yet; a report it
// refused counts as acknowledged: nothing more will be sent).
type Eviction struct {
	Hash     prefix.Hash
	At       time.Time
	Reported time.Time
}

// Bounds of the recent-evictions log: a checker comparing the router's
// index with this worker's view needs the drops of the last eviction-report
// bound (bench/chaos, about a second); the log keeps more, in bounded memory.
const (
	recentFor = 10 * time.Second
	recentMax = 16384
)

// recentLog is the evictions of the last recentFor, at most recentMax, in
// the order they were queued. Guarded by the Reporter's mu.
type recentLog struct {
	evs       []Eviction
	truncated time.Time // the latest eviction dropped for room (not age)
}

func (l *recentLog) add(hs []prefix.Hash, at time.Time) {
	for _, h := range hs {
		l.evs = append(l.evs, Eviction{Hash: h, At: at})
	}
	i := 0
	for ; i < len(l.evs) && (len(l.evs)-i > recentMax || at.Sub(l.evs[i].At) > recentFor); i++ {
		if len(l.evs)-i > recentMax {
			l.truncated = l.evs[i].At
		}
	}
	l.evs = l.evs[i:]
}

// reported stamps the evictions a report sent with time at covered.
func (l *recentLog) reported(batch []prefix.Hash, at int64, now time.Time) {
	in := make(map[prefix.Hash]bool, len(batch))
	for _, h := range batch {
		in[h] = true
	}
	for i := range l.evs {
		if e := &l.evs[i]; e.Reported.IsZero() && in[e.Hash] && e.At.UnixMilli() <= at {
			e.Reported = now
		}
	}
}

// Recent lists the evictions of the last ten seconds or so, the latest of
// each hash, and since when the list is complete: every eviction after
// since is in it (debug listing: docs/operations.md, "Chaos and soak").
func (r *Reporter) Recent() (evs []Eviction, since time.Time) {
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	latest := make(map[prefix.Hash]int, len(r.recent.evs))
	for _, e := range r.recent.evs {
		if now.Sub(e.At) > recentFor {
			continue
		}
		if j, ok := latest[e.Hash]; ok {
			evs[j] = e
			continue
		}
		latest[e.Hash] = len(evs)
		evs = append(evs, e)
	}
	since = now.Add(-recentFor)
	if r.epoch.After(since) {
		since = r.epoch
	}
	if r.recent.truncated.After(since) {
		since = r.recent.truncated
	}
	return evs, since
}

// Flush waits until nothing is pending (tests, shutdown) or ctx ends.
func (r *Reporter) Flush(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() {
		r.mu.Lock()
		r.idle.Broadcast()
		r.mu.Unlock()
	})
	defer stop()
	r.mu.Lock()
	defer r.mu.Unlock()
	for len(r.pending) > 0 {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		r.idle.Wait()
	}
	return nil
}

// postTimed sends a report with its eviction time. A metadata center that
// refuses the time (400: this host's clock is far ahead of its own) gets
// the report again without it: removing entries saved after the eviction
// costs index misses, keeping evicted ones would leave the index wrong.
func (r *Reporter) postTimed(ctx context.Context, body api.CacheEvict) error {
	err := r.post(ctx, body)
	var se *client.StatusError
	if body.EvictedAt != 0 && errors.As(err, &se) && se.Status == http.StatusBadRequest {
		r.log.Error("metadata center refused the eviction time (is this host's clock right?); reporting without it",
			"err", err, "evicted_at", body.EvictedAt)
		body.EvictedAt = 0
		err = r.post(ctx, body)
	}
	return err
}

// post sends one report and counts its outcome.
func (r *Reporter) post(ctx context.Context, body api.CacheEvict) error {
	err := r.mc.EvictCache(ctx, body)
	switch {
	case err == nil:
		r.sent.WithLabelValues("ok").Inc()
	case client.Permanent(err):
		r.sent.WithLabelValues("rejected").Inc()
	default:
		r.sent.WithLabelValues("error").Inc()
	}
	return err
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
