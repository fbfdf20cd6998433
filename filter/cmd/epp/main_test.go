package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/istio-llm-filter/istio-llm-filter/filter/epp"
	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewaymetrics"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

func writeFile(t *testing.T, doc string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "fleet.yaml")
	if err := os.WriteFile(p, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// The command serves the picker and its health services on the file's
// listen address, on DefaultProcs processors unless told otherwise, and
// stops cleanly when told to, giving the processors back.
func TestServesUntilStopped(t *testing.T) {
	before := runtime.GOMAXPROCS(0)
	for _, tc := range []struct {
		env   string
		args  []string
		procs int
	}{
		{"", nil, DefaultProcs},
		{"3", nil, before}, // $GOMAXPROCS, read by Go at start, is left alone
		{"3", []string{"--procs", "5"}, 5},
		{"", []string{"--procs", "0"}, before},
	} {
		t.Run(fmt.Sprintf("GOMAXPROCS=%q %v", tc.env, tc.args), func(t *testing.T) {
			t.Setenv("GOMAXPROCS", tc.env)
			servesUntilStopped(t, tc.args, tc.procs)
			if n := runtime.GOMAXPROCS(0); n != before {
				t.Errorf("%d processors after the picker stopped, want %d back", n, before)
			}
		})
	}
}

func servesUntilStopped(t *testing.T, args []string, procs int) {
	cc, stop := startPicker(t, args...)
	for _, svc := range epp.HealthServices {
		r, err := healthpb.NewHealthClient(cc).Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
		if err != nil || r.Status != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("health %q: %v %v", svc, r, err)
		}
	}
	if n := runtime.GOMAXPROCS(0); n != procs {
		t.Errorf("serving on %d processors, want %d", n, procs)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// startPicker runs the command on onePodConfig with args and returns a gRPC
// connection to it (closed when the test ends) and stop, which cancels the
// command and returns its error once it has returned (or after 15 s).
func startPicker(t *testing.T, args ...string) (*grpc.ClientConn, func() error) {
	t.Helper()
	path := writeFile(t, onePodConfig)
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan net.Addr, 1)
	done := make(chan error, 1)
	go func() { done <- run(ctx, append([]string{"--config", path}, args...), io.Discard, ready) }()
	stop := func() error {
		cancel()
		select {
		case err := <-done:
			return err
		case <-time.After(15 * time.Second):
			return errors.New("did not stop")
		}
	}
	var addr net.Addr
	select {
	case addr = <-ready:
	case err := <-done:
		t.Fatal(err)
	case <-time.After(30 * time.Second):
		stop()
		t.Fatal("not listening")
	}
	cc, err := grpc.NewClient(addr.String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		stop()
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc, stop
}

// freeAddr is a loopback address nothing listens on (for --metrics-listen,
// which the command binds itself).
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func hdrs(kv ...string) *corev3.HeaderMap {
	m := &corev3.HeaderMap{}
	for i := 0; i < len(kv); i += 2 {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return m
}

// The picker's own /metrics (--metrics-listen) exports the gateway
// metrics under the names the standalone gateway and the .so share
// (filter/gatewaymetrics): after one request exchanged as Envoy's ext_proc
// filter exchanges it (buffered request body, a streamed answer), the
// finished request is counted in llm_filter_requests_total and its first
// token timed in llm_filter_ttft_seconds, both by the matched rule's
// model_name and cluster.
func TestMetricsOfARequest(t *testing.T) {
	metrics := freeAddr(t)
	cc, stop := startPicker(t, "--metrics-listen", metrics)
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Error(err)
		}
	})

	// One request, as Envoy's ext_proc filter sends it (request headers
	// SEND, body BUFFERED, response headers SEND, body STREAMED).
	body := `{"model":"tiny","stream":true,"messages":[{"role":"user","content":"What is a KV cache?"}]}`
	stream, err := extprocv3.NewExternalProcessorClient(cc).Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	exchange := func(what string, req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
		t.Helper()
		if err := stream.Send(req); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		resp, err := stream.Recv()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if ir := resp.GetImmediateResponse(); ir != nil {
			t.Fatalf("%s: refused %v: %s", what, ir.GetStatus(), ir.GetBody())
		}
		return resp
	}
	exchange("request headers", &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: hdrs(":method", "POST", ":path", "/v1/chat/completions", ":authority", "llm", "content-type", "application/json", "content-length", fmt.Sprint(len(body)))}}})
	r := exchange("request body", &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(body), EndOfStream: true}}})
	var dest string
	for _, h := range r.GetRequestBody().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == epp.DestinationHeader {
			dest = h.GetHeader().GetValue()
			if raw := h.GetHeader().GetRawValue(); len(raw) > 0 {
				dest = string(raw)
			}
		}
	}
	if dest != "10.0.0.1:8000" {
		t.Fatalf("routed to %q, want the pool's pod 10.0.0.1:8000", dest)
	}
	exchange("response headers", &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
		Headers: hdrs(":status", "200", "content-type", "text/event-stream")}}})
	exchange("response body", &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
		Body: []byte("data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"A cache.\"}}]}\n\ndata: [DONE]\n\n"), EndOfStream: true}}})
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != io.EOF {
		t.Fatalf("the stream ends with %v, want EOF", err)
	}

	want := map[string]string{gatewaymetrics.LabelModel: "tiny", gatewaymetrics.LabelCluster: "pool"}
	has := func(m *dto.Metric, labels map[string]string) bool {
		got := map[string]string{}
		for _, l := range m.GetLabel() {
			got[l.GetName()] = l.GetValue()
		}
		for k, v := range labels {
			if got[k] != v {
				return false
			}
		}
		return true
	}
	var requests, ttft float64
	var families map[string]*dto.MetricFamily
	wait.For(t, 10*time.Second, "the request in the picker's /metrics", func() bool {
		resp, err := http.Get("http://" + metrics + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET /metrics: %s", resp.Status)
		}
		parser := expfmt.NewTextParser(model.UTF8Validation)
		families, err = parser.TextToMetricFamilies(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		requests, ttft = 0, 0
		for _, m := range families[gatewaymetrics.Requests].GetMetric() {
			if has(m, map[string]string{gatewaymetrics.LabelModel: "tiny", gatewaymetrics.LabelCluster: "pool", "outcome": gatewaymetrics.OutcomeSuccess}) {
				requests += m.GetCounter().GetValue()
			}
		}
		for _, m := range families[gatewaymetrics.TTFT].GetMetric() {
			if has(m, want) {
				ttft += float64(m.GetHistogram().GetSampleCount())
			}
		}
		return requests == 1 && ttft == 1
	})
	if f := families[gatewaymetrics.Requests]; f.GetType() != dto.MetricType_COUNTER {
		t.Errorf("%s is a %v, want a counter", gatewaymetrics.Requests, f.GetType())
	}
	if f := families[gatewaymetrics.TTFT]; f.GetType() != dto.MetricType_HISTOGRAM {
		t.Errorf("%s is a %v, want a histogram", gatewaymetrics.TTFT, f.GetType())
	}
	if gatewaymetrics.Requests != "llm_filter_requests_total" || gatewaymetrics.TTFT != "llm_filter_ttft_seconds" {
		t.Errorf("the shared names changed: %s, %s", gatewaymetrics.Requests, gatewaymetrics.TTFT)
	}
}

func TestRefusesABadFile(t *testing.T) {
	for name, tc := range map[string]struct{ doc, want string }{
		"no pods":     {"filter: {protocol: openai, model_mapping_rule: {tiny: [{cluster: pool}]}}\n", "endpoints.static"},
		"unknown key": {"listen: 127.0.0.1:0\nlisten_grpc: x\nfilter: {protocol: openai}\n", "listen_grpc"},
		"no filter":   {"listen: 127.0.0.1:0\n", "filter: missing"},
	} {
		t.Run(name, func(t *testing.T) {
			err := run(context.Background(), []string{"--config", writeFile(t, tc.doc)}, io.Discard, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v, want it to name %q", err, tc.want)
			}
		})
	}
	if err := run(context.Background(), nil, io.Discard, nil); err == nil || !strings.Contains(err.Error(), "--config") {
		t.Fatalf("without --config: %v", err)
	}
}

// onePodConfig is a picker's configuration with one rule (model tiny to
// cluster pool) and one pod.
const onePodConfig = `listen: 127.0.0.1:0
log_level: error
filter:
  protocol: openai
  model_mapping_rule:
    tiny:
      - {cluster: pool}
  endpoints:
    static:
      pool: [10.0.0.1:8000]
`
