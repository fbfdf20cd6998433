package endpoints

import (
	"sync"
	"time"
)

// Outlier is passive health checking for a Source, after Envoy's outlier
// detection: a host whose connection failed is ejected for a while, so the
// balancer stops choosing a pod that died between discovery refreshes (static
// lists have no refresh at all). Each further ejection of the same host
// doubles the time, up to MaxEjection; a success resets it. When every host of
// a cluster is ejected, all are returned, as Envoy's panic threshold does:
// trying a possibly-dead pod beats refusing every request.
//
// One Outlier holds the health of hosts for a whole process; Wrap gives each
// config's Source a view filtered by it.
type Outlier struct {
	base time.Duration
	max  time.Duration
	now  func() time.Time

	mu      sync.Mutex
	ejected map[string]ejection
	suspect map[string]time.Time // left out until then, or until settled
}

type ejection struct {
	until time.Time
	times int // consecutive ejections, for the backoff
}

// OutlierOptions tune ejection; zero values take Envoy's defaults.
type OutlierOptions struct {
	BaseEjection time.Duration    // first ejection (default 30s, Envoy's base_ejection_time)
	MaxEjection  time.Duration    // cap (default 300s, Envoy's max_ejection_time)
	Now          func() time.Time // clock, for tests
}

// NewOutlier starts with every host healthy.
func NewOutlier(o OutlierOptions) *Outlier {
	if o.BaseEjection <= 0 {
		o.BaseEjection = 30 * time.Second
	}
	if o.MaxEjection < o.BaseEjection {
		o.MaxEjection = max(300*time.Second, o.BaseEjection)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Outlier{base: o.BaseEjection, max: o.MaxEjection, now: o.Now, ejected: map[string]ejection{}, suspect: map[string]time.Time{}}
}

// Wrap returns src without the hosts that are currently ejected or suspect.
func (o *Outlier) Wrap(src Source) Source { return outlierView{o: o, src: src} }

type outlierView struct {
	o   *Outlier
	src Source
}

func (v outlierView) Endpoints(cluster string) []Endpoint {
	return v.AppendEndpoints(nil, cluster)
}

// AppendEndpoints implements Appender.
func (v outlierView) AppendEndpoints(dst []Endpoint, cluster string) []Endpoint {
	start := len(dst)
	dst = Append(dst, v.src, cluster)
	return dst[:start+v.o.keepHealthy(dst[start:])]
}

// keepHealthy moves the hosts that are neither ejected nor suspect to the
// front of eps, in their order, and returns how many there are; len(eps)
// when none is.
func (o *Outlier) keepHealthy(eps []Endpoint) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.ejected) == 0 && len(o.suspect) == 0 {
		return len(eps)
	}
	now := o.now()
	n := 0
	for i := range eps {
		a := eps[i].Address
		if ej, ok := o.ejected[a]; (!ok || !now.Before(ej.until)) && !now.Before(o.suspect[a]) {
			eps[n], eps[i] = eps[i], eps[n]
			n++
		}
	}
	if n == 0 {
		return len(eps)
	}
	return n
}

// Failed records that a connection to addr failed and ejects it.
func (o *Outlier) Failed(addr string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	delete(o.suspect, addr)
	ej := o.ejected[addr]
	now := o.now()
	if now.Before(ej.until) {
		return // already out; concurrent failures are one event
	}
	d := o.base << min(ej.times, 16)
	if d > o.max || d <= 0 {
		d = o.max
	}
	o.ejected[addr] = ejection{until: now.Add(d), times: ej.times + 1}
}

// Succeeded records a served request: the host is healthy again.
func (o *Outlier) Succeeded(addr string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	delete(o.ejected, addr)
	delete(o.suspect, addr)
}

// Suspect leaves addr out for at most d while a check of it is under way
// (Failed ejects it, Cleared or Succeeded takes it back): a request routed
// there ended unanswered, which is a dead pod or a client that left.
func (o *Outlier) Suspect(addr string, d time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.suspect[addr] = o.now().Add(d)
}

// Cleared ends a suspicion without touching an ejection's backoff: the
// check reached addr.
func (o *Outlier) Cleared(addr string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	delete(o.suspect, addr)
}

// Ejected reports whether addr is currently ejected.
func (o *Outlier) Ejected(addr string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.now().Before(o.ejected[addr].until)
}
