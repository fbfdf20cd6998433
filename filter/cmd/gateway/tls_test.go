package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/istio-llm-filter/istio-llm-filter/internal/secretfile"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/certtest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
)

// syncBuffer is a log sink the gateway writes to while the test reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// get returns the body of GET url with client hc.
func get(t *testing.T, hc *http.Client, url string) string {
	t.Helper()
	resp, err := hc.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// TestGatewayToTLSMetadataCenter routes through a metadata center that
// accepts TLS only and a token from a file: the gateway trusting its CA
// makes authenticated route queries over TLS; one trusting another CA
// still serves the request, routed without metadata, and logs why.
func TestGatewayToTLSMetadataCenter(t *testing.T) {
	gin.SetMode(gin.ReleaseMode)
	ca := certtest.NewCA(t, "mc CA")
	pair := ca.Issue("metadata-center", "127.0.0.1")
	dir := t.TempDir()
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte("gw-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tokens, err := secretfile.ServerTokens(token, 0, secretfile.Options[[]string]{})
	if err != nil {
		t.Fatal(err)
	}
	srv := server.New(memstore.New(memstore.Options{}), server.Options{Tokens: tokens})
	stls, err := secretfile.ServerTLS(pair.CertFile, pair.KeyFile, secretfile.Options[*tls.Certificate]{})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: srv.Handler(), ErrorLog: log.New(io.Discard, "", 0)}
	go func() { _ = hs.Serve(tls.NewListener(ln, stls)) }()
	defer hs.Close()
	mcURL := "https://" + ln.Addr().String()
	ctls, err := secretfile.ClientTLS(ca.CertFile, "", false)
	if err != nil {
		t.Fatal(err)
	}
	mcHTTP := &http.Client{Transport: &http.Transport{TLSClientConfig: ctls}}

	// Two pods: with one there is nothing to ask the metadata center.
	var pods []string
	for range 2 {
		backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("content-type", "application/json")
			io.WriteString(w, `{"object":"chat.completion","choices":[{"message":{"content":"hi"}}]}`)
		}))
		defer backend.Close()
		pods = append(pods, backend.Listener.Addr().String())
	}

	gateway := func(caFile string) (base string, logs *syncBuffer) {
		t.Helper()
		path := writeConfig(t, fmt.Sprintf(`
listen: 127.0.0.1:0
log_level: warn
default_cluster: tiny-pool
filter:
  metadata_center:
    address: %s
    auth_token_file: %s
    tls: {ca_file: %s}
  model_mapping_rule:
    qwen:
      - cluster: tiny-pool
        backend: llamacpp
  endpoints:
    static: {tiny-pool: [%s]}
`, mcURL, token, caFile, strings.Join(pods, ", ")))
		ctx, cancel := context.WithCancel(context.Background())
		ready := make(chan net.Addr, 1)
		done := make(chan error, 1)
		logs = &syncBuffer{}
		go func() { done <- run(ctx, []string{"--config", path}, logs, ready) }()
		t.Cleanup(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("gateway shutdown: %v", err)
			}
		})
		select {
		case addr := <-ready:
			return "http://" + addr.String(), logs
		case err := <-done:
			done <- err
			t.Fatalf("gateway exited: %v", err)
		case <-time.After(10 * time.Second):
			t.Fatal("gateway not ready")
		}
		return "", nil
	}
	chat := func(base string) {
		t.Helper()
		resp, err := http.Post(base+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"qwen","messages":[{"role":"user","content":"hello over TLS"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("answer %d %s", resp.StatusCode, body)
		}
	}

	base, _ := gateway(ca.CertFile)
	chat(base)
	const queried = `llmf_metadata_center_requests_total{code="200",endpoint="/v1/route/query",method="POST"} 1`
	if m := get(t, mcHTTP, mcURL+"/metrics"); !strings.Contains(m, queried) {
		t.Fatalf("the metadata center answered no authenticated route query over TLS:\n%s", m)
	}
	// The lease the gateway added is released once the request is done.
	wait.For(t, 5*time.Second, "the gateway's updates over TLS", func() bool {
		m := get(t, mcHTTP, mcURL+"/metrics")
		return strings.Contains(m, `endpoint="/v1/load/stats",method="DELETE"`) || strings.Contains(m, `endpoint="/v1/batch",method="POST"`)
	})

	other := certtest.NewCA(t, "other CA")
	base, logs := gateway(other.CertFile)
	chat(base) // served all the same, routed without metadata
	// The refused route query counts once among the metadata center's
	// errors; the request's updates count there too, once per batch (the
	// default batch_window), as their batches finish, and every batch
	// this gateway sends is refused alike.
	queryErrors := func() float64 {
		batches := metric(t, base, "llm_filter_async_batches_total")
		return metric(t, base, "llm_filter_metadata_center_errors_total") - batches
	}
	wait.For(t, 5*time.Second, "the refused route query counted once", func() bool { return queryErrors() == 1 })
	if l := logs.String(); !strings.Contains(l, "not signed by a trusted CA") {
		t.Fatalf("the gateway's log does not say why:\n%s", l)
	}
	if m := get(t, mcHTTP, mcURL+"/metrics"); !strings.Contains(m, queried) {
		t.Fatalf("the metadata center answered a route query to a gateway that cannot trust it:\n%s", m)
	}
}
