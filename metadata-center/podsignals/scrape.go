package podsignals

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// Defaults of Options.
const (
	DefaultInterval    = 250 * time.Millisecond
	DefaultConcurrency = 16
	maxMetricsBytes    = 8 << 20 // a /metrics answer larger than this is refused
)

// Target is one pod to scrape: its cluster (as the router names it), its
// ip:port and the backend it runs.
type Target struct {
	Cluster, Host, Backend string
}

// Targets lists what to scrape; it is asked again before every round, so a
// source may follow a changing fleet.
type Targets interface {
	Targets() []Target
}

// StaticTargets is a fixed list.
type StaticTargets []Target

func (t StaticTargets) Targets() []Target { return t }

// Reporter records a pod's signals: store.Signals is one.
type Reporter interface {
	ReportSignals(ctx context.Context, cluster, host string, sig api.PodSignals) error
}

// Options of New. Store and Targets are required.
type Options struct {
	Store   Reporter
	Targets Targets
	// Interval between rounds (default 250ms); Timeout bounds one scrape
	// (default the interval).
	Interval, Timeout time.Duration
	// Concurrency bounds scrapes in flight (default 16).
	Concurrency int
	Client      *http.Client // default a client of its own
	Logger      *slog.Logger
	// Registerer, if set, gets llmf_metadata_center_scrapes_total{backend,result}.
	Registerer prometheus.Registerer
}

// Scraper scrapes targets' /metrics into the store.
type Scraper struct {
	o       Options
	log     *slog.Logger
	results *prometheus.CounterVec

	mu       sync.Mutex
	inFlight map[Target]bool // a slow pod is not scraped twice at once
	warned   map[Target]time.Time
}

// New validates o.
func New(o Options) (*Scraper, error) {
	if o.Store == nil || o.Targets == nil {
		return nil, errors.New("podsignals: Store and Targets are required")
	}
	if o.Interval <= 0 {
		o.Interval = DefaultInterval
	}
	if o.Timeout <= 0 {
		o.Timeout = o.Interval
	}
	if o.Concurrency <= 0 {
		o.Concurrency = DefaultConcurrency
	}
	if o.Client == nil {
		o.Client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2, IdleConnTimeout: time.Minute}}
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	s := &Scraper{o: o, log: o.Logger, inFlight: map[Target]bool{}, warned: map[Target]time.Time{},
		results: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "llmf", Subsystem: "metadata_center", Name: "scrapes_total",
			Help: "Scrapes of pods' /metrics by backend and result (ok, error, unsupported).",
		}, []string{"backend", "result"}),
	}
	if o.Registerer != nil {
		if err := o.Registerer.Register(s.results); err != nil {
			return nil, fmt.Errorf("podsignals: %w", err)
		}
	}
	return s, nil
}

// Run scrapes every Interval until ctx ends.
func (s *Scraper) Run(ctx context.Context) {
	t := time.NewTicker(s.o.Interval)
	defer t.Stop()
	for {
		s.Round(ctx, false)
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
	}
}

// Round scrapes every target once; with wait it returns when all are done
// (tests), otherwise as soon as they are started.
func (s *Scraper) Round(ctx context.Context, wait bool) {
	sem := make(chan struct{}, s.o.Concurrency)
	var wg sync.WaitGroup
	for _, t := range s.o.Targets.Targets() {
		if !Scrapable(t.Backend) {
			s.results.WithLabelValues(t.Backend, "unsupported").Inc()
			continue
		}
		s.mu.Lock()
		busy := s.inFlight[t]
		s.inFlight[t] = true
		s.mu.Unlock()
		if busy {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() {
				s.mu.Lock()
				delete(s.inFlight, t)
				s.mu.Unlock()
			}()
			select {
			case sem <- struct{}{}:
				defer func() { <-sem }()
			case <-ctx.Done():
				return
			}
			if err := s.scrape(ctx, t); err != nil {
				s.results.WithLabelValues(t.Backend, "error").Inc()
				s.warn(t, err)
				return
			}
			s.results.WithLabelValues(t.Backend, "ok").Inc()
		}()
	}
	if wait {
		wg.Wait()
	}
}

// scrape reads one pod and records what it says.
func (s *Scraper) scrape(ctx context.Context, t Target) error {
	ctx, cancel := context.WithTimeout(ctx, s.o.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+t.Host+"/metrics", nil)
	if err != nil {
		return err
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := s.o.Client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET /metrics: status %d", resp.StatusCode)
	}
	sig, err := Parse(t.Backend, io.LimitReader(resp.Body, maxMetricsBytes))
	if err != nil {
		return err
	}
	return s.o.Store.ReportSignals(ctx, t.Cluster, t.Host, sig)
}

// warn logs a pod's failures at most once a minute each.
func (s *Scraper) warn(t Target, err error) {
	now := time.Now()
	s.mu.Lock()
	last, seen := s.warned[t]
	if seen && now.Sub(last) < time.Minute {
		s.mu.Unlock()
		return
	}
	s.warned[t] = now
	s.mu.Unlock()
	s.log.Warn("pod /metrics scrape failed; its signals go stale", "cluster", t.Cluster, "host", t.Host, "backend", t.Backend, "err", err)
}
