package balancer

import (
	"hash/maphash"
	"sync"

	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
)

// Tracker is this gateway's own account of the requests it has routed.
//
// The metadata center learns of a request only when the asynchronous
// addRequest lands, so between a decision and that moment every other
// decision here would see the pod as idle, and a burst would all pick the
// same pod. The tracker adds each such unacknowledged request to the
// metadata center's figures; once the metadata center has it (Acked) it is
// no longer added, so nothing is counted twice. If the metadata center cannot
// be queried at all, the tracker's full in-flight counts stand in for it.
//
// It also remembers, per cluster and candidate set, where the last requests
// went (Host.Share): cache_aware's herd control needs to know which pods have
// been taking more than their share. The window is keyed by the set as well
// as the cluster because rules and requests with different label selectors
// choose among different pods of one cluster: one window for all would
// restart each time the candidate count changed, and shares among 4 pods
// would be read as shares among 8.
//
// Several gateways share a cluster's traffic, and each window holds only
// this gateway's decisions: a fair sample of the cluster's when clients
// spread over the gateways, but one that grows G times slower with G
// gateways. What makes shares worth reading is how many of the cluster's
// decisions the window stands for, so the window also estimates G from
// the route answers, which count every gateway's live requests (the
// metadata center's leases): G is the cluster's live requests on the
// candidates over this gateway's own, summed over the window's decisions
// (window.gateways).
type Tracker struct {
	mu       sync.Mutex
	clusters map[string]map[string]*local // cluster -> host -> counts
	recent   map[windowKey]*window        // last routing decisions
	seed     maphash.Seed                 // of setHash
}

// windowKey names a candidate set of a cluster: set is an order-independent
// hash of its addresses.
type windowKey struct {
	cluster string
	set     uint64
}

// maxWindows bounds the windows kept: endpoint churn makes new sets, and
// old ones must not pile up. Past it every window starts afresh.
const maxWindows = 4096

// setHash combines the addresses' hashes by sum, so the order the
// endpoints arrive in does not matter. maphash: FNV over every byte of 256
// addresses cost more than the rest of the scoring.
func (t *Tracker) setHash(cands []endpoints.Endpoint) uint64 {
	var sum uint64
	for i := range cands {
		sum += maphash.String(t.seed, cands[i].Address)
	}
	return sum
}

// window counts the hosts of the last len(ring) routing decisions of a
// cluster.
type window struct {
	ring   []decision
	next   int // ring index of the next decision
	filled int // decisions in the ring (< len(ring) until it wraps)
	counts map[string]int
	// own and all sum the decisions' live-request samples over the ring.
	own, all int64
}

// decision is one routing decision in a window: the host chosen and the
// live requests on the candidates when it was made, this gateway's own
// (routed here and not done) and all of the cluster's (the metadata
// center's leases plus this gateway's not yet acknowledged ones). Both 0
// when the metadata center did not answer.
type decision struct {
	host     string
	own, all int32
}

// windowPerHost sizes a cluster's window: long enough that shares are not
// mostly noise (8 decisions per pod), short enough to follow a shift.
const (
	windowPerHost = 8
	windowMin     = 32
	windowMax     = 512
)

func (w *window) add(d decision) {
	if w.filled == len(w.ring) {
		old := w.ring[w.next]
		if w.counts[old.host]--; w.counts[old.host] == 0 {
			delete(w.counts, old.host)
		}
		w.own -= int64(old.own)
		w.all -= int64(old.all)
	} else {
		w.filled++
	}
	w.ring[w.next] = d
	w.counts[d.host]++
	w.own += int64(d.own)
	w.all += int64(d.all)
	w.next = (w.next + 1) % len(w.ring)
}

// gateways estimates how many gateways share the window's traffic: the
// cluster's live requests over this gateway's own, rounded to a whole
// number. Rounding keeps one gateway at exactly 1: its view differs from
// its own count only by leases whose done report is still on its way. With
// no live request of its own in the window it cannot tell, and says 1.
func (w *window) gateways() int {
	if w.own <= 0 || w.all <= w.own {
		return 1
	}
	return int((w.all + w.own/2) / w.own)
}

// warm says whether shares are worth reading among n candidates: once the
// window stands for 2n of the cluster's decisions (the first pods chosen
// would otherwise look like they took everything), i.e. 2n/G of this
// gateway's own with G gateways. Never under n/2 of its own: below that,
// one decision alone would read as 2/n of them, herd_share's default limit.
func (w *window) warm(n int) bool {
	if w.filled >= 2*n {
		return true
	}
	return 2*w.filled >= n && w.filled*w.gateways() >= 2*n
}

type local struct {
	inflight       int64 // routed here and not done
	prefill        int64 // prompt bytes of those before their first token
	unacked        int64 // of inflight, not yet counted by the metadata center
	unackedPrefill int64 // prompt bytes of unacked ones before their first token
}

// NewTracker returns an empty tracker.
func NewTracker() *Tracker {
	return &Tracker{clusters: map[string]map[string]*local{}, recent: map[windowKey]*window{}, seed: maphash.MakeSeed()}
}

// Routed records a routing decision among cands for Host.Share.
func (t *Tracker) Routed(cluster string, cands []endpoints.Endpoint, host string) {
	t.routed(sample{key: windowKey{cluster, t.setHash(cands)}}, host, len(cands))
}

// sample is what fill saw for a decision that routed records: its window
// and the live requests on the candidates (decision.own, decision.all).
type sample struct {
	key      windowKey
	own, all int32
}

func (t *Tracker) routed(s sample, host string, n int) {
	size := min(max(windowPerHost*n, windowMin), windowMax)
	t.mu.Lock()
	defer t.mu.Unlock()
	w := t.recent[s.key]
	if w == nil || len(w.ring) != size {
		if len(t.recent) >= maxWindows {
			clear(t.recent)
		}
		w = &window{ring: make([]decision, size), counts: map[string]int{}}
		t.recent[s.key] = w
	}
	w.add(decision{host: host, own: s.own, all: s.all})
}

// Flight is one routed request's entry in the tracker. Its methods are
// idempotent and may be called from any goroutine, in any order after Begin
// (a late Acked after End is ignored).
type Flight struct {
	t             *Tracker
	l             *local // stays valid until End: the entry lives while inflight > 0
	cluster, host string
	prompt        int64
	acked         bool
	filled        bool // first token seen: its prompt no longer loads the pod
	ended         bool
}

// Begin records a request routed to host.
func (t *Tracker) Begin(cluster, host string, promptLength int) *Flight {
	f := &Flight{t: t, cluster: cluster, host: host, prompt: int64(promptLength)}
	t.mu.Lock()
	hosts := t.clusters[cluster]
	if hosts == nil {
		hosts = map[string]*local{}
		t.clusters[cluster] = hosts
	}
	l := hosts[host]
	if l == nil {
		l = &local{}
		hosts[host] = l
	}
	f.l = l
	l.inflight++
	l.unacked++
	l.prefill += f.prompt
	l.unackedPrefill += f.prompt
	t.mu.Unlock()
	return f
}

// Acked records that the metadata center now counts the request.
func (f *Flight) Acked() {
	if f == nil {
		return
	}
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	if f.acked || f.ended {
		return
	}
	f.acked = true
	l := f.l
	l.unacked--
	if !f.filled {
		l.unackedPrefill -= f.prompt
	}
}

// FirstToken records the end of prefill.
func (f *Flight) FirstToken() {
	if f == nil {
		return
	}
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	if f.filled || f.ended {
		return
	}
	f.filled = true
	l := f.l
	l.prefill -= f.prompt
	if !f.acked {
		l.unackedPrefill -= f.prompt
	}
}

// End records that the request is over.
func (f *Flight) End() {
	if f == nil {
		return
	}
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	if f.ended {
		return
	}
	f.ended = true
	l := f.l
	l.inflight--
	if !f.filled {
		l.prefill -= f.prompt
	}
	if !f.acked {
		l.unacked--
		if !f.filled {
			l.unackedPrefill -= f.prompt
		}
	}
	if l.inflight == 0 {
		// Keeps the maps as small as the set of busy pods.
		hosts := f.t.clusters[f.cluster]
		delete(hosts, f.host)
		if len(hosts) == 0 {
			delete(f.t.clusters, f.cluster)
		}
	}
}

// InFlight returns the local in-flight count and unacknowledged count of a host.
func (t *Tracker) InFlight(cluster, host string) (inflight, unacked int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if l := t.clusters[cluster][host]; l != nil {
		return l.inflight, l.unacked
	}
	return 0, 0
}

// fill computes every candidate's Host from the view plus local accounting,
// and returns the decision's sample for routed.
func (t *Tracker) fill(cluster string, cands []endpoints.Endpoint, v View, blocks int, out []Host) sample {
	s := sample{key: windowKey{cluster, t.setHash(cands)}}
	var own, all int64
	t.mu.Lock()
	defer t.mu.Unlock()
	mine := t.clusters[cluster]
	w := t.recent[s.key]
	if w != nil && !w.warm(len(cands)) {
		w = nil
	}
	for i, e := range cands {
		h := Host{Address: e.Address}
		var l *local
		if mine != nil {
			l = mine[e.Address]
		}
		if v.Degraded {
			if l != nil {
				h.Reqs, h.Prompt = l.inflight, l.prefill
			}
		} else {
			st := v.Load[e.Address]
			h.Reqs, h.Prompt = st.TotalReqs, st.PromptLength
			if l != nil {
				h.Reqs += l.unacked
				h.Prompt += l.unackedPrefill
				own += l.inflight
			}
			all += h.Reqs
			if blocks > 0 && len(v.Cache) > 0 {
				h.CacheRatio = min(1, float64(v.Cache[e.Address])/float64(blocks))
			}
			if sig, ok := v.Signals[e.Address]; ok {
				h.Signals = true
				h.Waiting, h.Running, h.KVUtil, h.PrefillQueued = sig.Waiting, sig.Running, sig.KVCacheUtil, sig.PrefillTokens
			}
		}
		if w != nil {
			h.Share = float64(w.counts[e.Address]) / float64(w.filled)
		}
		out[i] = h
	}
	// Clamped only against absurd counts: the sums are int64.
	s.own, s.all = int32(min(own, 1<<20)), int32(min(all, 1<<20))
	return s
}
