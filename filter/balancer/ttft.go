package balancer

// cache_aware: route each request to the pod with the lowest predicted time
// to first token (TTFT), in seconds, plus the delay its own prefill there
// adds to the requests waiting on the pod. This file is the whole policy,
// read top to bottom:
//
//  1. the prediction for request r on pod p (predict):
//
//     TTFT(r, p) = max(slot wait(r, p), step in progress(p),
//                      queued(p) / prefill rate(p))
//                + uncached(r, p) / prefill rate(p)
//                + decode step(p)                  (the first token itself)
//                + KV fit(r, p)                    (recomputing what r evicts)
//
//     the wait is the longer of the pod's admission (a running slot, and
//     room in its KV for r's prompt), the rest of the step the pod is in
//     (half a step, where it runs anything) and the prefill queued ahead:
//     the requests ahead prefill while r waits to be admitted. The prefill
//     rate and the step are the cluster's fit (3 below), or, on a pod that
//     measures its own compute (our worker), the pod's: its step, each
//     token's cost plus its attention to the cells before it, and of its
//     queue, listed request by request, those it prefills first (fewer
//     tokens left than r's), which wait for the rest of the step in
//     progress (it reports both: the queue as it stands once the step
//     ends, so the two add), or of the step a prompt its finish first
//     held takes alone once released (releasedStep). In tokens
//     throughout: prompt bytes become
//     tokens through the bytes per token learnt per model
//     (BytesPerToken). Inputs: the metadata center's
//     leases and prefix matches (every gateway's requests), this gateway's
//     requests not counted there yet (Tracker), and the pod's own report
//     when fresh: our worker's push, or a vLLM-like pod's scrape, whose
//     waiting, running and kv_cache_usage_perc are enough (waiting requests
//     at the fleet's mean size stand for queued tokens; waiting > 0 means
//     no free slot; utilization and running give the free KV), advanced by
//     what this gateway saw there since it was taken (requests sent, first
//     tokens, ends);
//  2. the pick (CacheAware.Choose): the lowest cost, TTFT(r, p) plus what
//     r's own computation on p costs the other requests: the delay it adds
//     to those that will queue behind it there (Cost.Delay) and the cached
//     tokens its new tokens evict, which later requests recompute as often
//     as the cluster's requests find their tokens cached (Cost.Evict);
//     plus, on the pods holding r's prefix
//     while all of them are slower for r than an idle pod would be had it
//     held the prefix, what a copy there would spare the prefix's
//     requests (the copy credit); among the pods within tie_epsilon of
//     the lowest, the fewest of the request's tokens computed, then the
//     fewest requests in flight, uniformly among equals;
//  3. the check (Balancer.Observe): the first token's observed TTFT against
//     the prediction, which exports the relative error and refits the
//     cluster's prefill rate and decode step (fleetMeans); and
//     (Balancer.ObserveCache) the cached tokens the answer's usage reports
//     against the share of the prompt the index said the pod held, which
//     teaches the cluster how long its prompts' new parts are, those no
//     pod holds past the index's matched blocks (Request.cachedBytes'
//     tail).
//
// The routing keys (lb_mapping_rule, filter/config) are three:
// tie_epsilon (a fraction of the lowest prediction), default_prefill_rate
// (tokens per second) and default_decode_step (seconds), the latter two only
// until the cluster's first observed TTFTs replace them.

import (
	"context"
	"log/slog"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
)

// BytesPerToken learns a model's prompt bytes per token from the
// usage.prompt_tokens its answers report, so that every figure of the model
// is in tokens whatever the vocabulary (1 on the byte-level test model, about
// 4 on English text with a BPE vocabulary). Safe for concurrent use; the zero
// value reads 1 until the first observation.
type BytesPerToken struct {
	mu            sync.Mutex
	bytes, tokens float64 // decayed sums
	value         atomic.Uint64
	gauge         prometheus.Gauge // exports the value; nil = none
}

// bptMemory is how many observations the ratio mostly remembers: the sums
// decay by 1/bptMemory per observation, so a change of traffic (another
// language, another chat template) is followed within a few hundred
// requests while one odd request moves the ratio by well under 1%.
const bptMemory = 256

// Observe records one request: its prompt bytes as the gateway measured them
// and the prompt tokens the model server counted. Non-positive values are
// ignored.
func (b *BytesPerToken) Observe(bytes, tokens int64) {
	if bytes <= 0 || tokens <= 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	const keep = 1 - 1.0/bptMemory
	b.bytes = b.bytes*keep + float64(bytes)
	b.tokens = b.tokens*keep + float64(tokens)
	v := b.bytes / b.tokens
	b.value.Store(math.Float64bits(v))
	if b.gauge != nil {
		b.gauge.Set(v)
	}
}

// Value returns the bytes per token, 1 until something was observed.
func (b *BytesPerToken) Value() float64 {
	if b == nil {
		return 1
	}
	if v := math.Float64frombits(b.value.Load()); v > 0 {
		return v
	}
	return 1
}

// Cost is one pod's predicted TTFT for the request being routed, by part,
// in seconds (tokens where named so).
type Cost struct {
	Host string
	// SlotWait is until the pod can start the request: a running slot
	// free, and room in its KV for the prompt (KVShortTokens short of it).
	SlotWait, KVShortTokens float64
	// QueuedTokens are the prefill tokens standing before the request on
	// the pod, Queue their prefill at the pod's rate.
	QueuedTokens, Queue float64
	// InStep is the rest of the step the pod is in when the request
	// arrives: a pod running anything steps without pause and takes a new
	// request only between steps. Our worker reports it (Host.StepLeft),
	// and the step a prompt held by finish first takes once released
	// (releasedStep); elsewhere it is half a decode step, the mean.
	InStep float64
	// Wait is the longest of SlotWait, InStep and Queue: the requests
	// ahead prefill while the request waits for a slot, in the steps the
	// pod runs anyway, so the three overlap. On our worker, whose queue
	// counts what is left once the step in progress ends, the step and
	// the queue come one after the other: the longer of SlotWait and
	// InStep + Queue.
	Wait float64
	// UncachedTokens are the request's own tokens the pod does not hold,
	// Prefill their prefill at the pod's rate.
	UncachedTokens, Prefill float64
	Step                    float64 // one decode step: the first token
	// FitTokens are the request's new tokens the pod's free KV cannot
	// hold; Fit is recomputing them (what the pod evicts or preempts to
	// make room) at its prefill rate.
	FitTokens, Fit float64
	Total          float64 // the predicted TTFT: Wait + Prefill + Step + Fit
	// Measured: the prediction priced the compute by what pods measured
	// (the pod's own costs, Host.TokenSeconds…, or its cluster's others'
	// where it has not measured yet), not by the cluster's fit, which
	// then learns nothing from the request.
	Measured bool
	// Waiting is the requests waiting on the pod as the prediction counts
	// them: its report's, advanced by what this gateway saw there since.
	Waiting float64
	// Evict is what the request's new tokens cost the requests after it
	// by what they displace: a pod's KV cache, once warm, is full of idle
	// cached blocks (they count as free, and the least recently freed go
	// first), so each token computed here evicts a cached token, which a
	// later request recomputes if it comes for it. It comes as often as
	// the cluster's requests find their tokens cached: the served share
	// of the recent answers' prompts (predictor.served). Evict is that
	// share of Prefill. Not part of the prediction: the pick weighs it
	// (CacheAware.Choose).
	Evict float64
}

// Delay is what the request's own computation on the pod (Prefill + Fit)
// adds to the TTFTs of others: every request that will queue behind it
// there waits that much longer. In a first-come-first-served queue as
// many requests arrive during a request's wait, on average, as it found
// waiting when it came (the count an arrival sees and the count a
// departure leaves behind are alike in distribution), so the pod's
// waiting requests stand for them; where the fleet's mean per pod is
// more, the mean (fleetWaiting): a router that keeps the pods' queues
// alike fills a pod that has just emptied at once from the fleet's
// requests, so on a fleet where requests wait its compute is no freer
// than a busy pod's. Not part of the prediction: the pick weighs it
// (CacheAware.Choose).
func (c Cost) Delay(fleetWaiting float64) float64 {
	return max(c.Waiting, fleetWaiting) * (c.Prefill + c.Fit)
}

// Prediction is what a decision predicted for its chosen pod
// (Choice.Prediction); the lifecycle hands it back to Balancer.Observe with
// the observed TTFT at the first token, and to Balancer.ObserveCache with
// what the pod served from its KV cache. The zero value predicts nothing.
type Prediction struct {
	Cost
	Cluster string
	// PromptTokens is the prompt in tokens as the prediction counted them
	// (its bytes over the bytes per token then known).
	PromptTokens float64
	// The rule's defaults the prediction used where the cluster had no
	// fit yet: Observe starts the cluster's fit from them.
	defRate, defStep float64
	// bpt is the bytes per token the prediction counted its tokens with:
	// Observe turns them back into bytes, the fit's unit.
	bpt float64
	// matched is the prompt bytes of the blocks the index listed on the
	// pod, and partial whether that was some but not all of them, on one of
	// the prefix's holders (predictor.tailOf): then ObserveCache learns
	// from the answer how much of the prompt's end the pod did not hold
	// (Request.cachedBytes' tail).
	matched int64
	partial bool
}

// WaitsForEnds says whether the request was predicted to wait longest for
// running requests to end (SlotWait), rather than to start at once or
// behind the prefill queued ahead.
func (c Cost) WaitsForEnds() bool { return c.SlotWait > 0 && c.Wait == c.SlotWait }

// CachedShare is the share of the prompt the decision believed the pod
// held in its KV cache (what the prefix index matched there), 0 to 1.
func (p Prediction) CachedShare() float64 {
	if p.PromptTokens <= 0 {
		return 0
	}
	return min(max(1-p.UncachedTokens/p.PromptTokens, 0), 1)
}

// State states the prediction in a routed answer's headers, through set:
// the predicted TTFT (headers.PredictedTTFT), where the request waits for
// ends that wait (headers.PredictedSlotWait), in milliseconds, and the
// share of the prompt believed cached on the pod
// (headers.PredictedCachedShare). Nothing for the zero value.
func (p Prediction) State(set func(name, value string)) {
	if p.Total <= 0 {
		return
	}
	set(headers.PredictedTTFT, strconv.FormatFloat(p.Total*1000, 'f', 3, 64))
	if p.WaitsForEnds() {
		set(headers.PredictedSlotWait, strconv.FormatFloat(p.SlotWait*1000, 'f', 3, 64))
	}
	if p.PromptTokens > 0 {
		set(headers.PredictedCachedShare, strconv.FormatFloat(p.CachedShare(), 'f', 3, 64))
	}
}

// podFit is what the gateway has learnt of one pod from the requests that
// ended there: how long one holds a running slot (held); 0 = unknown, the
// hold comes from the step.
//
// Its prefill rate and decode step are its cluster's (fleetMeans): the pods
// of a cluster serve one model on like hardware, and what sets them apart
// (queue, running slots, cached prefixes, free KV) is measured. A fit per
// pod would learn only from the pods chosen: one seen faster than the
// rule's defaults, or another seen slower during a burst, would keep that
// figure while not chosen, and the first would draw every request while
// idle, the second none, however like the others they are.
type podFit struct {
	hold float64 // mean seconds from a request's first token to its end
}

// fitRate weighs each request's end in its pod's hold: the last ~5
// dominate, so a pod whose answers lengthen or whose batches fill is
// followed within a second of traffic, while one odd request moves the
// hold by a fifth of its difference.
const fitRate = 0.2

// Bounds of the fitted figures, so that a burst of odd observations (a
// client that read slowly, a clock step) cannot drive a pod's prediction
// to zero or infinity: no accelerator prefills faster than 10M tokens/s or
// slower than 10 tokens/s, and no decode step is under 0.1 ms or over 10 s.
const (
	minSecPerToken = 1e-7
	maxSecPerToken = 0.1
	minStep        = 1e-4
	maxStep        = 10
)

// assumedSlotSteps is how many decode steps a request is assumed to hold
// its running slot before the gateway has seen one end on the pod: about
// the mean answer length of chat traffic (ShareGPT's is ~200 tokens, the
// shorter benchmarks' 128); replaced by the observed hold at the first end.
const assumedSlotSteps = 128

// meanRate weighs each routed request in a cluster's mean prompt tokens
// (fleetMeans): the last ~20 decisions, long enough to smooth one long
// document, short enough to follow a change of workload.
const meanRate = 0.05

// fleetMeans are a cluster's recent request sizes, for the pods whose
// queue the gateway knows only as a count of waiting requests, and its fit
// of the prefill rate and the decode step.
//
// Sizes are kept in prompt bytes, not tokens: a model's bytes per token is
// learnt from its first answers' usage (BytesPerToken), and until then a
// prediction counts bytes as tokens. Figures in bytes mean the same before
// and after; the predictor turns them into tokens with the ratio it has.
type fleetMeans struct {
	prompt   float64 // whole prompts: what a running request holds in KV
	uncached float64 // what a request left to prefill where it went
	// secPerByte and step are the cluster's fit from its observed TTFTs
	// (TTFT less slot wait ≈ step + bytes·secPerByte, observe); 0 until
	// the first: the rule's defaults stand in.
	secPerByte, step float64
	// The fit's data: decayed sums of weight, bytes, seconds and their
	// squares and product over the recent observations (fitMemory).
	n, sx, sy, sxx, sxy float64
	// tails are the prompt bytes the pod did not serve, of the last
	// answers (tailMemory, a ring at tailAt) whose pod held at least the
	// blocks its index entries matched, not all of them; tail is their
	// median (Request.cachedBytes' tail) once tailN > 0.
	tails         [tailMemory]float64
	tailN, tailAt int
	tail          float64
	// served is the share of the prompts the pods served from their KV
	// cache, over the recent answers (meanRate an answer; observeCache):
	// how often a cached token is come for again (Cost.Evict).
	served float64
}

// ttftModel holds what cache_aware learns: per pod fits and per cluster
// means, and the relative-error histogram. Safe for concurrent use.
type ttftModel struct {
	mu    sync.RWMutex
	pods  map[string]*podFit     // host -> fit
	means map[string]*fleetMeans // cluster -> means
	waits prefixWaits            // cache_aware's copy credit
	errs  errObserver            // the TTFT's relative errors (observe)
	cache errObserver            // the cache belief's errors (observeCache)
	log   *slog.Logger
}

// maxFitPods bounds the pods remembered: past it the fits start afresh
// (endpoint churn would otherwise grow the map without end; ten thousand
// pods is far beyond one gateway's fleet).
const maxFitPods = 10000

// errObserver receives relative errors (a Prometheus histogram).
type errObserver interface{ Observe(float64) }

func newTTFTModel(errs, cache errObserver, log *slog.Logger) *ttftModel {
	return &ttftModel{pods: map[string]*podFit{}, means: map[string]*fleetMeans{}, errs: errs, cache: cache, log: log,
		waits: prefixWaits{prefixes: map[prefixKey]*prefixWait{}, clusters: map[string]*clusterCount{}}}
}

// predictor is one decision's view of the model: its inputs read once
// under the read lock, so predicting n pods costs n map lookups.
type predictor struct {
	m            *ttftModel
	bpt          float64 // bytes per token of the request's model
	promptTokens float64
	req          Request // the prompt's length and blocks (cachedBytes)
	tail         float64 // the cluster's prompts' new part (cachedBytes); −1 until seen
	// deepest is the cache ratio of the prefix's holders: the pods whose
	// index entries match the most of the prompt's blocks.
	deepest            float64
	rate, step         float64 // the cluster's fit, else the rule's defaults
	meanPrompt, meanUn float64
	served             float64 // the cluster's served share (fleetMeans.served)
	// measured is the mean of the costs the cluster's pods measured
	// themselves (podCost), for those of its pods that have not yet (a
	// pod counts its first steps before it reports): the pods of a
	// cluster serve one model on like hardware. Zero when none reports.
	measured podCost
}

// podCost is what a pod's compute costs as it measures it (Host's
// TokenSeconds, AttentionSeconds and StepSeconds).
type podCost struct{ token, attention, step float64 }

// known says whether c prices a prompt's tokens (zero: nothing measured).
func (c podCost) known() bool { return c.token > 0 || c.attention > 0 }

// costOf returns h's own measured cost, if it reports one.
func costOf(h *Host) (podCost, bool) {
	c := podCost{h.TokenSeconds, h.AttentionSeconds, h.StepSeconds}
	return c, h.Signals && c.known()
}

// priced returns the prefill of the prompt's last n tokens (the rest
// cached) and one decode step: at cost where it is known, each token's
// own cost and its attention to the cells before it, else at the
// cluster's fit. The one pricing of a pod's compute, for predict and for
// the idle pod copyCredit compares the holders with.
func (p *predictor) priced(cost podCost, n float64) (prefill, step float64) {
	if !cost.known() {
		return n / p.rate, p.step
	}
	step = p.step
	if cost.step > 0 {
		step = cost.step
	}
	cached := p.promptTokens - n
	return cost.token*n + cost.attention*(n*cached+n*(n+1)/2), step
}

// holds says whether h is one of the prefix's holders: it matches some
// of the prompt's blocks, as many as any pod does.
func (p *predictor) holds(h *Host) bool { return p.deepest > 0 && h.CacheRatio >= p.deepest }

// tailOf returns the tail (Request.cachedBytes) for h's match: the
// cluster's on the prefix's holders. A pod whose match is shorter than the
// holders' saw a prompt that left this one earlier, inside the block after
// its match, at a point the prompts' new part does not tell (another
// user's question after the same document, an older turn of the
// conversation): half that block is the guess there.
func (p *predictor) tailOf(h *Host) float64 {
	if !p.holds(h) {
		return -1
	}
	return p.tail
}

func (m *ttftModel) predictor(s *State) predictor {
	p := predictor{m: m, bpt: max(s.BytesPerToken, 1e-3), rate: s.Rule.DefaultPrefillRate, step: s.Rule.DefaultDecodeStep, tail: -1}
	if p.rate <= 0 {
		p.rate = config.DefaultPrefillRate
	}
	if p.step <= 0 {
		p.step = config.DefaultDecodeStep
	}
	p.promptTokens = float64(s.PromptLength) / p.bpt
	p.req = Request{PromptLength: s.PromptLength, Blocks: s.Blocks, ChunkSize: s.ChunkSize, Ends: s.Ends}
	var sum podCost
	n := 0.0
	for i := range s.Hosts {
		p.deepest = max(p.deepest, s.Hosts[i].CacheRatio)
		if c, ok := costOf(&s.Hosts[i]); ok {
			sum.token += c.token
			sum.attention += c.attention
			sum.step += c.step
			n++
		}
	}
	if n > 0 {
		p.measured = podCost{sum.token / n, sum.attention / n, sum.step / n}
	}
	m.mu.RLock()
	if f := m.means[s.Cluster]; f != nil {
		p.meanPrompt, p.meanUn, p.served = f.prompt/p.bpt, f.uncached/p.bpt, f.served
		if f.tailN > 0 {
			p.tail = f.tail
		}
		if f.secPerByte > 0 {
			p.rate, p.step = 1/(f.secPerByte*p.bpt), f.step
		}
	}
	m.mu.RUnlock()
	return p
}

// predict returns h's predicted TTFT for the request. Callers hold m.mu
// for reading.
func (p *predictor) predict(h *Host) Cost {
	c := Cost{Host: h.Address}
	secPerToken, hold := 1/p.rate, 0.0
	// A pod that measures its own compute (our worker: the cost of its
	// steps, api.PodSignals) is priced by it rather than by the cluster's
	// fit from TTFTs, which carry queueing and see mostly cache hits: its
	// decode step, a prompt token's own cost plus its attention to every
	// cell before it (a long cold prompt costs more a token than a short
	// question after a cached document), and of its queue, listed request
	// by request at that cost, what it prefills before this request
	// (measuredQueue).
	cost, own := costOf(h)
	if !own {
		cost = p.measured // a pod yet to measure itself, beside pods that have (or none)
	}
	c.UncachedTokens = max(0, p.promptTokens-float64(p.req.cachedBytes(h.CacheRatio, p.tailOf(h)))/p.bpt)
	prefill, step := p.priced(cost, c.UncachedTokens)
	tokenCost := secPerToken // what one more of the request's tokens costs here (queue, KV fit)
	if c.Measured = cost.known(); c.Measured {
		tokenCost = cost.token + cost.attention*p.promptTokens
		if c.UncachedTokens > 0 {
			tokenCost = prefill / c.UncachedTokens
		}
	}
	if f := p.m.pods[h.Address]; f != nil {
		hold = f.hold
	}
	if hold <= 0 {
		hold = assumedSlotSteps * step
	}

	// The prefill standing before the request. Three counts of it, each
	// short of the truth in its own way, so the largest is taken:
	//   - the leases' prompt bytes before first token (every gateway's
	//     requests, uncached parts only, plus this gateway's own not yet
	//     counted: Tracker), which miss requests from outside the mesh;
	//   - the pod's own report of tokens left to prefill (our worker),
	//     plus this gateway's requests sent since;
	//   - a vLLM-like pod's waiting requests at the fleet's mean uncached
	//     size: its scrape gives counts, not tokens.
	// The report is up to a scrape old, and a conversation's next turn
	// comes within a millisecond of the answer before it: what this
	// gateway saw on the pod since the report was taken moves it on. A
	// request that ended here no longer runs there; one sent here since
	// joins the queue, or runs at once where the pod had nobody waiting
	// and a slot free (or freed by an end). Where requests waited, each
	// end freed a slot one of them took: at least as many were admitted as
	// there were first tokens or ends, whichever is more.
	ended, sent := h.EndedReqsSinceReport, h.BegunReqsSinceReport
	admitted := sent
	switch {
	case h.Waiting > 0:
		admitted = min(h.Waiting+sent, max(h.FilledReqsSinceReport, ended))
	case h.MaxRunning > 0:
		admitted = min(sent, max(0, h.MaxRunning-h.Running+ended))
	}
	running := max(0, h.Running-ended) + admitted
	waiting := h.Waiting + sent - admitted
	queued := float64(h.Prompt) / p.bpt
	if h.Signals {
		reported := max(0, float64(h.PrefillQueued)-float64(h.FilledSinceReport)/p.bpt)
		queued = max(queued, reported+float64(h.LocalPrefill)/p.bpt, float64(waiting)*p.meanUn)
	}
	c.QueuedTokens = queued

	// A pod that reports requests waiting, or as many running as it runs
	// at most, has no free running slot: the request starts once waiting+1
	// of its running requests have ended, one every hold/running seconds.
	if h.Signals && (waiting > 0 || h.MaxRunning > 0 && running >= h.MaxRunning) {
		c.SlotWait = float64(waiting+1) * hold / float64(max(running, 1))
	}
	// Nor does it start before its KV fits. A pod admits a request only
	// when its free KV holds the prompt's blocks that running requests do
	// not hold already (cached blocks no one runs on count too: idle, they
	// are part of the free pool, and vLLM's scheduler takes them out of
	// it), first come first served; of the running requests, this gateway
	// knows its own (SharedBlocks). What running requests hold now is the
	// report's utilization plus the requests admitted since, less what
	// those ended since freed: this gateway's own at their whole prompts,
	// those of the report's queue (admitted first) at the fleet's mean. A
	// request takes, or frees, only the blocks no other running request
	// holds, but where requests of one prefix end and start in turn the
	// two shares cancel, and the gateway does not know which of its
	// requests run and which wait: both count whole. The requests waiting
	// ahead and this gateway's own not yet counted take their room first.
	// Where the rest falls short of what the request needs (KVShortTokens),
	// it waits for as many running requests to end as free that much, each
	// its share of what they hold.
	if h.Signals && h.KVCapacity > 0 && running > 0 {
		capacity := float64(h.KVCapacity)
		fromQueue := min(admitted, max(h.Waiting, 0)) // admitted out of the report's queue
		sentSize := 0.0                               // one sent since, in tokens
		if sent > 0 {
			sentSize = float64(h.BegunSinceReport) / p.bpt / float64(sent)
		}
		held := capacity*min(max(h.KVUtil, 0), 1) + float64(fromQueue)*p.meanPrompt +
			float64(admitted-fromQueue)*sentSize - float64(h.EndedSinceReport)/p.bpt
		held = min(max(held, 0), capacity)
		ahead := float64(max(h.Waiting, 0)-fromQueue)*p.meanPrompt + float64(sent-(admitted-fromQueue))*sentSize +
			float64(h.LocalPrefill)/p.bpt
		need := p.promptTokens - float64(p.req.blockBytes(h.SharedBlocks))/p.bpt
		if short := need - (capacity - held - ahead); short > 0 && held > 0 {
			c.KVShortTokens = short
			ends := min(math.Ceil(short/(held/float64(running))), float64(running))
			c.SlotWait = max(c.SlotWait, ends*hold/float64(running))
		}
	}
	c.Queue = c.QueuedTokens * tokenCost
	if own {
		c.Queue = p.measuredQueue(h, c.UncachedTokens, tokenCost)
	}
	c.Prefill = prefill
	c.Step = step

	// KV fit. The utilization counts the blocks of running requests (idle
	// cached blocks are free), so (1−util) of the pod's KV capacity is
	// free: the capacity it reports, else about Running·meanPrompt/util
	// tokens. Where the request's new tokens do not fit, the pod evicts or
	// preempts the rest, which someone computes again: that many tokens at
	// the pod's prefill rate. Without a reported capacity, a running
	// request or a mean there is no estimate of the free room, and no term.
	if h.Signals {
		u, free := min(max(h.KVUtil, 0), 1), -1.0
		switch {
		case h.KVCapacity > 0:
			free = float64(h.KVCapacity) * (1 - u)
		case h.Running > 0 && u > 0 && p.meanPrompt > 0:
			free = float64(h.Running) * p.meanPrompt * (1 - u) / u
		}
		if free >= 0 {
			c.FitTokens = max(0, c.UncachedTokens-free)
			c.Fit = c.FitTokens * tokenCost
		}
	}
	// A pod running anything is mid-step when the request arrives and
	// takes it at the next step at the earliest. Our worker reports what
	// is left of that step, and its queue as it stands once the step ends:
	// the two come one after the other. Elsewhere half a decode step
	// stands for the rest of it, and the queue's prefill runs in those
	// steps, so its time already counts the one in progress.
	if own {
		c.InStep = max(h.StepLeft, releasedStep(h, ended, c.UncachedTokens))
		c.Wait = max(c.SlotWait, c.InStep+c.Queue)
	} else {
		if running > 0 || h.Reqs > 0 {
			c.InStep = step / 2
		}
		c.Wait = max(c.SlotWait, c.InStep, c.Queue)
	}
	c.Total = c.Wait + c.Prefill + c.Step + c.Fit
	c.Waiting = float64(waiting)
	c.Evict = p.served * c.Prefill
	return c
}

// releasedStep returns what is left of the step a prompt held by finish first
// takes once the answers it waits for have ended (Host.HeldStep), where
// that release is past: by its time, or because this gateway has seen
// that many ends on the pod since the report (the answers about to end are
// all the rest of its running set). A conversation's next turn comes
// right after its answer, that is right after the release, and waits for
// the whole step, a whole n_batch of the prompt. A request of n uncached
// tokens no fewer than the held prompt's waits for all of it anyway (it
// prefills the fewest tokens left first): the queue ahead counts it.
func releasedStep(h *Host, ended int64, n float64) float64 {
	if h.HeldTokens <= 0 || float64(h.HeldTokens) <= n || h.HoldLeft > 0 && ended < max(1, h.Running-1) {
		return 0
	}
	return max(0, h.HeldStep+min(0, h.HoldLeft))
}

// measuredQueue is the prefill a request of n uncached tokens waits for on
// a pod that reports its queue request by request at its own cost (our
// worker): it prefills the fewest tokens left first, so the request waits
// for the queued requests with no more tokens left than its own n, not
// for longer ones. This gateway's requests there since the report count
// at the request's own cost a token (their sizes are not kept here). Its
// requests in the report that have had their first token since are, in
// that order, the queue's shortest entries: as many are taken off (one
// whose last chunk was in the step in progress when the report was taken
// is not in the queue, and takes off the shortest entry all the same,
// until the next report a poll after that step).
func (p *predictor) measuredQueue(h *Host, n, tokenCost float64) float64 {
	ahead := 0.0
	for i, q := range h.PrefillQueue {
		if int64(i) >= h.FilledReqsSinceReport && float64(q.Tokens) <= n {
			ahead += q.Seconds
		}
	}
	return ahead + float64(h.LocalPrefill)/p.bpt*tokenCost
}

// chosen returns the prediction for s.Hosts[i], the pod a policy chose,
// and counts the request in the cluster's means.
func (m *ttftModel) chosen(s *State, i int) Prediction {
	p := m.predictor(s)
	m.mu.RLock()
	c := p.predict(&s.Hosts[i])
	m.mu.RUnlock()
	m.routed(s.Cluster, float64(s.PromptLength), c.UncachedTokens*p.bpt)
	matched, partial := p.req.matchedBytes(s.Hosts[i].CacheRatio)
	partial = partial && p.holds(&s.Hosts[i]) // a holder's answer tells the tail (tailOf)
	return Prediction{Cost: c, Cluster: s.Cluster, PromptTokens: p.promptTokens, defRate: p.rate, defStep: p.step, bpt: p.bpt,
		matched: matched, partial: partial}
}

// routed updates the cluster's means with a decision's request, in bytes.
func (m *ttftModel) routed(cluster string, prompt, uncached float64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	f := m.means[cluster]
	if f == nil {
		if len(m.means) >= maxFitPods {
			clear(m.means)
		}
		f = &fleetMeans{prompt: prompt, uncached: uncached}
		m.means[cluster] = f
		return
	}
	f.prompt += meanRate * (prompt - f.prompt)
	f.uncached += meanRate * (uncached - f.uncached)
}

// fit returns host's entry, made if missing. Callers hold m.mu.
func (m *ttftModel) fit(host string) *podFit {
	f := m.pods[host]
	if f == nil {
		if len(m.pods) >= maxFitPods {
			clear(m.pods)
		}
		f = &podFit{}
		m.pods[host] = f
	}
	return f
}

// held records how long a request held its slot on host after its first
// token (Tracker: FirstToken to End).
func (m *ttftModel) held(host string, d time.Duration) {
	if d <= 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	f := m.fit(host)
	if f.hold == 0 {
		f.hold = d.Seconds()
		return
	}
	f.hold += fitRate * (d.Seconds() - f.hold)
}

// observe refits p's cluster from its observed TTFT: the prefill and the
// decode step are the slope and the intercept of a least-squares line
// through the recent observations of the tokens computed before the first
// token (counted in prompt bytes, fleetMeans) against the time they took.
// Where the prediction's wait was the queue's, those are the queued,
// uncached and KV-fit tokens against the TTFT less what the step in
// progress adds to the queue's prefill;
// where it was the slot's, the request's own (uncached and KV fit) against
// the TTFT less the slot wait, which covered the queue's prefill.
// The slot wait itself is not fitted here: it comes from the request
// durations the tracker measures (held). A line, not one factor for both:
// a pod's step is paid whatever the request's size and its prefill per
// token, and scaling both by the same error over-predicts short prefills
// wherever it under-predicts long ones.
func (m *ttftModel) observe(p Prediction, observed time.Duration) {
	obs := observed.Seconds()
	if p.Host == "" || obs <= 0 || p.Total <= 0 || p.defRate <= 0 || p.defStep <= 0 || p.bpt <= 0 {
		return
	}
	m.errs.Observe((obs - p.Total) / obs)
	m.log.LogAttrs(context.Background(), slog.LevelDebug, "ttft",
		slog.String("cluster", p.Cluster), slog.String("host", p.Host),
		slog.Float64("predicted", p.Total), slog.Float64("observed", obs))
	if p.Measured {
		return
	}
	tokens, wait := p.QueuedTokens+p.UncachedTokens+p.FitTokens, max(0, p.InStep-p.Queue)
	if p.WaitsForEnds() {
		tokens, wait = p.UncachedTokens+p.FitTokens, p.SlotWait
	}
	x := tokens * p.bpt // bytes
	m.mu.Lock()
	defer m.mu.Unlock()
	fm := m.means[p.Cluster]
	if fm == nil { // forgotten since the decision (maxFitPods)
		return
	}
	if fm.secPerByte <= 0 {
		fm.secPerByte, fm.step = 1/(p.defRate*p.bpt), p.defStep
	}
	// What prefill and step account for, bounded to a factor of what the
	// fit predicts for them now, so that a TTFT that mostly waited for
	// something the model did not foresee (or a wait it foresaw that did
	// not happen) cannot undo many good observations: maxScale, or
	// youngScale while the fit has seen fewer than half its memory, whose
	// defaults are only a guess.
	fitted, bound := fm.step+x*fm.secPerByte, maxScale
	if fm.n < fitMemory/2 {
		bound = youngScale
	}
	y := min(max(obs-wait, fitted/bound), fitted*bound)
	const keep = 1 - 1.0/fitMemory
	fm.n = fm.n*keep + 1
	fm.sx = fm.sx*keep + x
	fm.sy = fm.sy*keep + y
	fm.sxx = fm.sxx*keep + x*x
	fm.sxy = fm.sxy*keep + x*y
	mx, my := fm.sx/fm.n, fm.sy/fm.n
	varX := fm.sxx/fm.n - mx*mx
	slope := (fm.sxy/fm.n - mx*my) / varX
	minRate, maxRate := minSecPerToken/p.bpt, maxSecPerToken/p.bpt // per byte
	if varX > minSpread*minSpread*mx*mx && slope > 0 && my-slope*mx > 0 {
		fm.secPerByte = min(max(slope, minRate), maxRate)
		fm.step = min(max(my-fm.secPerByte*mx, minStep), maxStep)
		return
	}
	// Sizes too alike to tell the step from the prefill (or a line that
	// makes either negative): the fit keeps its shape and passes through
	// the observations' mean.
	scale := my / (fm.step + mx*fm.secPerByte)
	fm.step = min(max(fm.step*scale, minStep), maxStep)
	if mx > 0 {
		fm.secPerByte = min(max(fm.secPerByte*scale, minRate), maxRate)
	}
}

// observeCache checks what p believed its pod held of the prompt
// (Prediction.CachedShare) against the share the pod served from its KV
// cache, cachedTokens of promptTokens: positive where the pod held less
// than believed (it had evicted what the index still listed), negative
// where it held more. The index learns what pods hold from the saves and
// evictions themselves; what it cannot resolve is where, in the block after
// the ones it matched, a pod's cache ends, and the answer tells: where the
// match was partial on a holder of the prefix (Prediction.partial) and the
// pod held at least the matched blocks, the prompt bytes it did not serve
// are the new part of the cluster's prompts (Request.cachedBytes' tail). An
// answer that served less than the match tells of an eviction the index had
// not seen yet, not of the prompt's new part, and teaches nothing.
func (m *ttftModel) observeCache(p Prediction, promptTokens, cachedTokens int64) {
	if p.Host == "" || p.PromptTokens <= 0 || promptTokens <= 0 || cachedTokens < 0 || cachedTokens > promptTokens {
		return
	}
	believed, served := p.CachedShare(), float64(cachedTokens)/float64(promptTokens)
	m.cache.Observe(believed - served)
	prompt := p.PromptTokens * p.bpt // bytes
	tail := prompt * (1 - served)
	m.mu.Lock()
	if f := m.means[p.Cluster]; f != nil {
		f.served += meanRate * (served - f.served)
		if p.partial && prompt-tail >= float64(p.matched) {
			f.observeTail(tail)
		}
	}
	m.mu.Unlock()
	m.log.LogAttrs(context.Background(), slog.LevelDebug, "cache",
		slog.String("cluster", p.Cluster), slog.String("host", p.Host),
		slog.Float64("believed", believed), slog.Float64("served", served),
		slog.Int64("matched_bytes", p.matched), slog.Float64("tail_bytes", tail))
}

// tailMemory is how many answers a cluster's tail is the median of: enough
// that an odd prompt (another group's system prompt matching a first block,
// a longer question) does not move it, few enough that a change of traffic
// is followed within as many answers.
const tailMemory = 63

// observeTail adds one answer's tail to the ring and takes the median.
func (f *fleetMeans) observeTail(tail float64) {
	f.tails[f.tailAt] = tail
	f.tailAt = (f.tailAt + 1) % tailMemory
	f.tailN = min(f.tailN+1, tailMemory)
	var buf [tailMemory]float64
	f.tail = nthSmallest(append(buf[:0], f.tails[:f.tailN]...), f.tailN/2)
}

// maxScale bounds one observation's pull on the cluster's fit (observe):
// it counts as at most 1.5 times, and at least 1/1.5 of, what the fit
// predicts. The compute the fit stands for varies within that on a busy
// pod (a request that arrives during a step of the same size waits for
// it); what it must not absorb is a wait the model did not foresee, such as
// a whole answer's decode before the KV cache has room, 5 to 10 times the
// compute of a cache hit. Wider, such waits at small prompts lift the step
// and flatten the rate, so a copy's prefill looks cheaper than it is; a
// pod whose speed changes is still followed, a factor 1.5 at a time.
const maxScale = 1.5

// youngScale bounds the pull of a cluster's first observations, which
// replace the rule's defaults: those may be off by an order of magnitude
// (a GPU prefills tens of thousands of tokens a second, a CPU pod
// hundreds), and a factor 4 at a time reaches either within the first
// observations.
const youngScale = 4

// fitMemory is how many observations the cluster's fit mostly remembers:
// enough for a line through sizes that vary to stand against the noise of
// single TTFTs (a step's phase, a neighbour's prefill), few enough that a
// pod whose speed changes (its batches fill, another model shares its
// GPUs) is followed within seconds of traffic.
const fitMemory = 32

// minSpread is how much the observed sizes must vary, as a fraction of
// their mean (the standard deviation), before the fit separates the step
// from the prefill: below it the slope is mostly noise.
const minSpread = 0.25

// CacheAware is the cache_aware policy: the lowest predicted TTFT, near-ties
// spread.
type CacheAware struct{ m *ttftModel }

func (*CacheAware) NeedsMetadata() bool { return true }
func (*CacheAware) ReadsSignals() bool  { return true }

// Choose picks among the pods whose cost, the predicted TTFT plus what the
// request's computation there costs the others (the delay it adds to the
// requests queued behind it, Cost.Delay, and the recomputation of what it
// evicts, Cost.Evict), is within tie_epsilon of the lowest (near-ties) the
// one that computes the fewest of the request's tokens, then, among those,
// the one with the fewest requests in flight, uniformly among equals.
//
// Why the delay: the request's own TTFT sees what a copy of its prefix on a
// cold pod costs the request, not what it costs the pod. Where requests
// wait there, each of them (and each that arrives behind it) starts that
// much later; on a busy fleet the copies' compute is what is left for
// nobody. A pod counts the fleet's mean waiting requests where it has
// fewer: the pick keeps queues alike, so a pod that has just emptied its
// queue is filled again from the fleet's at once. Where no request waits
// anywhere, the term is 0 and the pick is the request's own fastest pod.
//
// Why the eviction: a warm pod's KV cache is full, so a copy's tokens push
// out as many cached ones, and a later request that comes for them
// computes them again: a KV cache that cannot hold the fleet's prefixes
// keeps the ones its requests come back to only if copies pay for what
// they push out. Where nothing is reused (the served share near 0) the
// term is 0.
//
// Why near-ties at all: the inputs are up to a report old and shared by
// every gateway, so the best-looking pod is the same for all of them until
// the next report; spreading among pods the model cannot tell apart stops
// such a burst from herding, while never taking a pod more than ε worse
// than the best. Uniform within ε rather than a softmax: a softmax keeps a
// small chance on every pod however bad and needs a temperature in no unit.
//
// Why the fewest computed tokens first: a pod still prefilling a prompt
// predicts about the same TTFT for the prompt's next request as a cold pod
// (it waits for the prefill where the cold pod repeats it), but the cold
// pod spends that compute and KV on a second copy, which the next requests
// there then wait for. The request's own TTFT cannot see that cost; the
// tie-break does, within ε.
//
// Why the fewest requests in flight next (join the shortest queue among
// pods that cannot be told apart): a request decoding on a pod changes the
// next request's TTFT there by half a step, within ε where prefills are
// long, but what starts on the busy pod now (a new conversation, a
// prompt's first copy) shares its KV cache and its running slots with what
// runs there for the rest of its life, and its later requests find the pod
// busier. The count comes from the leases, so it includes requests sent
// this instant by every gateway, which a pod's report does not yet show.
//
// Why a copy credit: the request's own TTFT cannot see what a copy of its
// prefix is worth to the requests after it. A prefix drawn by many requests
// keeps its holders stepping, and those of its requests that find every
// holder busy wait for a step in progress (or a queue) that an idle pod
// holding the prefix would not make them wait: half a step each on a hot
// system prompt, which no single request's prediction pays a 1,000-token
// copy for, but which add up over every request the copy would serve. So
// while the prefix's holders are all slower for this request than an idle
// pod would be had it held the prefix, and such a pod is there (the
// request's copy wait), choosing a holder costs also what a copy elsewhere
// would spare: the
// prefix's copy waits per request of the cluster, over its recent requests
// and counted one standard error low (prefixWaits), times the requests the
// cluster serves before a copy made now leaves its pod's KV cache (the
// cluster's KV capacity over the mean tokens a request computes: the
// turnover of a least-recently-used cache). A copy is made where that
// exceeds its cost. Once a copy idles, the holders are not all busy, the
// credit stops, and the copies stop at about as many as the prefix's
// traffic keeps busy. Nothing without a KV capacity reported: the copy's
// life is unknown.
//
// One debug line gives every pod's breakdown: why not pod X is there.
func (c *CacheAware) Choose(s *State) int {
	p := c.m.predictor(s)
	n := len(s.Hosts)
	totals, _ := s.scratch(n)
	holderTTFT, holderUncached, idleOther, capacity := math.Inf(1), math.Inf(1), false, 0.0
	costs := s.costScratch(n)
	fleetWaiting := 0.0 // the fleet's mean waiting requests per pod (Cost.Delay)
	c.m.mu.RLock()
	for i := range s.Hosts {
		k := p.predict(&s.Hosts[i])
		costs, fleetWaiting = append(costs, k), fleetWaiting+k.Waiting/float64(n)
		capacity += float64(s.Hosts[i].KVCapacity)
		if p.holds(&s.Hosts[i]) {
			holderTTFT, holderUncached = min(holderTTFT, k.Total), min(holderUncached, k.UncachedTokens)
		} else if k.Wait == 0 {
			idleOther = true
		}
	}
	c.m.mu.RUnlock()
	for i := range costs {
		k := &costs[i]
		totals = append(totals, k.Total+k.Delay(fleetWaiting)+k.Evict)
	}
	wait, credit, key := c.copyCredit(s, &p, holderTTFT, holderUncached, capacity, idleOther)
	best := math.Inf(1)
	for i := range totals {
		if wait > 0 && p.holds(&s.Hosts[i]) {
			totals[i] += credit
		}
		best = min(best, totals[i])
	}
	limit := best*(1+s.Rule.TieEpsilon) + tieEpsilon
	least, fewest, ties := math.Inf(1), int64(math.MaxInt64), 0
	for i, t := range totals {
		if t > limit {
			continue
		}
		switch work, reqs := costs[i].UncachedTokens, s.Hosts[i].Reqs; {
		case work < least-tieEpsilon, work <= least+tieEpsilon && reqs < fewest:
			least, fewest, ties = min(least, work), reqs, 1
		case work <= least+tieEpsilon && reqs == fewest:
			ties++
		}
	}
	r := s.IntN(ties)
	pick := 0
	for i, t := range totals {
		if t <= limit && costs[i].UncachedTokens <= least+tieEpsilon && s.Hosts[i].Reqs == fewest {
			if r == 0 {
				pick = i
				break
			}
			r--
		}
	}
	if c.m.log.Enabled(context.Background(), slog.LevelDebug) {
		c.debug(s, &p, costs, fleetWaiting, pick, ties, key, wait, credit)
	}
	return pick
}

// copyCredit returns the request's copy wait: how much later the best of
// its prefix's holders gives it its first token than an idle pod would
// have, held that pod the prefix (a step and the holders' uncached tokens,
// priced as predict prices a pod yet to measure itself);
// and the credit: the prefix's earlier copy waits per request of the
// cluster (prefixWaits) times the requests until the cluster's KV cache
// turns over (capacity: the pods' KV capacities, summed). It counts the
// decision and adds the request's wait to its prefix's. A copy wait needs a pod idle now that does not hold the prefix
// (idleOther): a copy spares the prefix's requests their waits by putting
// them on capacity nobody uses; on a fleet where every pod is busy, a
// holder's wait beside a shorter queue elsewhere is an imbalance that each
// request's own pick already weighs, and a copy there only adds work. The
// prefix is named by the hash of the holders' deepest matched block; no
// wait without holders or hashes, no credit without a KV capacity.
func (c *CacheAware) copyCredit(s *State, p *predictor, holderTTFT, holderUncached, capacity float64, idleOther bool) (wait, credit float64, key prefixKey) {
	key.cluster = s.Cluster
	depth := p.req.matchedBlocks(p.deepest)
	if depth > 0 && depth <= len(s.Hashes) && idleOther {
		key.hash = s.Hashes[depth-1]
		prefill, step := p.priced(p.measured, holderUncached)
		if wait = holderTTFT - (step + prefill); wait <= tieEpsilon {
			wait = 0 // no later than an idle pod, up to rounding
		}
	}
	perRequest := c.m.waits.add(key, wait)
	if wait > 0 && capacity > 0 && p.meanUn > 0 {
		credit = perRequest * capacity / p.meanUn
	}
	return wait, credit, key
}

// waitMemory is how many of a cluster's decisions its prefixes' copy waits
// are averaged over (prefixWaits): enough that the half steps a hot
// prefix's requests wait now and then make a steady mean, few enough that a
// prefix that cooled stops drawing copies within a few hundred requests.
const waitMemory = 256

// maxPrefixes bounds the prefixes prefixWaits remembers: past it those
// whose waits have decayed below e⁻⁸ go, then all.
const maxPrefixes = 1 << 14

// prefixKey names a cached prefix of a cluster: the hash of its last block.
type prefixKey struct{ cluster, hash string }

// prefixWaits sums, per prefix, the copy waits its requests paid
// (CacheAware.copyCredit) and counts them, and counts the cluster's
// decisions, all decayed by 1/waitMemory per decision of the cluster: the
// sum over the decisions is the prefix's copy wait per request of the
// cluster. Each gateway counts its own decisions: with several, each sees
// a fair sample of the cluster's, and the credit, a wait per request times
// a turnover in requests, comes out alike on each. Safe for concurrent
// use.
type prefixWaits struct {
	mu       sync.Mutex
	prefixes map[prefixKey]*prefixWait
	clusters map[string]*clusterCount
}

type prefixWait struct {
	sum   float64 // seconds, decayed to the cluster's decision at
	waits float64 // how many, likewise
	at    uint64
}

type clusterCount struct {
	decisions uint64  // counted
	n         float64 // decayed count
}

// add counts a decision of k's cluster and returns k's copy waits per
// decision before it, then adds wait to k's (k.hash "": the decision names
// no prefix).
func (w *prefixWaits) add(k prefixKey, wait float64) float64 {
	const keep = 1 - 1.0/waitMemory
	w.mu.Lock()
	defer w.mu.Unlock()
	c := w.clusters[k.cluster]
	if c == nil {
		if len(w.clusters) >= maxFitPods {
			clear(w.clusters)
		}
		c = &clusterCount{}
		w.clusters[k.cluster] = c
	}
	c.decisions++
	c.n = c.n*keep + 1
	if k.hash == "" {
		return 0
	}
	e := w.prefixes[k]
	if e == nil {
		if wait <= 0 {
			return 0
		}
		if len(w.prefixes) >= maxPrefixes {
			for k, e := range w.prefixes {
				if w.clusters[k.cluster] == nil || w.clusters[k.cluster].decisions-e.at > 8*waitMemory {
					delete(w.prefixes, k)
				}
			}
			if len(w.prefixes) >= maxPrefixes {
				clear(w.prefixes)
			}
		}
		w.prefixes[k] = &prefixWait{sum: wait, waits: 1, at: c.decisions}
		return 0
	}
	decay := math.Pow(keep, float64(c.decisions-e.at))
	earlier, waits := e.sum*decay, e.waits*decay
	e.sum, e.waits, e.at = earlier+wait, waits, c.decisions
	if wait > 0 {
		e.waits++
	}
	// Waits are events: from k of them the prefix's rate is known to
	// about √k, and the copy is paid for sure, so they count one standard
	// error low, (k − √k)/k of their sum: one wait alone buys no copy.
	if waits <= 1 {
		return 0
	}
	return earlier * (1 - 1/math.Sqrt(waits)) / c.n
}

// debug logs one line with every pod's predicted TTFT by part.
func (c *CacheAware) debug(s *State, p *predictor, costs []Cost, fleetWaiting float64, pick, ties int, prefix prefixKey, wait, credit float64) {
	pods := make([]any, 0, len(s.Hosts))
	for i := range s.Hosts {
		h, k := &s.Hosts[i], &costs[i]
		pods = append(pods, slog.Group(k.Host, slog.Int64("requests", h.Reqs), slog.Float64("cache_ratio", h.CacheRatio),
			slog.Int64("waiting", h.Waiting), slog.Int64("running", h.Running), slog.Int64("max_running", h.MaxRunning),
			slog.Float64("total", k.Total), slog.Float64("delay", k.Delay(fleetWaiting)), slog.Float64("evict", k.Evict),
			slog.Float64("slot_wait", k.SlotWait),
			slog.Float64("in_step", k.InStep),
			slog.Float64("kv_short_tokens", k.KVShortTokens), slog.Int("shared_blocks", h.SharedBlocks),
			slog.Float64("queued_tokens", k.QueuedTokens), slog.Float64("queue", k.Queue),
			slog.Float64("uncached_tokens", k.UncachedTokens), slog.Float64("prefill", k.Prefill), slog.Float64("step", k.Step),
			slog.Float64("fit_tokens", k.FitTokens), slog.Float64("fit", k.Fit), slog.Bool("measured", k.Measured)))
	}
	c.m.log.LogAttrs(context.Background(), slog.LevelDebug, "cache_aware",
		slog.String("cluster", s.Cluster), slog.String("host", s.Hosts[pick].Address),
		slog.Int("near_ties", ties), slog.Float64("bytes_per_token", p.bpt), slog.Float64("tail_bytes", p.tail),
		slog.Float64("fleet_waiting", fleetWaiting), slog.Float64("served_share", p.served),
		slog.String("prefix", prefix.hash), slog.Float64("copy_wait", wait), slog.Float64("copy_credit", credit),
		slog.Group("pods", pods...))
}
