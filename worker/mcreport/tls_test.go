package mcreport

import (
	"context"
	"crypto/tls"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-llm-filter/istio-llm-filter/internal/secretfile"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/certtest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// A worker reports to a metadata center that accepts TLS only and a token
// from a file; one that trusts another CA gets nothing through.
func TestReportsOverTLS(t *testing.T) {
	ca := certtest.NewCA(t, "mc CA")
	pair := ca.Issue("metadata-center", "127.0.0.1")
	token := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(token, []byte("worker-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tokens, err := secretfile.ServerTokens(token, 0, secretfile.Options[[]string]{})
	if err != nil {
		t.Fatal(err)
	}
	stls, err := secretfile.ServerTLS(pair.CertFile, pair.KeyFile, secretfile.Options[*tls.Certificate]{})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := server.New(memstore.New(memstore.Options{}), server.Options{Tokens: tokens, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	hs := &http.Server{Handler: srv.Handler(), ErrorLog: log.New(io.Discard, "", 0)}
	go func() { _ = hs.Serve(tls.NewListener(ln, stls)) }()
	t.Cleanup(func() { hs.Close() })
	url := "https://" + ln.Addr().String()

	const cluster, host = "outbound|8000||tiny", "10.0.0.7:9001"
	ctls, err := secretfile.ClientTLS(ca.CertFile, "", false)
	if err != nil {
		t.Fatal(err)
	}
	mc, err := client.New(client.Options{Address: url, AuthTokenFile: token, TLS: ctls})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)

	rep, err := New(Config{URL: url, Cluster: cluster, Host: host, ChunkSize: 512, AuthTokenFile: token, CAFile: ca.CertFile,
		MaxBackoff: 20 * time.Millisecond, Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	go rep.Run(ctx)
	select {
	case <-rep.Cleared():
	case <-time.After(10 * time.Second):
		t.Fatal("the start-up evict-all was not acknowledged over TLS")
	}
	hs2 := prefix.Wire([]prefix.Hash{21, 22})
	if err := mc.SaveCache(ctx, api.CacheSave{Cluster: cluster, Host: host, Hashes: hs2, ChunkSize: 512}); err != nil {
		t.Fatal(err)
	}
	if n := heldLength(t, mc, cluster, host, hs2); n != 2 {
		t.Fatalf("the host holds %d blocks, want 2", n)
	}
	rep.Evict([]prefix.Hash{21})
	fctx, fcancel := context.WithTimeout(ctx, 10*time.Second)
	defer fcancel()
	if err := rep.Flush(fctx); err != nil {
		t.Fatal(err)
	}
	if n := heldLength(t, mc, cluster, host, hs2); n != 0 {
		t.Fatalf("after the report over TLS the host holds %d blocks, want 0", n)
	}

	wrong, err := New(Config{URL: url, Cluster: cluster, Host: "10.0.0.8:9001", ChunkSize: 512, AuthTokenFile: token,
		CAFile: certtest.NewCA(t, "other CA").CertFile, MaxBackoff: 20 * time.Millisecond, Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	go wrong.Run(ctx)
	wait.For(t, 10*time.Second, "a failed report from the worker trusting another CA", func() bool {
		return counterValue(t, wrong.sent.WithLabelValues("error")) > 0
	})
	select {
	case <-wrong.Cleared():
		t.Fatal("a worker trusting another CA got its evict-all through")
	default:
	}
	if _, err := New(Config{URL: url, Cluster: cluster, Host: host, CAFile: filepath.Join(t.TempDir(), "absent")}); err == nil {
		t.Fatal("a missing CA file was accepted")
	}
}
