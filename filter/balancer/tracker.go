package balancer

import (
	"hash/maphash"
	"slices"
	"sync"
	"time"

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
// The same lag runs the other way at a request's end: the metadata center
// counts it until the done update lands (a batch window and a round trip
// later), and a conversation's next turn arrives within a millisecond of
// the answer's end. Its holder then looked busier than the pods that hold
// nothing of it, and turns moved off idle holders, computing their
// history again. A request that ended here after the metadata center counted
// it is taken off its figures until the done is confirmed (Released), and
// off the answers to route queries asked before that (View.Asked): the
// metadata center may have read its counts before the done landed.
//
// A decision counts on its pod from the moment it is made, not only from
// Begin: the caller starts the request after rebuilding its body and
// setting the upstream (tens of microseconds, more on a busy proxy), and
// another decision in that gap would see the pod as it was. Two requests
// 0.2 ms apart went to the same pod while six were idle. Choose therefore
// reserves the pod; Begin takes the reservation over, and a decision that
// never starts (the client left, an error) lets it lapse after reserveTTL.
//
// It also remembers, per cluster and candidate set, where the last requests
// went (Host.Share): the sglang stand-in reads it as the size of each pod's
// share of the routing history. The window is keyed by the set as well
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
// metadata center's leases): G is the cluster's live requests over this
// gateway's own, both averaged over the window's time (window.gateways).
type Tracker struct {
	mu       sync.Mutex
	clusters map[string]map[string]*local // cluster -> host -> counts
	live     map[string]*liveClock        // cluster -> this gateway's live requests over time
	recent   map[windowKey]*window        // last routing decisions
	reserved map[string][]reservation     // cluster -> decisions not yet begun, oldest first (kept when empty)
	// fills are the recent first tokens seen here per pod: a pod's own
	// report taken before one of them still counts that request's prefill
	// (Host.FilledSinceReport).
	fills podEvents
	// landed are the recent updates that took one of this gateway's
	// requests (done) or its prompt (first token) off the metadata
	// center's count of a pod: a route answer asked before one landed may
	// still count it, though the tracker no longer takes it off (View.Asked).
	landed podEvents
	// ends and begun are the recent ends and starts of this gateway's
	// requests per pod: a pod's own report taken before one of them still
	// counts that request running, or does not count it yet
	// (Host.EndedReqsSinceReport, Host.BegunReqsSinceReport).
	ends, begun podEvents
	seed        maphash.Seed     // of setHash
	now         func() time.Time // the clock (tests)
	// held, if set, learns how long a request held its running slot after
	// its first token (FirstToken to End): cache_aware's slot wait. From
	// the first token, not from Begin: time spent queued does not hold a
	// slot, and on a busy pod it would make every wait for a slot look
	// longer the longer the queue, a loop.
	held func(host string, d time.Duration)
}

// liveClock integrates this gateway's live requests of a cluster over
// time: area is request-seconds since the tracker began, so the mean over
// any span is the difference of two readings over its length.
type liveClock struct {
	live int64
	area float64
	at   time.Time // of the last change
}

// read brings area up to now.
func (c *liveClock) read(now time.Time) float64 {
	if !c.at.IsZero() {
		c.area += float64(c.live) * now.Sub(c.at).Seconds()
	}
	c.at = now
	return c.area
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
	ring   []string
	next   int // ring index of the next decision
	filled int // decisions in the ring (< len(ring) until it wraps)
	counts map[string]int

	// Until the window is warm (warm), what its decisions saw (sample):
	// the sums of own and all over the seen decisions that have them, and
	// the time and this gateway's live-request area (liveClock) of the
	// first decision. Not kept up past warm-up, when nothing reads them.
	own, all  int64
	seen      int
	since     time.Time
	sinceArea float64
}

// windowPerHost sizes a cluster's window: long enough that shares are not
// mostly noise (8 decisions per pod), short enough to follow a shift.
const (
	windowPerHost = 8
	windowMin     = 32
	windowMax     = 512
)

func (w *window) add(host string) {
	if w.filled == len(w.ring) {
		old := w.ring[w.next]
		if w.counts[old]--; w.counts[old] == 0 {
			delete(w.counts, old)
		}
	} else {
		w.filled++
	}
	w.ring[w.next] = host
	w.counts[host]++
	w.next = (w.next + 1) % len(w.ring)
}

// gateways estimates how many gateways share the window's traffic, given
// this gateway's live-request area (liveClock) at now: the cluster's live
// requests at the window's decisions, averaged, over this gateway's own
// averaged over the window's time, rounded. The cluster's are sampled at
// decisions, which arrive at random moments and so see the time average,
// but this gateway's own are not: at its own decisions its own last
// requests are the oldest (with round robin over three gateways, a
// request of a fleet that answers in less than three inter-arrival times
// is never seen by its own gateway's next decision), hence the time
// average from liveClock. If most requests live at its decisions were its
// own, it is alone or carries the bulk of the traffic: 1, so one gateway
// (whose view differs from its own count only by leases whose done report
// is on its way) stays at exactly 1. Without samples or own requests it
// cannot tell, and says 1.
func (w *window) gateways(now time.Time, area float64) int {
	if w.seen == 0 || 2*(w.all-w.own) <= w.all {
		return 1
	}
	span := now.Sub(w.since).Seconds()
	if span <= 0 || area <= w.sinceArea {
		return 1
	}
	own := (area - w.sinceArea) / span
	all := float64(w.all) / float64(w.seen)
	return max(1, int(all/own+0.5))
}

// warm says whether shares are worth reading among n candidates: once the
// window stands for 2n of the cluster's decisions (the first pods chosen
// would otherwise look like they took everything), i.e. 2n/G of this
// gateway's own with G gateways. Never under n/2 of its own: below that,
// one decision alone would read as 2/n of them, herd_share's default limit.
func (w *window) warm(n int, now time.Time, area float64) bool {
	if w.filled >= 2*n {
		return true
	}
	return 2*w.filled >= n && w.filled*w.gateways(now, area) >= 2*n
}

type local struct {
	inflight       int64 // routed here and not done
	prefill        int64 // prompt bytes of those before their first token
	unacked        int64 // of inflight, not yet counted by the metadata center
	unackedPrefill int64 // prompt bytes of unacked ones before their first token
	// Ended here, counted by the metadata center, done not yet confirmed.
	ending int64
	// Prompt bytes of requests past their first token here whose lease the
	// metadata center still counts with its prompt: the first-token update
	// has not landed (FirstTokenLanded) nor the done (Released). A
	// conversation's next turn arrives within a millisecond of the answer,
	// and its holder must not look as if it were still prefilling the turn
	// before.
	staleFill int64
	// Decisions for this pod not yet begun and their prefill (reservation).
	reserved, reservedPrefill int64
	// blocks counts, per prompt block hash, the in-flight requests here
	// whose prompt has that block (Host.SharedBlocks).
	blocks map[string]int32
}

// shared returns how many leading hashes of a prompt's chained block
// hashes some in-flight request here has too. Callers hold t.mu.
func (l *local) shared(hashes []string) int {
	n := 0
	for n < len(hashes) && l.blocks[hashes[n]] > 0 {
		n++
	}
	return n
}

// reservation is a decision between Choose and Begin.
type reservation struct {
	host    string
	prefill int64
	at      time.Time
}

// podEvents are recent events of this gateway's requests per pod
// (cluster -> host -> oldest first), each with the requests and prompt
// bytes it concerns (a start's or an end's: the whole prompt's), for what
// was read before them (podEvents.since).
type podEvents map[string]map[string][]podEvent

type podEvent struct {
	at time.Time // when it happened
	// from is when the figures the event corrects began to count its
	// request: when it was sent (a pod's report), when its add landed (the
	// metadata center's leases). A figure read before that never counted
	// it, so the event does not correct it.
	from         time.Time
	reqs, prompt int64
}

// tally sums events' requests and prompt bytes.
type tally struct{ reqs, prompt int64 }

// eventMemory is how long an event is remembered: past the oldest report
// the metadata center answers (store.DefaultSignalMaxAge, 1 s) and any
// route query's time, with room.
const eventMemory = 2 * time.Second

// add records ev on host, forgetting what is past eventMemory.
func (m podEvents) add(cluster, host string, ev podEvent) {
	hosts := m[cluster]
	if hosts == nil {
		hosts = map[string][]podEvent{}
		m[cluster] = hosts
	}
	evs := hosts[host]
	i := 0
	for i < len(evs) && ev.at.Sub(evs[i].at) > eventMemory {
		i++
	}
	hosts[host] = append(evs[i:], ev)
}

// since sums host's events after at: counted, those of requests a figure
// read at at already counted (podEvent.from not after it); fresh, those of
// requests sent (or added) after it.
func (m podEvents) since(cluster, host string, at, now time.Time) (counted, fresh tally) {
	evs := m[cluster][host]
	if len(evs) > 0 && now.Sub(evs[len(evs)-1].at) > eventMemory {
		delete(m[cluster], host) // all of them forgotten: keep the map small
		return tally{}, tally{}
	}
	for i := len(evs) - 1; i >= 0 && evs[i].at.After(at) && now.Sub(evs[i].at) <= eventMemory; i-- {
		t := &counted
		if evs[i].from.After(at) {
			t = &fresh
		}
		t.reqs += evs[i].reqs
		t.prompt += evs[i].prompt
	}
	return counted, fresh
}

// reserveTTL is how long a decision counts on its pod without Begin: far
// past the decision-to-start gap, short enough that a decision that never
// started weighs on one gateway's view only briefly.
const reserveTTL = time.Second

// NewTracker returns an empty tracker.
func NewTracker() *Tracker {
	return &Tracker{clusters: map[string]map[string]*local{}, live: map[string]*liveClock{}, recent: map[windowKey]*window{},
		reserved: map[string][]reservation{}, fills: podEvents{}, landed: podEvents{}, ends: podEvents{}, begun: podEvents{}, seed: maphash.MakeSeed(), now: time.Now}
}

// Routed records a routing decision among cands for Host.Share.
func (t *Tracker) Routed(cluster string, cands []endpoints.Endpoint, host string) {
	t.routed(sample{key: windowKey{cluster, t.setHash(cands)}}, host, len(cands))
}

// sample is what fill saw for a decision that routed records: its window
// and, while the window warms up, the live requests on the candidates:
// this gateway's own (routed here and not done) and all of the cluster's
// (the metadata center's leases plus this gateway's not yet acknowledged
// ones), if the metadata center answered (seen); and the time and this
// gateway's live-request area (liveClock).
type sample struct {
	key      windowKey
	seen     bool
	own, all int64
	at       time.Time
	area     float64
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
		w = &window{ring: make([]string, size), counts: map[string]int{}, since: s.at, sinceArea: s.area}
		t.recent[s.key] = w
	}
	if s.seen && w.filled < 2*n {
		w.own += s.own
		w.all += s.all
		w.seen++
	}
	w.add(host)
}

// Flight is one routed request's entry in the tracker. Its methods are
// idempotent and may be called from any goroutine, in any order after Begin
// (an Acked after End means the done update is still to land; after
// Released it is ignored).
type Flight struct {
	t             *Tracker
	l             *local // the entry lives while inflight or ending > 0
	cluster, host string
	prompt        int64     // prefill bytes (Begin's prefill)
	length        int64     // the whole prompt's bytes
	hashes        []string  // its block hashes, counted in l.blocks until End
	sent, added   time.Time // Begin, and when its add landed (Acked)
	firstToken    time.Time
	acked         bool
	filled        bool // first token seen: its prompt no longer loads the pod
	ftLanded      bool // the first-token update has landed (or failed)
	ended         bool
	released      bool // the done update has landed (or failed)
}

// stale says whether f counts in l.staleFill. Callers hold t.mu.
func (f *Flight) stale() bool { return f.acked && f.filled && !f.ftLanded && !f.released }

// ending says whether f counts in l.ending: ended here, its add landed, its
// done not yet. Callers hold t.mu.
func (f *Flight) ending() bool { return f.acked && f.ended && !f.released }

// Begin records a request routed to host: prefill is the prompt bytes it
// leaves the pod to compute (routing.Decision.PrefillLength), prompt the
// whole prompt (PromptLength, and Hashes in wire form; nil if unknown).
func (t *Tracker) Begin(cluster, host string, prefill int, prompt Request) *Flight {
	f := &Flight{t: t, cluster: cluster, host: host, prompt: int64(prefill), length: prompt.PromptLength, hashes: prompt.Hashes}
	t.mu.Lock()
	l := t.local(cluster, host)
	f.l = l
	t.unreserve(cluster, host, l)
	c := t.live[cluster]
	if c == nil {
		c = &liveClock{}
		t.live[cluster] = c
	}
	f.sent = t.now()
	c.read(f.sent)
	t.begun.add(cluster, host, podEvent{at: f.sent, from: f.sent, reqs: 1, prompt: f.length})
	c.live++
	l.inflight++
	l.unacked++
	l.prefill += f.prompt
	l.unackedPrefill += f.prompt
	if len(prompt.Hashes) > 0 && l.blocks == nil {
		l.blocks = make(map[string]int32, len(prompt.Hashes))
	}
	for _, h := range prompt.Hashes {
		l.blocks[h]++
	}
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
	if f.acked || f.released {
		return
	}
	f.acked = true
	f.added = f.t.now()
	if f.ended { // the add landed after the end: its done has yet to
		f.l = f.t.local(f.cluster, f.host) // End may have let the entry go
		f.l.ending++
		if f.stale() {
			f.l.staleFill += f.prompt
		}
		return
	}
	if f.stale() {
		f.l.staleFill += f.prompt
	}
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
	f.firstToken = f.t.now()
	f.t.fills.add(f.cluster, f.host, podEvent{at: f.firstToken, from: f.sent, reqs: 1, prompt: f.prompt})
	l := f.l
	l.prefill -= f.prompt
	if !f.acked {
		l.unackedPrefill -= f.prompt
	}
	if f.stale() {
		l.staleFill += f.prompt
	}
}

// FirstTokenLanded records that the metadata center has had the request's
// first-token update (or that sending it failed): it no longer counts the
// request's prompt.
func (f *Flight) FirstTokenLanded() {
	if f == nil {
		return
	}
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	if f.ftLanded {
		return
	}
	if f.stale() {
		f.l.staleFill -= f.prompt
		f.t.landed.add(f.cluster, f.host, podEvent{at: f.t.now(), from: f.added, prompt: f.prompt})
	}
	f.ftLanded = true
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
	now := f.t.now()
	if c := f.t.live[f.cluster]; c != nil {
		c.read(now)
		c.live--
	}
	if f.t.held != nil && f.filled {
		f.t.held(f.host, now.Sub(f.firstToken))
	}
	l := f.l
	l.inflight--
	if !f.filled {
		l.prefill -= f.prompt
	}
	for _, h := range f.hashes {
		if l.blocks[h]--; l.blocks[h] <= 0 {
			delete(l.blocks, h)
		}
	}
	f.t.ends.add(f.cluster, f.host, podEvent{at: now, from: f.sent, reqs: 1, prompt: f.length})
	if f.acked {
		l.ending++
	} else {
		l.unacked--
		if !f.filled {
			l.unackedPrefill -= f.prompt
		}
	}
	f.t.release(f.cluster, f.host, l)
}

// Released records that the metadata center has had the request's done
// update, or that sending it failed: either way the tracker no longer takes
// the request off the metadata center's figures. Only after End.
func (f *Flight) Released() {
	if f == nil {
		return
	}
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	if !f.ended || f.released {
		return
	}
	var ev podEvent
	if f.stale() {
		f.l.staleFill -= f.prompt
		ev.prompt = f.prompt
	}
	if f.ending() {
		f.l.ending--
		f.t.release(f.cluster, f.host, f.l)
		ev.reqs = 1
	}
	if ev != (podEvent{}) {
		ev.at, ev.from = f.t.now(), f.added
		f.t.landed.add(f.cluster, f.host, ev)
	}
	f.released = true
}

// local returns host's entry, made if missing. Callers hold t.mu.
func (t *Tracker) local(cluster, host string) *local {
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
	return l
}

// release drops host's entry once nothing counts on it, which keeps the
// maps as small as the set of busy pods. Callers hold t.mu.
func (t *Tracker) release(cluster, host string, l *local) {
	if l.inflight > 0 || l.reserved > 0 || l.ending > 0 {
		return
	}
	hosts := t.clusters[cluster]
	delete(hosts, host)
	if len(hosts) == 0 {
		delete(t.clusters, cluster)
	}
}

// reserve counts a decision for a request of prefill bytes on host until
// Begin takes it over or it lapses (Tracker).
func (t *Tracker) reserve(cluster, host string, prefill int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	l := t.local(cluster, host)
	l.reserved++
	l.reservedPrefill += prefill
	t.reserved[cluster] = append(t.reserved[cluster], reservation{host: host, prefill: prefill, at: t.now()})
}

// unreserve takes over the oldest reservation of host, if any: the request
// Begin records is (normally) the decision that made it. Callers hold t.mu.
func (t *Tracker) unreserve(cluster, host string, l *local) {
	rs := t.reserved[cluster]
	i := slices.IndexFunc(rs, func(r reservation) bool { return r.host == host })
	if i < 0 {
		return
	}
	l.reserved--
	l.reservedPrefill -= rs[i].prefill
	t.reserved[cluster] = slices.Delete(rs, i, i+1) // emptied, kept for the next decision
}

// expire lets the cluster's reservations older than reserveTTL lapse.
// Callers hold t.mu.
func (t *Tracker) expire(cluster string, now time.Time) {
	rs := t.reserved[cluster]
	n := 0
	for n < len(rs) && now.Sub(rs[n].at) > reserveTTL {
		r := rs[n]
		if l := t.clusters[cluster][r.host]; l != nil {
			l.reserved--
			l.reservedPrefill -= r.prefill
			t.release(cluster, r.host, l)
		}
		n++
	}
	if n > 0 {
		t.reserved[cluster] = rs[n:] // no copy: append reallocates in time
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
func (t *Tracker) fill(cluster string, cands []endpoints.Endpoint, v View, req Request, out []Host) sample {
	s := sample{key: windowKey{cluster, t.setHash(cands)}}
	var own, all int64
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.reserved[cluster]) > 0 {
		t.expire(cluster, t.now())
	}
	mine := t.clusters[cluster]
	w := t.recent[s.key]
	// Until the window is warm its decisions carry when they were made
	// and what this gateway's live-request area was (window.gateways); past
	// it the clock is not read.
	if w == nil || w.filled < 2*len(cands) {
		now, area := t.now(), 0.0
		if c := t.live[cluster]; c != nil {
			area = c.read(now)
		}
		s.at, s.area = now, area
		if w != nil && !w.warm(len(cands), now, area) {
			w = nil
		}
	}
	for i, e := range cands {
		h := Host{Address: e.Address}
		var l *local
		if mine != nil {
			l = mine[e.Address]
		}
		if v.Degraded {
			if l != nil {
				h.Reqs, h.Prompt = l.inflight+l.reserved, l.prefill+l.reservedPrefill
				h.LocalPrefill = h.Prompt
			}
		} else {
			st := v.Load[e.Address]
			h.Reqs, h.Prompt = st.TotalReqs, st.PromptLength
			if len(t.landed[cluster][e.Address]) > 0 && !v.Asked.IsZero() {
				landed, _ := t.landed.since(cluster, e.Address, v.Asked, t.now())
				h.Reqs, h.Prompt = max(0, h.Reqs-landed.reqs), max(0, h.Prompt-landed.prompt)
			}
			if l != nil {
				h.Reqs = max(0, h.Reqs-l.ending) + l.unacked + l.reserved
				h.Prompt = max(0, h.Prompt-l.staleFill)
				h.LocalPrefill = l.unackedPrefill + l.reservedPrefill
				h.Prompt += h.LocalPrefill
				own += l.inflight
			}
			all += h.Reqs
			if req.Blocks > 0 && len(v.Cache) > 0 {
				h.CacheRatio = min(1, float64(v.Cache[e.Address])/float64(req.Blocks))
			}
			if sig, ok := v.Signals[e.Address]; ok {
				h.Signals = true
				h.Waiting, h.Running, h.KVUtil, h.PrefillQueued = sig.Waiting, sig.Running, sig.KVCacheUtil, sig.PrefillTokens
				h.KVCapacity, h.MaxRunning, h.ReportsEvictions = sig.KVCapacity, sig.MaxRunning, sig.ReportsEvictions
				h.PrefillQueue, h.TokenSeconds, h.AttentionSeconds, h.StepSeconds = sig.PrefillQueue, sig.TokenSeconds, sig.AttentionSeconds, sig.StepSeconds
				h.StepLeft = max(0, sig.StepLeftSeconds-float64(sig.AgeMS)/1000)
				if sig.HeldTokens > 0 && sig.HeldStepSeconds > 0 {
					h.HeldTokens, h.HeldStep, h.HoldLeft = sig.HeldTokens, sig.HeldStepSeconds, sig.HoldLeftSeconds-float64(sig.AgeMS)/1000
				}
				if l != nil && len(l.blocks) > 0 && h.KVCapacity > 0 {
					h.SharedBlocks = l.shared(req.Hashes) // for the KV admission only
				}
				if len(t.fills[cluster][e.Address])+len(t.ends[cluster][e.Address])+len(t.begun[cluster][e.Address]) > 0 {
					now := t.now()
					taken := now.Add(-time.Duration(sig.AgeMS) * time.Millisecond)
					// Requests sent after the report was taken are not
					// in it: their first tokens and ends correct nothing,
					// and those that ended are no longer there to join it.
					filled, _ := t.fills.since(cluster, e.Address, taken, now)
					ended, endedFresh := t.ends.since(cluster, e.Address, taken, now)
					_, sent := t.begun.since(cluster, e.Address, taken, now)
					h.FilledReqsSinceReport, h.FilledSinceReport = filled.reqs, filled.prompt
					h.EndedReqsSinceReport, h.EndedSinceReport = ended.reqs, ended.prompt
					if n := sent.reqs - endedFresh.reqs; n > 0 {
						h.BegunReqsSinceReport, h.BegunSinceReport = n, sent.prompt*n/sent.reqs
					}
				}
			}
		}
		if w != nil {
			h.Share = float64(w.counts[e.Address]) / float64(w.filled)
		}
		out[i] = h
	}
	s.seen, s.own, s.all = !v.Degraded, own, all
	return s
}
