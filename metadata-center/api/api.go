// Package api holds the wire types of the metadata-center HTTP API v1.
//
// The server (metadata-center), its clients in the filter, and the workers'
// eviction reports all marshal these same structs, so a field renamed here is
// renamed everywhere at once. Hosts are always "ip:port"; prefix hashes are
// the filter's chained murmur3 values in their 16-lowercase-hex wire form.
package api

import (
	"encoding/json"
	"fmt"
	"strings"
)

// Paths of the v1 API.
const (
	PathLoadStats       = "/v1/load/stats"        // GET (query) / POST (add) / DELETE (done)
	PathLoadStatsPrompt = "/v1/load/stats/prompt" // DELETE: first token seen
	PathCacheQuery      = "/v1/cache/query"
	PathCacheSave       = "/v1/cache/save"
	PathCacheEvict      = "/v1/cache/evict"
	PathCacheRetract    = "/v1/cache/retract" // POST: withdraw a save (the request failed before its first token)
	PathRouteQuery      = "/v1/route/query"
	PathPodSignals      = "/v1/pods/signals"    // POST: a pod reports itself; GET ?cluster=C: fresh reports
	PathPods            = "/v1/pods"            // GET ?cluster=C: the pods' live registrations
	PathPodsDiscovered  = "/v1/pods/discovered" // POST: a gateway announces the pods it routes to
	PathHealthz         = "/healthz"
	PathReadyz          = "/readyz"
	PathMetrics         = "/metrics"
)

// MaxHashes bounds every hashes array a request may carry.
const MaxHashes = 4096

// EndpointStats is the load of one host: live request leases and the prompt
// length of those that have not produced their first token yet.
type EndpointStats struct {
	TotalReqs    int64 `json:"total_reqs"`
	PromptLength int64 `json:"prompt_length"`
}

// LoadStats maps host -> stats, the answer of GET /v1/load/stats.
type LoadStats map[string]EndpointStats

// AddRequest is the body of POST /v1/load/stats.
type AddRequest struct {
	Cluster      string `json:"cluster"`
	Host         string `json:"host"`
	RequestID    string `json:"request_id"`
	PromptLength int64  `json:"prompt_length"`
}

// RequestRef names one request lease: DELETE /v1/load/stats and
// DELETE /v1/load/stats/prompt.
type RequestRef struct {
	Cluster   string `json:"cluster"`
	Host      string `json:"host"`
	RequestID string `json:"request_id"`
}

// CacheQuery is the body of POST /v1/cache/query.
type CacheQuery struct {
	Cluster string   `json:"cluster"`
	Hashes  []string `json:"hashes"`
}

// CacheLocation says that Host holds the first Length blocks of the queried prefix.
type CacheLocation struct {
	Host   string `json:"host"`
	Length int    `json:"length"`
}

// CacheSave is the body of POST /v1/cache/save. ChunkSize is the gateway's
// prompt_hash.chunk_size (0: not said); the metadata center learns it per
// cluster to check the workers' eviction reports against it.
//
// SaveID, optional, names the save so that a CacheRetract can withdraw it
// later; the gateway uses the request's lease id.
//
// RefreshOnly makes the save a confirmation: entries Host already holds get
// their TTL restarted and SaveID as their save id, keeping their save
// time; hashes it does not hold are skipped, never inserted. The gateway
// confirms this way what it saved at routing time, so a confirmation
// cannot bring back an entry the pod evicted, whichever of the two reports
// arrives first (docs/metadata-center.md, "Versions").
//
// AgeMS, optional, is how long before the call left the save was made (the
// gateway's routing decision; the gateway sends its saves batched and
// asynchronously). The metadata center dates the save that much before it
// received the call, so that a save which arrives after the pod's report
// of a later eviction does not bring the prefix back (docs/metadata-center.md,
// "Versions"). 0: dated on arrival.
//
// MaxEntries, optional, is how many entries Host can hold at most: the
// gateway sends its pod's reported KV capacity in prompt-hash blocks, and
// the metadata center forgets Host's least recently saved entries past it,
// as the pod's cache evicts them without telling anyone (docs/metadata-
// center.md, "Capacity"). 0: no bound.
type CacheSave struct {
	Cluster     string   `json:"cluster"`
	Host        string   `json:"host"`
	Hashes      []string `json:"hashes"`
	ChunkSize   int      `json:"chunk_size,omitempty"`
	SaveID      string   `json:"save_id,omitempty"`
	RefreshOnly bool     `json:"refresh_only,omitempty"`
	AgeMS       int64    `json:"age_ms,omitempty"`
	MaxEntries  int      `json:"max_entries,omitempty"`
}

// MaxSaveAgeMS bounds a save's AgeMS; an older one is refused with 400.
const MaxSaveAgeMS = 600_000

// CacheRetract is the body of POST /v1/cache/retract: the request that
// saved Hashes on Host under SaveID failed before its first token, so the
// pod never built that cache. Entries whose last save is another one (a
// request routed there since) stay.
type CacheRetract struct {
	Cluster string   `json:"cluster"`
	Host    string   `json:"host"`
	Hashes  []string `json:"hashes"`
	SaveID  string   `json:"save_id"`
}

// CacheEvict is the body of POST /v1/cache/evict: either the listed hashes or,
// with All, everything the host holds (a restarted pod). ChunkSize is the
// chunk size the worker hashed with (0: not said); hashes made with another
// size than the cluster's gateways use name no indexed prefix, so such a
// report is refused with 409 rather than silently matching nothing.
//
// EvictedAt, optional, is when the pod evicted (Unix milliseconds, the
// pod's clock; with All, when it started): only entries saved at or before
// it are removed, so a report that arrives late never removes a newer save
// (docs/metadata-center.md, "Versions"). 0: remove whatever the save time.
type CacheEvict struct {
	Cluster   string   `json:"cluster"`
	Host      string   `json:"host"`
	Hashes    []string `json:"hashes,omitempty"`
	All       bool     `json:"all,omitempty"`
	ChunkSize int      `json:"chunk_size,omitempty"`
	EvictedAt int64    `json:"evicted_at,omitempty"`
}

// RouteQuery is the body of POST /v1/route/query.
type RouteQuery struct {
	Cluster string   `json:"cluster"`
	Hashes  []string `json:"hashes"`
}

// RouteAnswer carries load, cache locations and the pods' fresh signals of
// one cluster together. Signals is omitted when no pod has reported lately.
//
// Pods carries, per registered pod, what label selectors match on (labels
// and LoRA adapters); it is omitted when no pod of the cluster holds a live
// registration.
type RouteAnswer struct {
	Load    LoadStats             `json:"load"`
	Cache   []CacheLocation       `json:"cache"`
	Signals map[string]PodSignals `json:"signals,omitempty"`
	Pods    map[string]PodLabels  `json:"pods,omitempty"`
}

// MediaRouteCompact is the media type of the route answer's compact form,
// CompactRouteAnswer. A client that lists it in its Accept header gets
// that form, with this Content-Type; any other client, and a metadata
// center that predates it, gets RouteAnswer as application/json.
const MediaRouteCompact = "application/vnd.llmf.route-compact+json"

// CompactRouteAnswer is RouteAnswer with every host named once: a 64-host
// answer is ≈ 2 KiB instead of ≈ 6 KiB (one write and one read on each
// side instead of two, docs/metadata-center.md). Hosts lists the cache's
// hosts first, in RouteAnswer.Cache's order, so Cache[i] is the length
// held by Hosts[i]; then the hosts that only have load. Load holds one
// triple (index into Hosts, total_reqs, prompt_length) per host with a
// live lease. Signals and Pods are RouteAnswer's.
type CompactRouteAnswer struct {
	Hosts   []string              `json:"hosts"`
	Cache   []int                 `json:"cache"`
	Load    []int64               `json:"load"`
	Signals map[string]PodSignals `json:"signals,omitempty"`
	Pods    map[string]PodLabels  `json:"pods,omitempty"`
}

// DecodeRouteAnswer reads a route answer in the form its Content-Type
// names: CompactRouteAnswer for MediaRouteCompact (parameters ignored),
// RouteAnswer's JSON otherwise.
func DecodeRouteAnswer(contentType string, raw []byte) (RouteAnswer, error) {
	mt, _, _ := strings.Cut(contentType, ";")
	if strings.TrimSpace(mt) != MediaRouteCompact {
		var a RouteAnswer
		err := json.Unmarshal(raw, &a)
		return a, err
	}
	var c CompactRouteAnswer
	if err := json.Unmarshal(raw, &c); err != nil {
		return RouteAnswer{}, err
	}
	return c.Expand()
}

// Expand returns the RouteAnswer c stands for.
func (c *CompactRouteAnswer) Expand() (RouteAnswer, error) {
	if len(c.Cache) > len(c.Hosts) || len(c.Load)%3 != 0 {
		return RouteAnswer{}, fmt.Errorf("compact route answer: %d hosts, %d cache lengths, %d load values",
			len(c.Hosts), len(c.Cache), len(c.Load))
	}
	a := RouteAnswer{Load: make(LoadStats, len(c.Load)/3), Cache: make([]CacheLocation, len(c.Cache)),
		Signals: c.Signals, Pods: c.Pods}
	for i, n := range c.Cache {
		a.Cache[i] = CacheLocation{Host: c.Hosts[i], Length: n}
	}
	for i := 0; i < len(c.Load); i += 3 {
		h := c.Load[i]
		if h < 0 || h >= int64(len(c.Hosts)) {
			return RouteAnswer{}, fmt.Errorf("compact route answer: load of host %d of %d", h, len(c.Hosts))
		}
		if _, dup := a.Load[c.Hosts[h]]; dup {
			return RouteAnswer{}, fmt.Errorf("compact route answer: load of %s twice", c.Hosts[h])
		}
		a.Load[c.Hosts[h]] = EndpointStats{TotalReqs: c.Load[i+1], PromptLength: c.Load[i+2]}
	}
	return a, nil
}

// PodLabels is the part of a registration the route query answers: what
// the filter's label selectors match.
type PodLabels struct {
	Labels   map[string]string `json:"labels,omitempty"`
	Adapters []string          `json:"adapters,omitempty"`
}

// PodSignals is what a pod says about itself: its own queue, running set
// and KV cache, which the gateway cannot see from its leases (requests of
// other gateways, preemptions, how full the cache really is).
type PodSignals struct {
	Waiting int64 `json:"waiting"` // requests waiting for a running slot (a scraped pod: its waiting gauge)
	Running int64 `json:"running"` // requests running
	// KVCacheUtil is the KV cache running requests hold, of all of it,
	// 0..1: idle cached blocks count as free, as in vLLM's
	// kv_cache_usage_perc (they are evicted as soon as room is needed).
	KVCacheUtil   float64 `json:"kv_cache_util"`
	PrefillTokens int64   `json:"prefill_tokens"` // prompt tokens still to prefill
	// KVCapacity is the tokens the pod's KV cache holds in all (vLLM:
	// num_gpu_blocks × block_size of vllm:cache_config_info; SGLang:
	// sglang:max_total_num_tokens), MaxRunning the requests it runs at
	// most (its max_num_seqs); 0 = not reported.
	KVCapacity int64 `json:"kv_capacity,omitempty"`
	MaxRunning int64 `json:"max_running,omitempty"`
	// What the pod's compute costs, as it measures its own steps (our
	// worker; 0 = not reported, as from a scraped pod): PrefillQueue is
	// PrefillTokens request by request with their compute at that cost,
	// fewest tokens first (the order our worker prefills them in); a
	// prompt of n tokens written after c cached cells takes about
	// TokenSeconds·n + AttentionSeconds·(n·c + n(n+1)/2) (each token
	// attends to the cells before it); StepSeconds is one decode step of
	// its running set with a new request's first token in it;
	// StepLeftSeconds is what was left of the step in progress when the
	// report was taken, and PrefillTokens and PrefillQueue count what is
	// left once it ends (a request arriving then waits for the step, then
	// for the queue ahead of it).
	PrefillQueue     []Prefill `json:"prefill_queue,omitempty"`
	TokenSeconds     float64   `json:"token_seconds,omitempty"`
	AttentionSeconds float64   `json:"attention_seconds,omitempty"`
	StepSeconds      float64   `json:"step_seconds,omitempty"`
	StepLeftSeconds  float64   `json:"step_left_seconds,omitempty"`
	// A prompt the pod holds back while the answers about to end decode
	// (our worker's finish first), with nothing else running: once they
	// have ended, in HoldLeftSeconds from when the report was taken, it
	// steps alone for HeldStepSeconds, and a request arriving then waits
	// for that step; HeldTokens is what it has left to prefill (it is in
	// PrefillQueue too). 0 = none.
	HeldStepSeconds float64 `json:"held_step_seconds,omitempty"`
	HoldLeftSeconds float64 `json:"hold_left_seconds,omitempty"`
	HeldTokens      int64   `json:"held_tokens,omitempty"`
	// ReportsEvictions: the pod tells the metadata center what its KV
	// cache evicts (our worker, POST /v1/cache/evict), so the index knows
	// what it holds; for the others (vLLM, SGLang: scraped) the gateways
	// bound the index by the pod's KV capacity (CacheSave.MaxEntries).
	ReportsEvictions bool `json:"reports_evictions,omitempty"`
	// Draining: the pod is shutting down and answers new requests 503 with
	// Retry-After (our worker on SIGTERM, docs/worker.md "Shutdown"); the
	// gateways route around it while another pod is left.
	Draining bool `json:"draining,omitempty"`
	// AgeMS is how long ago the metadata center received the report (in
	// answers only; ignored in reports).
	AgeMS int64 `json:"age_ms,omitempty"`
}

// Prefill is one request's prompt tokens a pod has still to compute and
// what computing them costs it, in seconds (PodSignals.PrefillQueue).
type Prefill struct {
	Tokens  int64   `json:"tokens"`
	Seconds float64 `json:"seconds"`
}

// MaxPrefillQueue bounds a report's PrefillQueue; a longer one is refused
// with 400 (our worker sums its longest past 32).
const MaxPrefillQueue = 64

// PodReport is the body of POST /v1/pods/signals.
type PodReport struct {
	Cluster       string  `json:"cluster"`
	Host          string  `json:"host"`
	Waiting       int64   `json:"waiting"`
	Running       int64   `json:"running"`
	KVCacheUtil   float64 `json:"kv_cache_util"`
	PrefillTokens int64   `json:"prefill_tokens"`
	KVCapacity    int64   `json:"kv_capacity,omitempty"`
	MaxRunning    int64   `json:"max_running,omitempty"`
	// The compute's cost: PodSignals' fields of these names.
	PrefillQueue     []Prefill `json:"prefill_queue,omitempty"`
	TokenSeconds     float64   `json:"token_seconds,omitempty"`
	AttentionSeconds float64   `json:"attention_seconds,omitempty"`
	StepSeconds      float64   `json:"step_seconds,omitempty"`
	StepLeftSeconds  float64   `json:"step_left_seconds,omitempty"`
	HeldStepSeconds  float64   `json:"held_step_seconds,omitempty"`
	HoldLeftSeconds  float64   `json:"hold_left_seconds,omitempty"`
	HeldTokens       int64     `json:"held_tokens,omitempty"`
	// ReportsEvictions: PodSignals.ReportsEvictions.
	ReportsEvictions bool `json:"reports_evictions,omitempty"`
	Draining         bool `json:"draining,omitempty"`
	// Register, when present, (re)registers the pod: its labels, models
	// and adapters, refreshing their TTL.
	Register *PodRegistration `json:"register,omitempty"`
}

// PodRegistration is the static part of what a pod says about itself: what
// it serves and how it is labelled. Our worker sends it inside a PodReport
// at start and every few seconds (not with every signal push); the metadata
// center keeps it until TTLMS passes without a refresh.
type PodRegistration struct {
	Models   []string          `json:"models,omitempty"`   // model ids served (the base model)
	Labels   map[string]string `json:"labels,omitempty"`   // label selectors match these
	Adapters []string          `json:"adapters,omitempty"` // LoRA adapters loaded: `lora` selects them
	// TTLMS is how long the registration holds without a refresh (0: the
	// metadata center's default, DefaultRegistrationTTLMS). In answers it
	// is the time left.
	TTLMS int64 `json:"ttl_ms,omitempty"`
}

// PodLabels returns what the route query answers of the registration.
func (r PodRegistration) PodLabels() PodLabels {
	return PodLabels{Labels: r.Labels, Adapters: r.Adapters}
}

// PodsAnnouncement is the body of POST /v1/pods/discovered: the pods a
// gateway routes to in one cluster (from its endpoint source: Envoy's
// admin API in the mesh, a static list otherwise) and the backend its rule
// names. The metadata center scrapes the /metrics of those that run a
// backend it can read (vllm, sglang, llamacpp) and do not push their own
// signals (docs/metadata-center.md, "Pod signals").
type PodsAnnouncement struct {
	Cluster string   `json:"cluster"`
	Backend string   `json:"backend"`
	Hosts   []string `json:"hosts"`
	// TTLMS is how long the announcement holds without a refresh (0:
	// DefaultAnnouncementTTLMS).
	TTLMS int64 `json:"ttl_ms,omitempty"`
}

// Limits of an announcement; a bigger one is refused with 400.
const (
	DefaultAnnouncementTTLMS = 30_000
	MaxAnnouncementTTLMS     = 600_000
	MaxAnnouncedHosts        = 4096
)

// Limits of a registration; a bigger one is refused with 400.
const (
	DefaultRegistrationTTLMS = 30_000
	MinRegistrationTTLMS     = 1_000
	MaxRegistrationTTLMS     = 600_000
	MaxPodLabels             = 64
	MaxPodAdapters           = 64
	MaxPodModels             = 16
	MaxLabelKeyLen           = 253
	MaxLabelValueLen         = 256
)

// Signals returns the report's signals.
func (r PodReport) Signals() PodSignals {
	return PodSignals{Waiting: r.Waiting, Running: r.Running, KVCacheUtil: r.KVCacheUtil, PrefillTokens: r.PrefillTokens,
		KVCapacity: r.KVCapacity, MaxRunning: r.MaxRunning, PrefillQueue: r.PrefillQueue, TokenSeconds: r.TokenSeconds,
		AttentionSeconds: r.AttentionSeconds, StepSeconds: r.StepSeconds, StepLeftSeconds: r.StepLeftSeconds,
		HeldTokens: r.HeldTokens, HeldStepSeconds: r.HeldStepSeconds, HoldLeftSeconds: r.HoldLeftSeconds,
		ReportsEvictions: r.ReportsEvictions, Draining: r.Draining}
}

// Report returns the report of host in cluster carrying s, Signals'
// inverse (AgeMS aside: answers only), and reg when not nil. The two sit
// together so that a field added to both types is carried both ways.
func (s PodSignals) Report(cluster, host string, reg *PodRegistration) PodReport {
	return PodReport{Cluster: cluster, Host: host, Waiting: s.Waiting, Running: s.Running, KVCacheUtil: s.KVCacheUtil,
		PrefillTokens: s.PrefillTokens, KVCapacity: s.KVCapacity, MaxRunning: s.MaxRunning,
		PrefillQueue: s.PrefillQueue, TokenSeconds: s.TokenSeconds, AttentionSeconds: s.AttentionSeconds, StepSeconds: s.StepSeconds,
		StepLeftSeconds: s.StepLeftSeconds, HeldTokens: s.HeldTokens, HeldStepSeconds: s.HeldStepSeconds, HoldLeftSeconds: s.HoldLeftSeconds,
		ReportsEvictions: s.ReportsEvictions, Draining: s.Draining, Register: reg}
}

// MaxPodSignals bounds the pods one cluster keeps signals for.
const MaxPodSignals = 4096

// Error is the body of every error answer, in the project's error format (docs/metadata-center.md, "Errors").
type Error struct {
	Error   ErrorDetail `json:"error"`
	TraceID string      `json:"trace_id,omitempty"`
}

// ErrorDetail is the inner object of Error.
type ErrorDetail struct {
	Code    int    `json:"code"`
	Type    string `json:"type"`
	Message string `json:"message"`
}

// PathBatch takes a batch of asynchronous updates in one call.
const PathBatch = "/v1/batch"

// MaxBatchOps bounds the updates one batch may carry.
const MaxBatchOps = 1024

// Kinds of BatchOp.Op: the same updates as the single calls.
const (
	OpAddRequest = "add_request" // POST /v1/load/stats
	OpFirstToken = "first_token" // DELETE /v1/load/stats/prompt
	OpDone       = "done"        // DELETE /v1/load/stats
	OpCacheSave  = "cache_save"  // POST /v1/cache/save
	// OpCacheRetract is POST /v1/cache/retract.
	OpCacheRetract = "cache_retract"
)

// BatchOp is one update of a batch; the fields are those of the single
// call named by Op.
type BatchOp struct {
	Op           string   `json:"op"`
	Cluster      string   `json:"cluster"`
	Host         string   `json:"host"`
	RequestID    string   `json:"request_id,omitempty"`
	PromptLength int64    `json:"prompt_length,omitempty"`
	Hashes       []string `json:"hashes,omitempty"`
	ChunkSize    int      `json:"chunk_size,omitempty"`
	SaveID       string   `json:"save_id,omitempty"`
	RefreshOnly  bool     `json:"refresh_only,omitempty"` // cache_save only
	AgeMS        int64    `json:"age_ms,omitempty"`       // cache_save only (CacheSave)
	MaxEntries   int      `json:"max_entries,omitempty"`  // cache_save only (CacheSave)
}

// Batch is the body of POST /v1/batch: updates applied in order (so one
// request's add, first token and done keep their order), in one round trip
// to the store. The whole batch is checked before any of it is applied: one
// bad update refuses the batch with 400 naming its index.
type Batch struct {
	Ops []BatchOp `json:"ops"`
}

// BatchAnswer is the answer of POST /v1/batch.
type BatchAnswer struct {
	Applied int `json:"applied"`
}

// PathDebugCacheIndex (GET ?cluster=C) lists the cache index as queries
// see it: {"<host>": ["<hash>", ...]}, each host's hashes sorted. It walks
// the whole cluster, so it is for operators and checks, not for routing;
// it needs the token like every API call.
const PathDebugCacheIndex = "/debug/cache/index"
