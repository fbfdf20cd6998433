package envoyhost

import (
	"encoding/json"
	"net"
	"strings"
	"testing"

	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"google.golang.org/protobuf/encoding/protojson"
	istioapi "istio.io/api/networking/v1alpha3"
	networkingv1alpha3 "istio.io/client-go/pkg/apis/networking/v1alpha3"

	"github.com/istio-llm-filter/istio-llm-filter/deploy/manifesttest"
	"github.com/istio-llm-filter/istio-llm-filter/filter/llmfilter"
)

// istioLocalReply reads the local_reply_config istio/ ships (decoded with
// Envoy's protos) into the host's mapper, failing if its shape is one the
// host does not reproduce.
func istioLocalReply(t *testing.T) *LocalReply {
	t.Helper()
	objs, err := manifesttest.BuildDecoded("../istio")
	if err != nil {
		t.Fatal(err)
	}
	var hcm hcmv3.HttpConnectionManager
	found := false
	for _, o := range objs {
		ef, ok := o.Object.(*networkingv1alpha3.EnvoyFilter)
		if !ok {
			continue
		}
		for _, p := range ef.Spec.ConfigPatches {
			if p.GetApplyTo() != istioapi.EnvoyFilter_NETWORK_FILTER {
				continue
			}
			js, err := p.GetPatch().GetValue().MarshalJSON()
			if err != nil {
				t.Fatal(err)
			}
			var f listenerv3.Filter
			if err := protojson.Unmarshal(js, &f); err != nil {
				t.Fatal(err)
			}
			if err := f.GetTypedConfig().UnmarshalTo(&hcm); err != nil {
				t.Fatal(err)
			}
			found = true
		}
	}
	ms := hcm.GetLocalReplyConfig().GetMappers()
	if !found || len(ms) != 2 {
		t.Fatalf("istio/ local_reply_config: %d mappers, want the two this host reproduces", len(ms))
	}
	mf := ms[0].GetFilter().GetMetadataFilter().GetMatcher()
	if len(mf.GetPath()) != 1 || !mf.GetValue().GetBoolMatch() || ms[0].GetBodyFormatOverride() != nil {
		t.Fatalf("first mapper %v: not the metadata pass-through this host reproduces", ms[0])
	}
	tmpl, err := json.Marshal(ms[1].GetBodyFormatOverride().GetJsonFormat().AsMap())
	if err != nil {
		t.Fatal(err)
	}
	return &LocalReply{
		SkipNamespace: mf.GetFilter(), SkipKey: mf.GetPath()[0].GetKey(),
		MinStatus:  int(ms[1].GetFilter().GetStatusCodeFilter().GetComparison().GetValue().GetDefaultValue()),
		JSONFormat: string(tmpl),
	}
}

type errorDoc struct {
	Error struct {
		Code    int    `json:"code"`
		Type    string `json:"type"`
		Message string `json:"message"`
	} `json:"error"`
	TraceID string `json:"trace_id"`
}

// With istio/'s local_reply_config, Envoy's own replies (a cluster Envoy
// does not know, a pod that refuses connections, a body over the buffer
// limit, no healthy pod) reach the client as the error JSON with the trace id, and the
// filter's own JSON replies pass unchanged. The 413 arrives while the
// filter waits for the whole body: the next request must still work.
func TestEnvoysLocalRepliesBecomeTheErrorDocument(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := l.Addr().String()
	l.Close()
	h := startHost(t, Options{BufferLimit: 4096, Clusters: map[string][]string{"pool": {dead}}})
	if _, err := h.PushConfig([]byte(meshDoc(dead, dead))); err != nil {
		t.Fatal(err)
	}
	if err := h.SetLocalReply(istioLocalReply(t)); err != nil {
		t.Fatal(err)
	}
	big := chatBody(strings.Repeat("long prompt ", 1000), false)
	for _, tc := range []struct {
		name, body string
		hdr        map[string]string
		code       int
		typ        string
	}{
		{"unknown cluster", chatBody("x", false), map[string]string{"x-env": "ghost"}, 503, "cluster_not_found"},
		{"connection refused", chatBody("x", false), nil, 503, "upstream_reset_before_response_started{connection_failure}"},
		{"over the buffer limit", big, nil, 413, "request_payload_too_large"},
	} {
		hdr := map[string]string{"x-request-id": "trace-" + strings.ReplaceAll(tc.name, " ", "-")}
		for k, v := range tc.hdr {
			hdr[k] = v
		}
		resp, body := send(t, "POST", h.URL()+"/v1/chat/completions", tc.body, hdr)
		var e errorDoc
		if err := json.Unmarshal([]byte(body), &e); err != nil || resp.StatusCode != tc.code || e.Error.Code != tc.code ||
			e.Error.Type != tc.typ || e.TraceID != hdr["x-request-id"] || resp.Header.Get("content-type") != "application/json" {
			t.Fatalf("%s: %d %q %s (%v)", tc.name, resp.StatusCode, resp.Header.Get("content-type"), body, err)
		}
	}
	// Every pod of the cluster unhealthy: Envoy's "no healthy upstream".
	h.Router().SetHealthy("pool", dead, false)
	resp0, body0 := send(t, "POST", h.URL()+"/v1/chat/completions", chatBody("x", false), map[string]string{"x-request-id": "trace-uh"})
	var e0 errorDoc
	if err := json.Unmarshal([]byte(body0), &e0); err != nil || resp0.StatusCode != 503 || e0.Error.Type != "no_healthy_upstream" ||
		e0.Error.Message != "no healthy upstream" || e0.TraceID != "trace-uh" {
		t.Fatalf("no healthy upstream: %d %s (%v)", resp0.StatusCode, body0, err)
	}
	// The filter's own reply: exactly what the filter wrote.
	resp, body := send(t, "POST", h.URL()+"/v1/chat/completions", "", map[string]string{"x-request-id": "trace-own"})
	var e errorDoc
	if err := json.Unmarshal([]byte(body), &e); err != nil || resp.StatusCode != 400 || e.Error.Type != "bad_request" ||
		!strings.HasPrefix(e.Error.Message, "request body is required") || e.TraceID != "trace-own" {
		t.Fatalf("the filter's reply was rewritten: %d %s", resp.StatusCode, body)
	}
	if lr := istioLocalReply(t); lr.SkipNamespace != llmfilter.Name || lr.SkipKey != llmfilter.LocalReplyMetadataKey {
		t.Fatalf("istio/ skips replies marked %s.%s; the filter marks %s.%s", lr.SkipNamespace, lr.SkipKey, llmfilter.Name, llmfilter.LocalReplyMetadataKey)
	}
}
