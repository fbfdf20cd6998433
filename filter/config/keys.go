package config

import (
	"fmt"
	"strings"
)

// Key is one key of the filter document: the row docs/configuration.md
// shows for it. Keys is generated into that page (go run
// ./internal/confdoc/cmd/gendoc) and checked against the parser by
// TestKeysMatchTheParser: every key the parser allows has exactly one row,
// a row's Default is what the parser fills in when the key is omitted, and
// the ends of its Range are accepted while values past them are refused.
type Key struct {
	// Path names the key from the document's root. <model>, <cluster> and
	// [i] stand for a map key or a list element: lb_mapping_rule's
	// <cluster> is `default` or a cluster's name.
	Path string
	// Type is the YAML/JSON kind: string, integer, number, duration, list,
	// map or object.
	Type string
	// Default is the value the parser uses when the key is omitted, as
	// written in the document; "" when there is none (optional, or required).
	Default string
	// Range is what the parser accepts. For integer, number and duration
	// keys it ends with lo..hi (both accepted), optionally preceded by
	// "0 or " when 0 switches the feature off.
	Range string
	// Unit of the value, where it has one.
	Unit string
	// Meaning says what the key does, in a sentence or two.
	Meaning string
}

// Keys lists every key of the filter document, in the order of
// docs/configuration.md.
var Keys = []Key{
	{Path: "protocol", Type: "string", Default: DefaultProtocol, Range: "non-empty; `openai`, `triton` or one registered from Go",
		Meaning: "The request transcoder. `openai` passes requests through and translates only for rules with `backend: triton`; `triton` translates every request. An unregistered name fails every request with 400."},

	{Path: "metadata_center.address", Type: "string", Range: "`http`/`https` URL with a host, no query, fragment or credentials",
		Meaning: "Base URL of the metadata center. Empty: no metadata center; every request is routed as if its route query failed (the least loaded pod this gateway sees) and no updates are sent."},
	{Path: "metadata_center.query_timeout", Type: "duration", Default: DefaultQueryTimeout.String(), Range: "1ms..10s",
		Meaning: "Budget of the route query made for every request; past it the request is routed as if the query failed."},
	{Path: "metadata_center.update_timeout", Type: "duration", Default: DefaultUpdateTimeout.String(), Range: "1ms..1m",
		Meaning: "Budget of each asynchronous update (lease add, first token, done, cache save) or batch of them."},
	{Path: "metadata_center.auth_token", Type: "string", Range: "no line breaks",
		Meaning: "Sent as `Authorization: Bearer <token>`; must be one the metadata center accepts (`--auth-token` or a line of `--auth-token-file`). Prefer `auth_token_file`: this value is visible to anyone who can read the EnvoyFilter."},
	{Path: "metadata_center.auth_token_file", Type: "string", Range: "a file path; not with `auth_token`",
		Meaning: "File holding the token (its first line), e.g. a Secret mounted into the gateway pod; looked at again every 10s and after a 401, so a rotated Secret takes effect without a restart. An absent or empty file sends no token."},
	{Path: "metadata_center.tls.ca_file", Type: "string", Range: "a PEM file path",
		Meaning: "CA bundle the metadata center's certificate is verified against (`address` must be `https://`); empty: the system's roots. Read when the configuration loads."},
	{Path: "metadata_center.tls.server_name", Type: "string", Range: "a DNS name or IP",
		Meaning: "Name the metadata center's certificate must carry; empty: the host of `address`."},
	{Path: "metadata_center.tls.insecure_skip_verify", Type: "boolean", Default: "false", Range: "true or false; not with `ca_file`",
		Meaning: "Skips verifying the certificate: encrypted, but to whoever answers. For experiments only."},

	{Path: "prompt_hash.chunk_size", Type: "integer", Default: fmt.Sprint(DefaultChunkSize), Range: "16..1048576", Unit: "bytes",
		Meaning: "Block size of the chained prefix hashes; blocks never split a UTF-8 character and end early where a chat message starts. Every party (filter, workers' `--prompt-hash-chunk-size`) must use the same value, or no prefix matches."},

	{Path: "model_mapping_rule.<model>[i].headers", Type: "map", Range: "header name → exact value; names case-insensitive, no duplicates",
		Meaning: "Request header conditions of the rule. A model's rules are tried most conditions first; the rule without headers is the model's default."},
	{Path: "model_mapping_rule.<model>[i].cluster", Type: "string", Range: "required, non-empty",
		Meaning: "The Envoy cluster that serves the rule, e.g. `outbound|8000||qwen.llm.svc.cluster.local`; in the standalone gateway a key of `endpoints.static`."},
	{Path: "model_mapping_rule.<model>[i].backend", Type: "string", Default: DefaultBackend, Range: strings.Join(Backends(), ", "),
		Meaning: "What the cluster's pods speak; all but `triton` get the OpenAI request unchanged. This project's workers are `llamacpp`."},
	{Path: "model_mapping_rule.<model>[i].scene_name", Type: "string", Range: "any",
		Meaning: "Label of the rule in logs and metrics."},
	{Path: "model_mapping_rule.<model>[i].selector", Type: "map", Range: "label → value, as `headers`",
		Meaning: "Endpoint labels every pod chosen for this rule must carry, on top of the request's own selector."},

	{Path: "lb_mapping_rule.<cluster>.policy", Type: "string", Default: DefaultPolicy, Range: "a registered policy: " + strings.Join(Policies(), ", ") + ", seed, epp, sglang",
		Meaning: "What chooses the pod (see Policies and profiles). A cluster's entry overrides only the keys it sets; the rest come from `default`."},
	{Path: "lb_mapping_rule.<cluster>.scorers", Type: "map", Range: "registered scorer → weight 0..1000",
		Meaning: "Replaces the profile's scorers and their weights."},
	{Path: "lb_mapping_rule.<cluster>.filters", Type: "list", Range: "registered pod filter names",
		Meaning: "Replaces the profile's pod filters, applied in order; `[]` removes them."},
	{Path: "lb_mapping_rule.<cluster>.picker", Type: "string", Range: "`top_percent`, `max_score` or registered",
		Meaning: "Replaces the profile's picker."},
	{Path: "lb_mapping_rule.<cluster>.cache_ratio_weight", Type: "number", Default: fmt.Sprint(DefaultCacheRatioW), Range: "0..1000",
		Meaning: "W1: weight of the share of the prompt's blocks a pod already holds."},
	{Path: "lb_mapping_rule.<cluster>.request_load_weight", Type: "number", Default: fmt.Sprint(DefaultRequestLoadW), Range: "0..1000",
		Meaning: "W2: weight of the pod's live requests, `(reqs − min)/delta` with `delta = max(2, max − min)`, raised to `W2·delta/5` past `delta = 5`."},
	{Path: "lb_mapping_rule.<cluster>.prefill_load_weight", Type: "number", Default: fmt.Sprint(DefaultPrefillLoadW), Range: "0..1000",
		Meaning: "W3: weight of the prefill standing before this request's first token on the pod, over the largest such among the pods."},
	{Path: "lb_mapping_rule.<cluster>.candidate_percent", Type: "integer", Default: fmt.Sprint(DefaultCandidatePercent), Range: "1..100", Unit: "percent",
		Meaning: "`top_percent` picks uniformly among the best `max(1, n·percent/100)` pods; below 20 pods that is the best pod alone."},
	{Path: "lb_mapping_rule.<cluster>.tie_epsilon", Type: "number", Default: fmt.Sprint(DefaultTieEpsilon), Range: "0..1", Unit: "fraction of the best prediction",
		Meaning: "`cache_aware`: pods predicted within (1+ε) × the lowest time to first token are near-ties; among them the pick takes the pod that computes the fewest of the request's tokens, then the one with the fewest requests in flight."},
	{Path: "lb_mapping_rule.<cluster>.default_prefill_rate", Type: "number", Default: fmt.Sprint(DefaultPrefillRate), Range: "10..10000000", Unit: "tokens/s",
		Meaning: "`cache_aware`: the cluster's prefill rate until the TTFTs observed on its pods give their own."},
	{Path: "lb_mapping_rule.<cluster>.default_decode_step", Type: "number", Default: fmt.Sprint(DefaultDecodeStep), Range: "0.0001..10", Unit: "s",
		Meaning: "`cache_aware`: the cluster's decode step until the TTFTs observed on its pods give their own (and a pod's slot hold until requests end there)."},

	{Path: "endpoints.envoy_admin.address", Type: "string", Range: "required with `envoy_admin`; `http`/`https` URL",
		Meaning: "Envoy's admin API (in Istio `http://127.0.0.1:15000`), polled at `GET /clusters?format=json` for every cluster's routable hosts."},
	{Path: "endpoints.envoy_admin.refresh", Type: "duration", Default: DefaultAdminRefresh.String(), Range: "10ms..10m",
		Meaning: "Polling period of Envoy's admin API; a pod that left EDS may be chosen for up to this long."},
	{Path: "endpoints.static.<cluster>[i]", Type: "string or object", Range: "`ip:port` (literal IP, non-zero port) or `{address, labels}`",
		Meaning: "A pinned pod of the cluster (standalone gateway, tests). A cluster listed here is not looked up in Envoy's admin API."},
	{Path: "endpoints.static.<cluster>[i].address", Type: "string", Range: "required in the object form; `ip:port`",
		Meaning: "The pod."},
	{Path: "endpoints.static.<cluster>[i].labels", Type: "map", Range: "label → value, as `headers`",
		Meaning: "The pod's labels, matched by a request's `lora` and `label_selector` and a rule's `selector`."},

	{Path: "async.queue_size", Type: "integer", Default: fmt.Sprint(DefaultQueueSize), Range: "1..1048576, ≥ `workers`", Unit: "updates",
		Meaning: "Updates queued for the metadata center; when full, new ones are dropped and counted."},
	{Path: "async.workers", Type: "integer", Default: fmt.Sprint(DefaultWorkers), Range: "1..1024, ≤ `queue_size`", Unit: "goroutines",
		Meaning: "Senders of single updates when `batch_window` is 0; one request's updates run in order on one of them."},
	{Path: "async.drain_timeout", Type: "duration", Default: DefaultDrainTimeout.String(), Range: "0..1m",
		Meaning: "How long a config being replaced waits for its queued updates."},
	{Path: "async.batch_window", Type: "duration", Default: DefaultBatchWindow.String(), Range: "0..1s",
		Meaning: "Updates of this long go as one `POST /v1/batch`, in order; 0: one call per update."},
	{Path: "async.batch_max_ops", Type: "integer", Default: fmt.Sprint(DefaultBatchMaxOps), Range: "1..1024", Unit: "updates",
		Meaning: "A batch leaves early once it holds this many updates."},

	{Path: "max_body_bytes", Type: "integer", Default: fmt.Sprint(DefaultMaxBodyBytes), Range: "1..1073741824", Unit: "bytes",
		Meaning: "Larger request bodies get 413 before parsing; keep Envoy's listener buffer limit at least this large."},

	{Path: "tracing.otlp_endpoint", Type: "string", Range: "`http`/`https` URL with a host",
		Meaning: "OTLP/HTTP collector that receives the gateway's spans (the request, the routing decision, the route query); spans go to its `/v1/traces` unless the URL names a path. Empty: no tracing. The W3C `traceparent` of the request span is sent to the metadata center and the pod."},
	{Path: "tracing.sample_ratio", Type: "number", Default: "1", Range: "0..1",
		Meaning: "Share of new traces sampled; a request that arrives with a sampled `traceparent` is always traced."},
}
