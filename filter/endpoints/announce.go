package endpoints

import (
	"context"
	"log/slog"
	"slices"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/ratelog"
)

// Announce tells the metadata center the hosts ("ip:port") this gateway
// routes to in a cluster, whose rule names backend
// (client.Client.AnnouncePods).
type Announce func(ctx context.Context, cluster, backend string, hosts []string) error

// Defaults of AnnouncerOptions.
const (
	DefaultAnnounceCheck   = time.Second
	DefaultAnnounceRefresh = 10 * time.Second
)

// AnnouncerOptions configure StartAnnouncer. Source, Clusters and Announce
// are required.
type AnnouncerOptions struct {
	Source Source
	// Clusters maps each cluster to announce to its backend.
	Clusters map[string]string
	Announce Announce
	// Check is how often the source is read (default 1s): a change is
	// announced at once. Refresh is how often an unchanged set is announced
	// again (default 10s), within the metadata center's announcement TTL.
	Check, Refresh time.Duration
	Timeout        time.Duration // bounds one announcement; default Check
	Logger         *slog.Logger
}

// StartAnnouncer announces the clusters' endpoints to the metadata center
// until stop is called (stop waits for the goroutine): every pod the
// gateway can route to, including those Envoy's admin API lists, gets its
// signals scraped (docs/metadata-center.md, "Pod signals").
func StartAnnouncer(o AnnouncerOptions) (stop func()) {
	if o.Check <= 0 {
		o.Check = DefaultAnnounceCheck
	}
	if o.Refresh <= 0 {
		o.Refresh = DefaultAnnounceRefresh
	}
	if o.Timeout <= 0 {
		o.Timeout = o.Check
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer func() {
			// Inside Envoy's process no panic may escape a goroutine.
			if e := recover(); e != nil {
				o.Logger.Error("endpoint announcer panicked; pods are no longer announced", "panic", e)
			}
		}()
		a := announcer{o: o, last: map[string]announced{}, warn: ratelog.New(o.Logger)}
		t := time.NewTicker(o.Check)
		defer t.Stop()
		for {
			a.round(ctx)
			select {
			case <-t.C:
			case <-ctx.Done():
				return
			}
		}
	}()
	return func() { cancel(); <-done }
}

type announced struct {
	hosts []string
	at    time.Time
}

type announcer struct {
	o    AnnouncerOptions
	last map[string]announced
	eps  []Endpoint
	warn *ratelog.Logger
}

func (a *announcer) round(ctx context.Context) {
	now := time.Now()
	for cluster, backend := range a.o.Clusters {
		a.eps = Append(a.eps[:0], a.o.Source, cluster)
		if len(a.eps) == 0 {
			continue
		}
		hosts := make([]string, len(a.eps))
		for i, e := range a.eps {
			hosts[i] = e.Address
		}
		slices.Sort(hosts)
		hosts = slices.Compact(hosts)
		prev, ok := a.last[cluster]
		if ok && slices.Equal(prev.hosts, hosts) && now.Sub(prev.at) < a.o.Refresh {
			continue
		}
		actx, cancel := context.WithTimeout(ctx, a.o.Timeout)
		err := a.o.Announce(actx, cluster, backend, hosts)
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				a.warn.Warn("announcing the cluster's pods to the metadata center failed; retrying", "cluster", cluster, "err", err)
			}
			delete(a.last, cluster)
			continue
		}
		a.last[cluster] = announced{hosts: hosts, at: now}
	}
	clear(a.eps)
}
