package llmfilter

import (
	"github.com/istio-llm-filter/istio-llm-filter/filter/lifecycle"
)

// Keys of the per-request access record, set as Envoy dynamic metadata
// under the namespace Name, so that Envoy's access log can print them:
// %DYNAMIC_METADATA(llm-filter:backend)% and so on (docs/operations.md,
// "Access log").
const (
	AccessTraceID      = "trace_id"
	AccessModel        = "model"
	AccessCluster      = "cluster"
	AccessScene        = "scene"
	AccessPolicy       = "policy"
	AccessChosen       = "chosen"        // the pod the filter pinned
	AccessBackend      = "backend"       // the pod that answered (Envoy may fall back)
	AccessCacheRatio   = "cache_ratio"   // the chosen pod's share of the prompt's blocks in cache
	AccessDegraded     = "degraded"      // routed without the metadata center
	AccessPromptLength = "prompt_length" // canonical prompt bytes
	AccessTTFT         = "ttft_ms"       // start to first response byte
)

// record sets the decision's part of the access record. Called on the
// decision goroutine: Envoy posts each set to the worker thread.
func (f *filter) record(d *lifecycle.Request) {
	f.meta(AccessTraceID, d.TraceID)
	f.meta(AccessModel, d.Model)
	f.meta(AccessCluster, d.Cluster)
	f.meta(AccessScene, d.SceneName)
	f.meta(AccessPolicy, d.Policy)
	f.meta(AccessChosen, d.Host)
	f.meta(AccessCacheRatio, d.CacheRatio)
	f.meta(AccessDegraded, d.Degraded)
	f.meta(AccessPromptLength, d.PromptLength)
}

// meta sets one key of the access record; a stream Envoy already ended
// refuses it, which loses nothing anyone could read.
func (f *filter) meta(key string, value any) {
	defer func() { _ = recover() }()
	f.cb.StreamInfo().DynamicMetadata().Set(Name, key, value)
}
