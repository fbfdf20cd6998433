package epp_test

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/istio-llm-filter/istio-llm-filter/filter/epp"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing/routingtest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// The picker's side of the endpoint-picker protocol spoken over real gRPC
// as a gateway speaks it (004-endpoint-picker-protocol), for what a test
// cannot make Envoy send: subset hints and served-endpoint metadata.

func dial(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// exchange is one request's stream.
type exchange struct {
	t      *testing.T
	stream extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc
}

func open(t *testing.T, cc *grpc.ClientConn) *exchange {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	s, err := extprocv3.NewExternalProcessorClient(cc).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cancel)
	return &exchange{t, s, cancel}
}

func (x *exchange) send(req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
	x.t.Helper()
	if err := x.stream.Send(req); err != nil {
		x.t.Fatal(err)
	}
	resp, err := x.stream.Recv()
	if err != nil {
		x.t.Fatal(err)
	}
	return resp
}

func hdrs(kv ...string) *corev3.HeaderMap {
	m := &corev3.HeaderMap{}
	for i := 0; i < len(kv); i += 2 {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return m
}

func metadata(ns, key string, v *structpb.Value) *corev3.Metadata {
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{ns: {Fields: map[string]*structpb.Value{key: v}}}}
}

// decide sends a chat request's headers and body, with md as the
// request's metadata, and returns the body response (nil: immediate).
func (x *exchange) decide(body string, md *corev3.Metadata) (*extprocv3.ProcessingResponse, string) {
	x.t.Helper()
	x.send(&extprocv3.ProcessingRequest{MetadataContext: md, Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: hdrs(":method", "POST", ":path", "/v1/chat/completions", "content-type", "application/json")}}})
	resp := x.send(&extprocv3.ProcessingRequest{MetadataContext: md, Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
		Body: []byte(body), EndOfStream: true}}})
	if resp.GetImmediateResponse() != nil {
		return resp, ""
	}
	var dest string
	for _, h := range resp.GetRequestBody().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.Header.Key == epp.DestinationHeader {
			dest = string(h.Header.RawValue)
		}
	}
	list := resp.GetDynamicMetadata().GetFields()[epp.DestinationNamespace].GetStructValue().GetFields()[epp.DestinationKey].GetStringValue()
	if dest == "" || !strings.HasPrefix(list+",", dest+",") {
		x.t.Fatalf("header %q and metadata %q disagree on the primary endpoint", dest, list)
	}
	return resp, list
}

// served answers the response phase: headers naming the pod that served,
// a body chunk, the end.
func (x *exchange) served(host string) {
	x.t.Helper()
	x.send(&extprocv3.ProcessingRequest{
		MetadataContext: metadata(epp.DestinationNamespace, epp.ServedKey, structpb.NewStringValue(host)),
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: hdrs(":status", "200", "content-type", "application/json")}}})
	x.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
		Body: []byte(`{"choices":[]}`), EndOfStream: true}}})
	if err := x.stream.CloseSend(); err != nil {
		x.t.Fatal(err)
	}
}

func subsetHint(hosts ...string) *corev3.Metadata {
	var vs []*structpb.Value
	for _, h := range hosts {
		vs = append(vs, structpb.NewStringValue(h))
	}
	return metadata(epp.SubsetNamespace, epp.SubsetKey, structpb.NewListValue(&structpb.ListValue{Values: vs}))
}

var pool = []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"}

func TestSubsetHintIsHonoured(t *testing.T) {
	cc := dial(t, startEPP(t, fleetFile("", pool), false))
	for range 8 {
		_, list := open(t, cc).decide(chat(false, "subset"), subsetHint(pool[1], pool[3]))
		got := strings.Split(list, ",")
		if len(got) != 2 || got[0] == got[1] || !strings.Contains(pool[1]+pool[3], got[0]) || !strings.Contains(pool[1]+pool[3], got[1]) {
			t.Fatalf("subset {%s %s}: picked %q", pool[1], pool[3], list)
		}
	}
	for _, hint := range [][]string{{}, {"10.9.9.9:8000"}} {
		resp, _ := open(t, cc).decide(chat(false, "subset"), subsetHint(hint...))
		ir := resp.GetImmediateResponse()
		if ir == nil || ir.Status.Code != 503 || !strings.Contains(string(ir.Body), `"service_unavailable"`) {
			t.Fatalf("subset %v: %v", hint, resp)
		}
	}
}

// The pod that really served takes the request's prefix: the next request
// of the conversation goes there, not to the pod first chosen.
func TestServedEndpointTakesThePrefix(t *testing.T) {
	mc := routingtest.Center(t)
	cc := dial(t, startEPP(t, fleetFile(mc.URL, pool), false))
	body := chat(false, strings.Repeat("a long shared system prompt ", 20))
	x := open(t, cc)
	_, list := x.decide(body, nil)
	chosen := strings.Split(list, ",")[0]
	other := pool[0]
	if other == chosen {
		other = pool[1]
	}
	x.served(other)
	// The save lands asynchronously: wait until the decision follows it.
	wait.For(t, 10*time.Second, "the prompt to follow the pod that served it, "+other, func() bool {
		_, list := open(t, cc).decide(body, nil)
		return strings.Split(list, ",")[0] == other
	})
}

// With the metadata center unreachable the picker still picks (the
// decision degrades to local load), so the gateway never has to fail open.
func TestMetadataCenterDownStillPicks(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + ln.Addr().String()
	ln.Close()
	cc := dial(t, startEPP(t, fleetFile(dead, pool), false))
	resp, list := open(t, cc).decide(chat(false, "anyone there"), nil)
	if resp.GetImmediateResponse() != nil || list == "" {
		t.Fatalf("no pick with the metadata center down: %v", resp)
	}
}

func TestHealthServices(t *testing.T) {
	cc := dial(t, startEPP(t, fleetFile("", pool), false))
	for _, svc := range epp.HealthServices {
		r, err := healthpb.NewHealthClient(cc).Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
		if err != nil || r.Status != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("health %q: %v %v", svc, r, err)
		}
	}
}

// A decision that rewrites the request (Triton's generate API) reaches
// Envoy as a body mutation, a new :path and content-length.
func TestTranscodedRequestIsRewritten(t *testing.T) {
	doc := strings.Replace(fleetFile("", pool), "      - {cluster: pool}", "      - {cluster: pool, backend: triton}", 1)
	cc := dial(t, startEPP(t, doc, false))
	body := chat(false, "rewrite me")
	resp, _ := open(t, cc).decide(body, nil)
	cr := resp.GetRequestBody().GetResponse()
	up := cr.GetBodyMutation().GetBody()
	if len(up) == 0 || string(up) == body {
		t.Fatalf("no body mutation: %v", cr)
	}
	set := map[string]string{}
	for _, h := range cr.GetHeaderMutation().GetSetHeaders() {
		set[h.Header.Key] = string(h.Header.RawValue)
	}
	if !strings.Contains(set[":path"], "generate") {
		t.Fatalf(":path %q, want Triton's generate", set[":path"])
	}
	if !strings.Contains(string(up), "rewrite me") {
		t.Fatalf("the upstream body lost the prompt: %s", up)
	}
}
