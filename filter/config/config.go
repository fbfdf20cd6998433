// Package config is the filter's configuration: the `filter:` document of
// docs/configuration.md, as Envoy delivers it (plugin_config: an Any holding an
// xds.type.v3.TypedStruct) and as the standalone gateway reads it (YAML or
// JSON). Parsing is strict: an unknown key or an invalid value is refused
// with an error naming its key path, e.g.
//
//	lb_mapping_rule.default.candidate_percent: must be in 1..100, got 0
//
// Defaults are applied, so every field of a parsed Config is usable as is.
package config

import (
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// Defaults of the keys that may be omitted.
const (
	DefaultProtocol         = "openai"
	DefaultQueryTimeout     = 100 * time.Millisecond
	DefaultUpdateTimeout    = 500 * time.Millisecond
	DefaultChunkSize        = prefix.DefaultChunkSize
	DefaultBackend          = BackendVLLM
	DefaultPolicy           = PolicyCacheAware
	DefaultCacheRatioW      = 2.0
	DefaultRequestLoadW     = 1.0
	DefaultPrefillLoadW     = 3.0
	DefaultCandidatePercent = 10
	// cache_aware's defaults (filter/balancer/ttft.go says why each).
	DefaultTieEpsilon   = 0.05
	DefaultPrefillRate  = 5000.0
	DefaultDecodeStep   = 0.025
	DefaultAdminRefresh = time.Second
	DefaultQueueSize    = 4096
	DefaultWorkers      = 4
	DefaultDrainTimeout = 2 * time.Second
	DefaultBatchWindow  = 5 * time.Millisecond
	DefaultBatchMaxOps  = 256
	DefaultMaxBodyBytes = 8 << 20
)

// Load-balancing policies (lb_mapping_rule.*.policy).
const (
	PolicyCacheAware   = "cache_aware"   // the lowest predicted time to first token, near-ties spread
	PolicyRoundRobin   = "round_robin"   // baseline: ignores load and cache
	PolicyRandom       = "random"        // baseline: uniform
	PolicyLeastRequest = "least_request" // fewest live requests, ties random
	PolicyPrefixOnly   = "prefix_only"   // longest cached prefix, ties random
)

// Policies lists the policy names every build knows. The balancer adds
// profiles (seed, epp, sglang) and any registered from Go; the engine checks
// a rule's names against it when it starts.
func Policies() []string {
	return []string{PolicyCacheAware, PolicyRoundRobin, PolicyRandom, PolicyLeastRequest, PolicyPrefixOnly}
}

// Backends of model_mapping_rule.*.backend. All but triton speak the OpenAI
// API and get the request unchanged.
const (
	BackendVLLM     = "vllm"
	BackendSGLang   = "sglang"
	BackendLlamaCpp = "llamacpp"
	BackendTriton   = "triton"
)

// Backends lists the valid backend names.
func Backends() []string {
	return []string{BackendVLLM, BackendSGLang, BackendLlamaCpp, BackendTriton}
}

// Config is the whole `filter:` document.
type Config struct {
	// Protocol (key `protocol`, default "openai") names the transcoder that
	// parses client requests: "openai" passes requests through to OpenAI-speaking
	// backends and translates only for rules with backend triton; "triton"
	// translates every request to Triton's generate API whatever the rule says.
	// Any non-empty name is accepted here; an unregistered one fails every
	// request with 400 "unsupported protocol" (docs/envoy-filter.md).
	Protocol string

	// MetadataCenter is key `metadata_center`.
	MetadataCenter MetadataCenter

	// PromptHash is key `prompt_hash`.
	PromptHash PromptHash

	// ModelMappingRule (key `model_mapping_rule`, required, at least one model)
	// maps the request's "model" to its routing rules. Rules are tried in
	// order of decreasing number of header conditions (stable for equal
	// counts); the first whose conditions all hold wins; a rule without
	// headers is the model's default. At most one default per model, and no
	// two rules of a model with the same header conditions.
	ModelMappingRule map[string][]Rule

	// LBMappingRule is key `lb_mapping_rule`.
	LBMappingRule LBMapping

	// Endpoints is key `endpoints`.
	Endpoints Endpoints

	// Async is key `async`: the dispatcher of metadata-center updates.
	Async Async

	// MaxBodyBytes (key `max_body_bytes`, default 8388608 = 8 MiB, 1..1073741824)
	// refuses larger request bodies with 413 before parsing them.
	MaxBodyBytes int

	// Tracing is key `tracing`: OpenTelemetry spans, off by default.
	Tracing Tracing
}

// Tracing is key `tracing`. Without an endpoint nothing is traced.
type Tracing struct {
	// OTLPEndpoint (key `otlp_endpoint`) is the OTLP/HTTP collector's base
	// URL, e.g. "http://otel-collector.observability:4318"; spans go to its
	// /v1/traces unless the URL names a path. Empty: tracing off.
	OTLPEndpoint string
	// SampleRatio (key `sample_ratio`, default 1, 0..1) is the share of
	// new traces sampled; a request arriving with a sampled traceparent is
	// always traced.
	SampleRatio float64
}

// DefaultSampleRatio is the default of tracing.sample_ratio.
const DefaultSampleRatio = 1.0

// MetadataCenter is key `metadata_center`. The whole key may be omitted (or
// address left empty): there is then no metadata center, every route query
// is treated as failed (zero cache, load from this gateway's own requests:
// docs/envoy-filter.md) and no updates are sent. Policies round_robin and random never need it.
type MetadataCenter struct {
	// Address (key `address`) is the base URL, scheme http or https with a
	// host and no query or fragment, e.g. "http://127.0.0.1:8080". A trailing
	// slash is removed.
	Address string
	// QueryTimeout (key `query_timeout`, default 100ms, 1ms..10s) bounds the
	// synchronous route query made for each request.
	QueryTimeout time.Duration
	// UpdateTimeout (key `update_timeout`, default 500ms, 1ms..60s) bounds
	// each asynchronous update (add, first token, done, cache save).
	UpdateTimeout time.Duration
	// AuthToken (key `auth_token`, optional) is sent as "Authorization: Bearer <token>".
	AuthToken string
	// AuthTokenFile (key `auth_token_file`, optional, instead of
	// AuthToken) is the path of a file holding the token, e.g. a mounted
	// Secret; it is read again when it changes.
	AuthTokenFile string
	// TLS (key `tls`, optional) verifies an https:// metadata center.
	TLS *MetadataCenterTLS
}

// MetadataCenterTLS is key `metadata_center.tls`.
type MetadataCenterTLS struct {
	// CAFile (key `ca_file`) is the PEM CA bundle the metadata center's
	// certificate is verified against; empty: the system's roots.
	CAFile string
	// ServerName (key `server_name`) is the name the certificate must
	// carry; empty: the address's host.
	ServerName string
	// InsecureSkipVerify (key `insecure_skip_verify`, default false) skips
	// verification: encryption without knowing who answers.
	InsecureSkipVerify bool
}

// PromptHash is key `prompt_hash`.
type PromptHash struct {
	// ChunkSize (key `chunk_size`, default 512, 16..1048576) is the block size
	// in bytes of the chained prompt hashes. Every party (filter, workers)
	// must use the same value, or no prefix will ever match.
	ChunkSize int
}

// Rule is one element of model_mapping_rule.<model>.
type Rule struct {
	// Headers (key `headers`, optional) are request header conditions, name
	// -> exact value; names are matched case-insensitively (stored lower case).
	Headers map[string]string
	// Cluster (key `cluster`, required) is the Envoy cluster to route to,
	// e.g. "outbound|8000||qwen.llm.svc.cluster.local".
	Cluster string
	// Backend (key `backend`, default "vllm") is one of vllm, sglang,
	// llamacpp, triton: what the cluster's pods speak.
	Backend string
	// SceneName (key `scene_name`, optional) labels logs and metrics.
	SceneName string
	// Selector (key `selector`, optional) is a label selector (label ->
	// value) every endpoint chosen for this rule must carry, on top of the
	// request's own selector; e.g. a pool or hardware class.
	Selector map[string]string
}

// LBMapping is key `lb_mapping_rule`: key `default` plus one key per cluster
// name. A cluster entry overrides only the keys it sets; the rest come from
// `default`, whose own omitted keys take the defaults below.
type LBMapping struct {
	Default  LBRule
	Clusters map[string]LBRule
}

// For returns the rule of a cluster, falling back to the default.
func (m LBMapping) For(cluster string) LBRule {
	if r, ok := m.Clusters[cluster]; ok {
		return r
	}
	return m.Default
}

// LBRule is one entry of lb_mapping_rule. The weights and candidate_percent
// are the seed profile's score (docs/configuration.md):
// score = W1·cacheRatio − W2'·(reqs−minReqs)/delta − W3·prompt/maxPrompt;
// tie_epsilon, default_prefill_rate and default_decode_step are cache_aware's.
type LBRule struct {
	// Policy (key `policy`, default "cache_aware") names a policy or scoring
	// profile of the balancer: cache_aware, seed, epp, sglang, round_robin,
	// random, least_request, prefix_only, or one registered from Go.
	// Parsing accepts any name of [a-z0-9_]; the engine refuses unknown ones
	// when it starts.
	Policy string
	// Scorers (key `scorers`, optional) replaces the profile's scorers:
	// scorer name -> weight (0..1000).
	Scorers map[string]float64
	// Filters (key `filters`, optional) replaces the profile's pod filters
	// (names, applied in order); an empty list removes them.
	Filters []string
	// Picker (key `picker`, optional) replaces the profile's picker:
	// top_percent or max_score.
	Picker string
	// CacheRatioWeight (key `cache_ratio_weight`, W1, default 2, 0..1000).
	CacheRatioWeight float64
	// RequestLoadWeight (key `request_load_weight`, W2, default 1, 0..1000).
	RequestLoadWeight float64
	// PrefillLoadWeight (key `prefill_load_weight`, W3, default 3, 0..1000).
	PrefillLoadWeight float64
	// CandidatePercent (key `candidate_percent`, default 10, 1..100): the
	// pick is uniform among the top max(1, n·percent/100) scores.
	CandidatePercent int
	// TieEpsilon (key `tie_epsilon`, default 0.05, 0..1) is cache_aware's
	// near-tie window, a fraction of the lowest predicted time to first
	// token: among the pods predicted within (1+TieEpsilon) times the best
	// the pick takes the one that computes the fewest of the request's
	// tokens, then the one with the fewest requests in flight, uniformly
	// among equals. About the model's median error in
	// steady state (2–5% on the simulated fleet), so that pods it cannot
	// tell apart share the traffic instead of every gateway sending the
	// next burst to the same one, while a one-request difference in queue
	// still counts.
	TieEpsilon float64
	// DefaultPrefillRate (key `default_prefill_rate`, tokens per second,
	// default 5000, 10..1e7) is the cluster's prefill rate until the TTFTs
	// observed on its pods give their own. The low end of a mid-size model on one
	// GPU (5–20k tokens/s), so that an unknown pod's queue is not taken
	// for cheaper than it is.
	DefaultPrefillRate float64
	// DefaultDecodeStep (key `default_decode_step`, seconds, default
	// 0.025, 0.0001..10) is a pod's decode step (the first token after
	// prefill; 128 of them are a request's assumed hold on its running
	// slot) until the cluster's observed TTFTs (and the pod's request
	// ends) give its own: a 7–8B
	// model's step at a moderate batch on one GPU is 20–30 ms.
	DefaultDecodeStep float64
}

// Endpoints is key `endpoints`: where the pods of a cluster come from. Both
// may be set: a cluster listed under static uses that list, every other
// cluster is discovered through the Envoy admin API.
type Endpoints struct {
	// EnvoyAdmin is key `envoy_admin` (optional).
	EnvoyAdmin *EnvoyAdmin
	// Static (key `static`, optional) pins cluster -> ["ip:port", ...];
	// addresses must be literal IPs with a non-zero port. An entry may also
	// be {address: "ip:port", labels: {k: v}}: the labels label selectors
	// match (`lora`, `label_selector`, a rule's `selector`).
	Static map[string][]string
	// StaticLabels holds the labels of static entries that have some:
	// cluster -> address -> labels.
	StaticLabels map[string]map[string]map[string]string
}

// EnvoyAdmin is key `endpoints.envoy_admin`.
type EnvoyAdmin struct {
	// Address (key `address`, required) is the admin base URL, e.g.
	// "http://127.0.0.1:15000".
	Address string
	// Refresh (key `refresh`, default 1s, 10ms..10m) is the polling period.
	Refresh time.Duration
}

// Async is key `async`: the bounded queue of metadata-center updates.
// Updates of one request always run in order on one worker.
type Async struct {
	// QueueSize (key `queue_size`, default 4096, 1..1048576) is the total
	// number of queued updates; when full, new ones are dropped and counted.
	QueueSize int
	// Workers (key `workers`, default 4, 1..1024) is the number of goroutines
	// sending updates.
	Workers int
	// DrainTimeout (key `drain_timeout`, default 2s, 0..1m) bounds how long
	// Close waits for queued updates.
	DrainTimeout time.Duration
	// BatchWindow (key `batch_window`, default 5ms, 0..1s) coalesces the
	// updates of this long into one POST /v1/batch, sent by one goroutine
	// in order; 0 sends each update as its own call on the workers.
	BatchWindow time.Duration
	// BatchMaxOps (key `batch_max_ops`, default 256, 1..1024) sends a batch
	// early once it holds this many updates.
	BatchMaxOps int
}

// ScrapedClusters maps the clusters of rules whose backend exposes /metrics
// the metadata center reads (vllm, sglang, llamacpp) to that backend: the
// clusters whose pods a gateway announces for scraping.
func (c *Config) ScrapedClusters() map[string]string {
	out := map[string]string{}
	for _, rules := range c.ModelMappingRule {
		for _, r := range rules {
			switch r.Backend {
			case BackendVLLM, BackendSGLang, BackendLlamaCpp:
				if _, ok := out[r.Cluster]; !ok {
					out[r.Cluster] = r.Backend
				}
			}
		}
	}
	return out
}
