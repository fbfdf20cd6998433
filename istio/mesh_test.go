package istio_test

import (
	"regexp"
	"strings"
	"testing"

	accesslogv3 "github.com/envoyproxy/go-control-plane/envoy/config/accesslog/v3"
	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	istioapi "istio.io/api/networking/v1alpha3"
	networkingv1 "istio.io/client-go/pkg/apis/networking/v1"
	networkingv1alpha3 "istio.io/client-go/pkg/apis/networking/v1alpha3"

	"github.com/istio-llm-filter/istio-llm-filter/deploy/manifesttest"
	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewaymetrics"
	"github.com/istio-llm-filter/istio-llm-filter/filter/llmfilter"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
)

// patchesOf returns the EnvoyFilter's patches of one kind and the build's
// VirtualService.
func patchesOf(t *testing.T, kind istioapi.EnvoyFilter_ApplyTo) ([]*istioapi.EnvoyFilter_EnvoyConfigObjectPatch, *networkingv1.VirtualService) {
	t.Helper()
	objs, err := manifesttest.BuildDecoded(".")
	if err != nil {
		t.Fatal(err)
	}
	var out []*istioapi.EnvoyFilter_EnvoyConfigObjectPatch
	var vs *networkingv1.VirtualService
	for _, o := range objs {
		switch v := o.Object.(type) {
		case *networkingv1alpha3.EnvoyFilter:
			for _, p := range v.Spec.ConfigPatches {
				if p.GetApplyTo() == kind {
					out = append(out, p)
				}
			}
		case *networkingv1.VirtualService:
			vs = v
		}
	}
	if vs == nil {
		t.Fatal("no VirtualService in the build")
	}
	return out, vs
}

type validated interface {
	proto.Message
	ValidateAll() error
}

// The route the filter's header selects forwards on that header.
func TestRoutedRouteForwardsOnTheClusterHeader(t *testing.T) {
	ps, vs := patchesOf(t, istioapi.EnvoyFilter_HTTP_ROUTE)
	if len(ps) != 1 {
		t.Fatalf("%d HTTP_ROUTE patches, want 1", len(ps))
	}
	p := ps[0]
	name := p.GetMatch().GetRouteConfiguration().GetVhost().GetRoute().GetName()
	if p.GetMatch().GetContext() != istioapi.EnvoyFilter_GATEWAY || p.GetPatch().GetOperation() != istioapi.EnvoyFilter_Patch_MERGE {
		t.Fatalf("patch context %v operation %v, want GATEWAY MERGE", p.GetMatch().GetContext(), p.GetPatch().GetOperation())
	}
	var r routev3.Route
	// A Route needs a match to validate; the patch merges into one that has it.
	decodePatchInto(t, p, &r, func(r *routev3.Route) {
		r.Match = &routev3.RouteMatch{PathSpecifier: &routev3.RouteMatch_Prefix{Prefix: "/"}}
	})
	if got := r.GetRoute().GetClusterHeader(); got != headers.Cluster {
		t.Fatalf("route.cluster_header = %q, want %q", got, headers.Cluster)
	}
	// Istio names an Envoy route after the VirtualService's http route: the
	// patched one must exist, come first, and match only once the filter
	// has set the header.
	http := vs.Spec.GetHttp()
	if len(http) == 0 || http[0].GetName() != name {
		t.Fatalf("the first VirtualService route is not %q", name)
	}
	// One match per API path (/v1/, /v2/, /rerank, ...), each only with
	// the header, and unnamed: Istio names the Envoy route of a named match
	// "<route>.<match>", which the patch above would not reach.
	hm := http[0].GetMatch()
	if len(hm) == 0 {
		t.Fatalf("route %q has no match", name)
	}
	for _, m := range hm {
		if m.GetHeaders()[headers.Cluster].GetRegex() != ".+" {
			t.Fatalf("route %q: match %v is not on a non-empty %s", name, m, headers.Cluster)
		}
		if m.GetName() != "" {
			t.Fatalf("route %q: match named %q: its Envoy route is not %q", name, m.GetName(), name)
		}
	}
	// A retry drops the override host (docs/operations.md, "Override host,
	// retries and strict mode"): only a refused connection, where nothing
	// was sent, may go to another pod of the cluster.
	if rt := http[0].GetRetries(); rt.GetAttempts() != 1 || rt.GetRetryOn() != "connect-failure" {
		t.Fatalf("route %q retries %v, want attempts 1 on connect-failure only", name, rt)
	}
}

// decodePatchInto reads a patch value with Envoy v1.36's own protos
// (go-control-plane; unknown fields refused, Any resolved by type URL),
// completes what the patched object already has (fill), and runs the
// protos' validation rules, as Envoy's xDS ingestion does.
func decodePatchInto[T validated](t *testing.T, p *istioapi.EnvoyFilter_EnvoyConfigObjectPatch, m T, fill func(T)) {
	t.Helper()
	js, err := p.GetPatch().GetValue().MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}
	if err := protojson.Unmarshal(js, m); err != nil {
		t.Fatalf("%T: %v\n%s", m, err, js)
	}
	fill(m)
	if err := m.ValidateAll(); err != nil {
		t.Fatalf("%T does not validate: %v", m, err)
	}
}

// Envoy's local replies become the error JSON; the filter's own are left
// alone (they carry llm-filter.local_reply in the dynamic metadata).
func TestLocalRepliesBecomeTheErrorDocument(t *testing.T) {
	ps, _ := patchesOf(t, istioapi.EnvoyFilter_NETWORK_FILTER)
	if len(ps) != 1 {
		t.Fatalf("%d NETWORK_FILTER patches, want 1", len(ps))
	}
	p := ps[0]
	if fn := p.GetMatch().GetListener().GetFilterChain().GetFilter().GetName(); fn != "envoy.filters.network.http_connection_manager" {
		t.Fatalf("patch matches filter %q", fn)
	}
	var f listenerv3.Filter
	decodePatchInto(t, p, &f, func(f *listenerv3.Filter) { f.Name = "envoy.filters.network.http_connection_manager" })
	var hcm hcmv3.HttpConnectionManager
	if err := f.GetTypedConfig().UnmarshalTo(&hcm); err != nil {
		t.Fatal(err)
	}
	lr := hcm.GetLocalReplyConfig()
	if lr == nil {
		t.Fatal("no local_reply_config")
	}
	if lr.GetBodyFormat() != nil {
		t.Fatal("a top-level body_format would rewrite the filter's own replies too")
	}
	ms := lr.GetMappers()
	if len(ms) != 2 {
		t.Fatalf("%d mappers, want 2", len(ms))
	}
	// First: the filter's replies, untouched.
	mf := ms[0].GetFilter().GetMetadataFilter()
	if mf.GetMatcher().GetFilter() != llmfilter.Name || len(mf.GetMatcher().GetPath()) != 1 ||
		mf.GetMatcher().GetPath()[0].GetKey() != llmfilter.LocalReplyMetadataKey || !mf.GetMatcher().GetValue().GetBoolMatch() {
		t.Fatalf("first mapper does not select the filter's replies: %v", ms[0].GetFilter())
	}
	if mf.GetMatchIfKeyNotFound().GetValue() {
		t.Fatal("first mapper must not match replies without the marker")
	}
	if ms[0].GetBodyFormatOverride() != nil || ms[0].GetBody() != nil || ms[0].GetStatusCode() != nil || len(ms[0].GetHeadersToAdd()) > 0 {
		t.Fatalf("first mapper changes the filter's replies: %v", ms[0])
	}
	// Second: every other error, as {"error":{code,type,message},"trace_id"}.
	sc := ms[1].GetFilter().GetStatusCodeFilter().GetComparison()
	if sc.GetOp() != accesslogv3.ComparisonFilter_GE || sc.GetValue().GetDefaultValue() != 400 {
		t.Fatalf("second mapper filter %v, want status >= 400", ms[1].GetFilter())
	}
	bf := ms[1].GetBodyFormatOverride()
	if bf.GetContentType() != "application/json" {
		t.Fatalf("content type %q", bf.GetContentType())
	}
	js := bf.GetJsonFormat().GetFields()
	errf := js["error"].GetStructValue().GetFields()
	want := map[string]string{"code": "%RESPONSE_CODE%", "type": "%RESPONSE_CODE_DETAILS%", "message": "%LOCAL_REPLY_BODY%"}
	for k, v := range want {
		if errf[k].GetStringValue() != v {
			t.Errorf("error.%s = %q, want %q", k, errf[k].GetStringValue(), v)
		}
	}
	if len(errf) != len(want) || js["trace_id"].GetStringValue() != "%REQ(X-REQUEST-ID)%" || len(js) != 2 {
		t.Errorf("json_format %v, want exactly error{code,type,message} and trace_id", bf.GetJsonFormat())
	}
}

// The gateway's stats_tags turn the filter's labelled Envoy counters back
// into one Prometheus family with the standalone gateway's labels. Envoy
// applies each extractor to the stat name (TagExtractorStdRegexImpl: the
// first group is removed from the name, the second is the value); the
// regexes use only syntax ECMAScript (Envoy) and RE2 (here) read alike.
func TestStatsTagsRebuildTheRequestLabels(t *testing.T) {
	ps, _ := patchesOf(t, istioapi.EnvoyFilter_BOOTSTRAP)
	if len(ps) != 1 {
		t.Fatalf("%d BOOTSTRAP patches, want 1", len(ps))
	}
	var b bootstrapv3.Bootstrap
	decodePatchInto(t, ps[0], &b, func(*bootstrapv3.Bootstrap) {})
	tags := b.GetStatsConfig().GetStatsTags()
	for _, l := range []gatewaymetrics.RequestLabels{
		{Model: "qwen2.5-7b", Cluster: "outbound|8000||qwen-prod.llm.svc.cluster.local", Scene: "prod", Policy: "cache_aware", Outcome: gatewaymetrics.OutcomeSuccess},
		{Outcome: gatewaymetrics.OutcomeRejected},
		{Model: "m;x=y", Cluster: "c", Outcome: gatewaymetrics.OutcomeFailed},
	} {
		name := l.EnvoyStatName()
		rest := name
		got := map[string]string{}
		for _, tag := range tags {
			re := regexp.MustCompile(tag.GetRegex())
			m := re.FindStringSubmatchIndex(name)
			if m == nil || len(m) < 6 {
				t.Fatalf("tag %s does not match %q", tag.GetTagName(), name)
			}
			got[tag.GetTagName()] = name[m[4]:m[5]]
			rest = strings.Replace(rest, name[m[2]:m[3]], "", 1)
		}
		if rest != gatewaymetrics.Requests {
			t.Errorf("%q: name after extraction %q, want %q", name, rest, gatewaymetrics.Requests)
		}
		want := map[string]string{"model_name": l.Model, "cluster": l.Cluster, "scene": l.Scene, "policy": l.Policy, "outcome": l.Outcome}
		for k, v := range want {
			if v == "" {
				v = gatewaymetrics.NoLabel
			}
			v = strings.NewReplacer(";", "_", "=", "_").Replace(v)
			if got[k] != v {
				t.Errorf("%q: tag %s = %q, want %q", name, k, got[k], v)
			}
		}
		if len(got) != len(gatewaymetrics.RequestLabelNames) {
			t.Errorf("tags %v, want exactly %v", got, gatewaymetrics.RequestLabelNames)
		}
	}
}

// The same extractors give the histograms their model_name and cluster,
// and leave them the name the .so defined (llmfilter.EnvoyHistogram).
func TestStatsTagsRebuildTheHistogramLabels(t *testing.T) {
	ps, _ := patchesOf(t, istioapi.EnvoyFilter_BOOTSTRAP)
	var b bootstrapv3.Bootstrap
	decodePatchInto(t, ps[0], &b, func(*bootstrapv3.Bootstrap) {})
	tags := b.GetStatsConfig().GetStatsTags()
	for _, h := range gatewaymetrics.Histograms {
		stat, _ := llmfilter.EnvoyHistogram(h)
		for _, l := range []gatewaymetrics.HistLabels{{}, {Model: "qwen2.5-7b", Cluster: "outbound|8000||qwen-prod.llm.svc.cluster.local"}} {
			name := l.EnvoyStatName(stat)
			rest := name
			got := map[string]string{}
			for _, tag := range tags {
				m := regexp.MustCompile(tag.GetRegex()).FindStringSubmatchIndex(name)
				if m == nil {
					continue
				}
				got[tag.GetTagName()] = name[m[4]:m[5]]
				rest = strings.Replace(rest, name[m[2]:m[3]], "", 1)
			}
			want := map[string]string{"model_name": l.Values()[0], "cluster": l.Values()[1]}
			if rest != stat || len(got) != 2 || got["model_name"] != want["model_name"] || got["cluster"] != want["cluster"] {
				t.Errorf("%q: tags %v and name %q, want %v and %q", name, got, rest, want, stat)
			}
		}
	}
}
