// Package gatewaymetrics names the gateway's metrics and exports them to
// Prometheus. Every host of the routing filter reports the same names: the
// Envoy .so (filter/llmfilter, through Envoy's stats), the standalone
// gateway and the endpoint picker (both through Recorder on a Prometheus
// registry). Names follow Prometheus conventions: counters end in _total,
// durations are histograms in seconds, and series that belong to a request
// carry the matched rule's model (model_name) and cluster (cluster).
package gatewaymetrics

import (
	"slices"
	"strings"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
)

// Prefix namespaces every gateway metric.
const Prefix = "llm_filter_"

// Events are the counters routing, lifecycle and the filter count by name
// (routing.Metrics.Count); each is exported as EventMetric(event).
var Events = []string{
	"routed", "cache_hit_routes", "fallbacks", "metadata_center_errors", "async_dropped", "async_errors", "async_batches", "rejected",
	"requests_started", "local_replies", "upstream_errors", "transcode_errors", "panics",
	"retractions", "served_elsewhere", "ejections",
}

// EventRequestsStarted counts every request the host saw start (the
// finished ones are Requests, by outcome).
const EventRequestsStarted = "requests_started"

// EventMetric is the counter an event is exported as: llm_filter_<event>_total.
func EventMetric(event string) string { return Prefix + event + "_total" }

// InFlight is the gauge of routed requests not finished; Count moves it
// by ±1 under this event name.
const InFlight = "in_flight_requests"

// InFlightMetric is the exported name of the InFlight gauge.
const InFlightMetric = Prefix + InFlight

// Duration histograms, in seconds, labelled by HistLabelNames.
const (
	TTFT            = Prefix + "ttft_seconds"                 // routed request: start to first response byte
	RequestDuration = Prefix + "request_duration_seconds"     // routed request: start to end of stream
	Decision        = Prefix + "decision_duration_seconds"    // the routing decision, route query included
	RouteQuery      = Prefix + "route_query_duration_seconds" // the metadata center's route query, failures included
)

// Histograms lists the duration histograms.
var Histograms = []string{TTFT, RequestDuration, Decision, RouteQuery}

// HistogramHelp describes each histogram.
var HistogramHelp = map[string]string{
	TTFT:            "Routed requests: time from the request's start to the first response byte, by the matched rule's model and cluster.",
	RequestDuration: "Routed requests: time from the request's start to the end of the stream, by the matched rule's model and cluster.",
	Decision:        "Routing decisions (parse, hash, route query, scoring), by the matched rule's model and cluster (none when no rule matched).",
	RouteQuery:      "Route queries to the metadata center, failures included, by the matched rule's model and cluster.",
}

// Buckets are the histograms' bounds in seconds: 100 µs (a decision) to
// 10 minutes (a long generation).
var Buckets = []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 600}

// Requests counts finished requests by RequestLabelNames.
const Requests = Prefix + "requests_total"

// Label names.
const (
	LabelModel   = "model_name"
	LabelCluster = "cluster"
)

// RequestLabelNames are the labels of Requests, in Envoy stat-name order.
var RequestLabelNames = []string{LabelModel, LabelCluster, "scene", "policy", "outcome"}

// HistLabelNames are the labels of the histograms.
var HistLabelNames = []string{LabelModel, LabelCluster}

// Outcomes of a request (label outcome).
const (
	OutcomeSuccess       = "success"        // 2xx from the pod the filter chose
	OutcomeUpstreamError = "upstream_error" // the pod answered non-2xx
	OutcomeFailed        = "failed"         // routed, then a local reply (no healthy upstream, reset, transcoding)
	OutcomeCancelled     = "cancelled"      // the client left before an answer
	OutcomeRejected      = "rejected"       // refused by the filter before routing (4xx/5xx error document)
	OutcomeAnswered      = "answered"       // answered by the filter itself (GET /v1/models)
	OutcomeUnrouted      = "unrouted"       // passed through without a decision (no body)
)

// Outcomes lists every outcome.
var Outcomes = []string{OutcomeSuccess, OutcomeUpstreamError, OutcomeFailed, OutcomeCancelled, OutcomeRejected, OutcomeAnswered, OutcomeUnrouted}

// NoLabel stands for a label without value (a request no rule matched).
const NoLabel = "none"

// RequestLabels are the labels of one finished request. Model, cluster
// and scene come from the matched rule, never from the client, so the
// series are bounded by the configuration.
type RequestLabels struct {
	Model, Cluster, Scene, Policy, Outcome string
}

// HistLabels are the labels of one histogram value: the matched rule's
// model and cluster (empty: no rule matched).
type HistLabels struct {
	Model, Cluster string
}

func labelValue(v string) string {
	if v == "" {
		return NoLabel
	}
	// ";" and "=" delimit labels in the Envoy stat name.
	if strings.ContainsAny(v, ";=") {
		return labelEscaper.Replace(v)
	}
	return v
}

var labelEscaper = strings.NewReplacer(";", "_", "=", "_")

// Values are the label values in RequestLabelNames order.
func (l RequestLabels) Values() []string {
	return []string{labelValue(l.Model), labelValue(l.Cluster), labelValue(l.Scene), labelValue(l.Policy), labelValue(l.Outcome)}
}

// Values are the label values in HistLabelNames order.
func (l HistLabels) Values() []string {
	return []string{labelValue(l.Model), labelValue(l.Cluster)}
}

// EnvoyStatName is the Envoy counter of these labels:
// llm_filter_requests_total;model_name=M;cluster=C;scene=S;policy=P;outcome=O.
// Envoy's Go SDK has no labels; the gateway's stats_tags
// (istio/envoyfilter.yaml) turn the ";k=v" parts back into labels.
func (l RequestLabels) EnvoyStatName() string {
	return envoyName(Requests, RequestLabelNames, l.Values())
}

// EnvoyStatName is the Envoy stat of histogram name with these labels.
func (l HistLabels) EnvoyStatName(name string) string {
	return envoyName(name, HistLabelNames, l.Values())
}

func envoyName(family string, names, values []string) string {
	var b strings.Builder
	b.WriteString(family)
	for i, v := range values {
		b.WriteString(";" + names[i] + "=" + v)
	}
	return b.String()
}

// RequestLabelSets is every RequestLabels a config can produce.
func RequestLabelSets(cfg *config.Config) []RequestLabels {
	var out []RequestLabels
	for _, o := range []string{OutcomeRejected, OutcomeAnswered, OutcomeUnrouted, OutcomeCancelled} {
		out = append(out, RequestLabels{Outcome: o})
	}
	for _, m := range models(cfg) {
		for _, r := range cfg.ModelMappingRule[m] {
			for _, o := range []string{OutcomeSuccess, OutcomeUpstreamError, OutcomeFailed, OutcomeCancelled} {
				l := RequestLabels{Model: m, Cluster: r.Cluster, Scene: r.SceneName, Policy: cfg.LBMappingRule.For(r.Cluster).Policy, Outcome: o}
				if !slices.Contains(out, l) {
					out = append(out, l)
				}
			}
		}
	}
	return out
}

// HistLabelSets is every HistLabels a config can produce: the unmatched
// request's and each rule's model and cluster.
func HistLabelSets(cfg *config.Config) []HistLabels {
	out := []HistLabels{{}}
	for _, m := range models(cfg) {
		for _, r := range cfg.ModelMappingRule[m] {
			if l := (HistLabels{Model: m, Cluster: r.Cluster}); !slices.Contains(out, l) {
				out = append(out, l)
			}
		}
	}
	return out
}

func models(cfg *config.Config) []string {
	ms := make([]string, 0, len(cfg.ModelMappingRule))
	for m := range cfg.ModelMappingRule {
		ms = append(ms, m)
	}
	slices.Sort(ms)
	return ms
}
