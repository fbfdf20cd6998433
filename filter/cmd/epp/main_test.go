package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/istio-llm-filter/istio-llm-filter/filter/epp"
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
	path := writeFile(t, `listen: 127.0.0.1:0
log_level: error
filter:
  protocol: openai
  model_mapping_rule:
    tiny:
      - {cluster: pool}
  endpoints:
    static:
      pool: [10.0.0.1:8000]
`)
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan net.Addr, 1)
	done := make(chan error, 1)
	go func() { done <- run(ctx, append([]string{"--config", path}, args...), io.Discard, ready) }()
	var addr net.Addr
	select {
	case addr = <-ready:
	case err := <-done:
		t.Fatal(err)
	case <-time.After(30 * time.Second):
		t.Fatal("not listening")
	}
	cc, err := grpc.NewClient(addr.String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	for _, svc := range epp.HealthServices {
		r, err := healthpb.NewHealthClient(cc).Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
		if err != nil || r.Status != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("health %q: %v %v", svc, r, err)
		}
	}
	if n := runtime.GOMAXPROCS(0); n != procs {
		t.Errorf("serving on %d processors, want %d", n, procs)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("did not stop")
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
