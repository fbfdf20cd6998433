package podsignals

import (
	"cmp"
	"context"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// Discovered is the book of pods that gateways announce (POST
// /v1/pods/discovered): every pod a gateway can route to, found through
// Envoy's admin API or its static list, with the backend its rule names.
// An announcement holds for its TTL; gateways refresh it, so a pod that
// left every gateway's view stops being scraped. The book is per metadata
// center replica: each replica scrapes what it heard of, and the signals
// land in the shared store.
type Discovered struct {
	mu  sync.Mutex
	m   map[Target]time.Time // expiry
	now func() time.Time
}

// NewDiscovered returns an empty book.
func NewDiscovered() *Discovered {
	return &Discovered{m: map[Target]time.Time{}, now: time.Now}
}

// Announce records hosts of cluster running backend until ttl passes.
func (d *Discovered) Announce(cluster, backend string, hosts []string, ttl time.Duration) {
	until := d.now().Add(ttl)
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, h := range hosts {
		d.m[Target{Cluster: cluster, Host: h, Backend: backend}] = until
	}
}

// Targets returns the live announcements, sorted, and forgets expired ones.
func (d *Discovered) Targets() []Target {
	now := d.now()
	d.mu.Lock()
	out := make([]Target, 0, len(d.m))
	for t, until := range d.m {
		if now.After(until) {
			delete(d.m, t)
			continue
		}
		out = append(out, t)
	}
	d.mu.Unlock()
	slices.SortFunc(out, func(a, b Target) int {
		return cmp.Or(cmp.Compare(a.Cluster, b.Cluster), cmp.Compare(a.Host, b.Host), cmp.Compare(a.Backend, b.Backend))
	})
	return out
}

// Registered lists a cluster's registered pods: store.Registry is one.
type Registered interface {
	Pods(ctx context.Context, cluster string) (map[string]api.PodRegistration, error)
}

// Fleet is what the metadata center scrapes: the pods its scrape
// configuration lists, and the pods gateways announced that do not push
// their own signals. A pod pushes when it registers (our worker does, with
// every few reports): scraping it would only overwrite what it said.
type Fleet struct {
	Static     []Target
	Discovered *Discovered
	Registry   Registered    // nil: no pod pushes
	Timeout    time.Duration // bounds one cluster's registry lookup; default 1s
	Logger     *slog.Logger
}

// Targets implements Targets.
func (f *Fleet) Targets() []Target {
	out := slices.Clone(f.Static)
	if f.Discovered == nil {
		return out
	}
	seen := make(map[Target]bool, len(out))
	for _, t := range out {
		seen[t] = true
	}
	pushing := map[string]map[string]api.PodRegistration{}
	for _, t := range f.Discovered.Targets() {
		if seen[t] {
			continue
		}
		if f.Registry != nil {
			regs, ok := pushing[t.Cluster]
			if !ok {
				regs = f.registered(t.Cluster)
				pushing[t.Cluster] = regs
			}
			if _, ok := regs[t.Host]; ok {
				continue
			}
		}
		out = append(out, t)
	}
	return out
}

// registered reads a cluster's registrations; on failure none (the pods are
// scraped: a pushing pod's scrape fails on its foreign /metrics, which
// costs a log line, not a wrong signal).
func (f *Fleet) registered(cluster string) map[string]api.PodRegistration {
	to := f.Timeout
	if to <= 0 {
		to = time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), to)
	defer cancel()
	regs, err := f.Registry.Pods(ctx, cluster)
	if err != nil && f.Logger != nil {
		f.Logger.Warn("reading registered pods failed: scraping every announced pod", "cluster", cluster, "err", err)
	}
	return regs
}
