// Package headers names the HTTP headers the gateway (filter/), the worker
// and the benchmarks share. It imports nothing, so a client reads the
// gateway's headers without linking the gateway (or the Envoy SDK).
// Names are lower case, as Envoy presents them; net/http canonicalizes them.
package headers

const (
	// Cluster carries the chosen rule's cluster to Envoy's route, which
	// forwards on it (route.cluster_header, istio/gateway.yaml). The
	// gateway removes any value a client sent.
	Cluster = "x-llm-cluster"

	// UpstreamHost is the response header naming the "ip:port" of the pod
	// that served a routed request.
	UpstreamHost = "x-llm-upstream-host"

	// PredictedTTFT is the response header in which the gateway states the
	// time to first token, in milliseconds, it predicted for the pod it
	// chose (filter/balancer, ttft.go); the benchmarks compare it with the
	// TTFT the client observed.
	PredictedTTFT = "x-llm-predicted-ttft-ms"

	// PredictedSlotWait states the part of PredictedTTFT the request was
	// predicted to wait for running requests on the pod to end (a running
	// slot, or room in its KV cache), in milliseconds, where that wait is
	// the longest the request waits; absent where it was predicted to start
	// at once or behind prefill queued ahead. The benchmarks report the
	// prediction's error apart for those requests: when the next of the
	// pod's requests ends is the one part a router cannot know.
	PredictedSlotWait = "x-llm-predicted-slot-wait-ms"

	// PredictedCachedShare states the share of the prompt, 0 to 1, the
	// gateway believed the pod it chose held in its KV cache (what its
	// prefix index matched there); the benchmarks compare it with the share
	// the pod served from its cache (usage.prompt_tokens_details).
	PredictedCachedShare = "x-llm-predicted-cached-share"

	// RequestID carries a request's trace id: the gateway reads it (or
	// sets a new one), the worker echoes it on every answer and names it in
	// errors and logs.
	RequestID = "x-request-id"

	// TraceID and AmznTraceID are read for the trace id, after RequestID.
	TraceID     = "x-trace-id"
	AmznTraceID = "x-amzn-trace-id"
)

// TraceIDs are the headers a request's trace id is read from, in order.
var TraceIDs = [...]string{RequestID, TraceID, AmznTraceID}
