package store

import (
	"context"
	"sync"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// Registry keeps the pods' registrations (labels, models, LoRA adapters;
// docs/metadata-center.md). Router answers the live ones' labels and
// adapters in api.RouteAnswer.Pods.
type Registry interface {
	// Register records host's registration, replacing the previous one,
	// alive for ttl from the store's clock.
	Register(ctx context.Context, cluster, host string, reg api.PodRegistration, ttl time.Duration) error
	// Pods returns the cluster's live registrations, TTLMS set to the
	// time each has left; nil when there are none.
	Pods(ctx context.Context, cluster string) (map[string]api.PodRegistration, error)
}

// RegistryBook keeps the pods' registrations for stores that hold them in
// process: per cluster, host -> registration and its expiry. It is bounded
// by api.MaxPodSignals pods per cluster (expired ones go first, then the
// one closest to expiry). Safe for concurrent use.
type RegistryBook struct {
	mu sync.RWMutex
	m  map[string]map[string]registered
}

type registered struct {
	reg    api.PodRegistration
	expiry int64 // unix nanoseconds
}

// NewRegistryBook returns an empty book.
func NewRegistryBook() *RegistryBook {
	return &RegistryBook{m: map[string]map[string]registered{}}
}

// Register records reg for host at now (unix nanoseconds), alive for ttl.
func (b *RegistryBook) Register(cluster, host string, reg api.PodRegistration, ttl time.Duration, now int64) {
	reg.TTLMS = 0
	b.mu.Lock()
	defer b.mu.Unlock()
	hosts := b.m[cluster]
	if hosts == nil {
		hosts = map[string]registered{}
		b.m[cluster] = hosts
	}
	if _, ok := hosts[host]; !ok {
		// A new pod: the expired ones (pods gone) are swept first, so the
		// book holds live pods only, however many have come and gone.
		soonest, at := "", int64(0)
		for h, r := range hosts {
			if r.expiry <= now {
				delete(hosts, h)
			} else if soonest == "" || r.expiry < at {
				soonest, at = h, r.expiry
			}
		}
		if len(hosts) >= api.MaxPodSignals {
			delete(hosts, soonest)
		}
	}
	hosts[host] = registered{reg: reg, expiry: now + int64(ttl)}
}

// Live returns the cluster's registrations alive at now, TTLMS set; nil
// when there are none.
func (b *RegistryBook) Live(cluster string, now int64) map[string]api.PodRegistration {
	b.mu.RLock()
	defer b.mu.RUnlock()
	var out map[string]api.PodRegistration
	for h, r := range b.m[cluster] {
		if r.expiry <= now {
			continue
		}
		if out == nil {
			out = make(map[string]api.PodRegistration, len(b.m[cluster]))
		}
		reg := r.reg
		reg.TTLMS = (r.expiry - now) / int64(time.Millisecond)
		out[h] = reg
	}
	return out
}

// Labels returns what the route query answers of the live registrations;
// nil when there are none.
func (b *RegistryBook) Labels(cluster string, now int64) map[string]api.PodLabels {
	b.mu.RLock()
	defer b.mu.RUnlock()
	var out map[string]api.PodLabels
	for h, r := range b.m[cluster] {
		if r.expiry <= now {
			continue
		}
		if out == nil {
			out = make(map[string]api.PodLabels, len(b.m[cluster]))
		}
		out[h] = r.reg.PodLabels()
	}
	return out
}
