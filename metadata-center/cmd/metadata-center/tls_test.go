package main

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/secretfile"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/certtest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
)

// startRun runs the command in process with args and returns its address;
// it is stopped when the test ends.
func startRun(t *testing.T, args ...string) net.Addr {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	addrs := make(chan net.Addr, 1)
	done := make(chan error, 1)
	go func() { done <- run(ctx, args, io.Discard, func(a net.Addr) { addrs <- a }) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run returned %v", err)
		}
	})
	select {
	case a := <-addrs:
		return a
	case err := <-done:
		done <- err
		t.Fatalf("run: %v", err)
	}
	return nil
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil { // atomically, as kubelet does
		t.Fatal(err)
	}
}

// TestTLSEndToEnd runs the metadata center with TLS only, its token from a
// file, on a Redis that speaks TLS only to an ACL user: a client trusting
// the CA is served, one trusting another CA and a plain-HTTP one are
// refused, and a rotated token takes effect without a restart.
func TestTLSEndToEnd(t *testing.T) {
	rds := redistest.StartTLS(t)
	ca := certtest.NewCA(t, "mc CA")
	pair := ca.Issue("metadata-center", "127.0.0.1", "metadata-center.llm.svc")
	dir := t.TempDir()
	serverTok, clientTok := filepath.Join(dir, "server-token"), filepath.Join(dir, "client-token")
	writeFile(t, serverTok, "tok-a\n")
	writeFile(t, clientTok, "tok-a\n")

	addr := startRun(t, "--listen", "127.0.0.1:0", "--store", "redis",
		"--tls-cert-file", pair.CertFile, "--tls-key-file", pair.KeyFile,
		"--auth-token-file", serverTok, "--auth-token-grace", "0s", "--reload-interval", "50ms",
		"--redis-addr", rds.Addr, "--redis-key-prefix", rds.Prefix,
		"--redis-username", rds.Username, "--redis-password-file", rds.PasswordFile,
		"--redis-tls-ca-file", rds.CAFile)
	base := "https://" + addr.String()

	tc, err := secretfile.ClientTLS(ca.CertFile, "", false)
	if err != nil {
		t.Fatal(err)
	}
	mc, err := client.New(client.Options{Address: base, AuthTokenFile: clientTok, TLS: tc})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := mc.AddRequest(ctx, api.AddRequest{Cluster: "c", Host: "10.0.0.1:1", RequestID: "r1", PromptLength: 3}); err != nil {
		t.Fatalf("add over TLS, through the TLS Redis: %v", err)
	}
	ans, err := mc.Route(ctx, "c", nil)
	if err != nil || ans.Load["10.0.0.1:1"].TotalReqs != 1 {
		t.Fatalf("route over TLS: %+v, %v", ans, err)
	}

	// The server name may differ from the address dialled.
	named, err := secretfile.ClientTLS(ca.CertFile, "metadata-center.llm.svc", false)
	if err != nil {
		t.Fatal(err)
	}
	mcNamed, err := client.New(client.Options{Address: base, AuthTokenFile: clientTok, TLS: named})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := mcNamed.Route(ctx, "c", nil); err != nil {
		t.Fatalf("with server_name: %v", err)
	}

	// A client trusting another CA refuses the server, and says why.
	wrong, err := secretfile.ClientTLS(certtest.NewCA(t, "other CA").CertFile, "", false)
	if err != nil {
		t.Fatal(err)
	}
	mcWrong, err := client.New(client.Options{Address: base, AuthTokenFile: clientTok, TLS: wrong})
	if err != nil {
		t.Fatal(err)
	}
	_, err = mcWrong.Route(ctx, "c", nil)
	if err == nil || !strings.Contains(err.Error(), "not signed by a trusted CA") {
		t.Fatalf("a client with the wrong CA: %v", err)
	}
	// A name the certificate does not carry is refused too.
	badName, _ := secretfile.ClientTLS(ca.CertFile, "elsewhere.example", false)
	mcBadName, _ := client.New(client.Options{Address: base, TLS: badName})
	if _, err := mcBadName.Route(ctx, "c", nil); err == nil || !strings.Contains(err.Error(), "not for this name") {
		t.Fatalf("a client expecting another name: %v", err)
	}
	// Plain HTTP gets nothing but the server's refusal.
	mcPlain, err := client.New(client.Options{Address: "http://" + addr.String(), AuthTokenFile: clientTok})
	if err != nil {
		t.Fatal(err)
	}
	var se *client.StatusError
	if _, err := mcPlain.Route(ctx, "c", nil); !errors.As(err, &se) || se.Status != http.StatusBadRequest {
		t.Fatalf("plain HTTP to the TLS port: %v", err)
	}

	// Rotation: the server's file changes first; once it refuses the old
	// token, the client's file changes, and the client's next 401 makes it
	// read its file again.
	writeFile(t, serverTok, "tok-b\n")
	probe := &http.Client{Transport: &http.Transport{TLSClientConfig: tc}}
	wait.For(t, 10*time.Second, "the server to refuse the rotated-out token", func() bool {
		req, _ := http.NewRequest(http.MethodGet, base+api.PathPods+"?cluster=c", nil)
		req.Header.Set("Authorization", "Bearer tok-a")
		resp, err := probe.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusUnauthorized
	})
	writeFile(t, clientTok, "tok-b\n")
	wait.For(t, 10*time.Second, "the client to send the rotated token", func() bool {
		_, err := mc.Route(ctx, "c", nil)
		if err != nil && !client.Permanent(err) {
			t.Fatal(err)
		}
		return err == nil
	})
}

// A TLS Redis refuses the metadata center's plain-TCP connections, and the
// wrong password: /readyz says so.
func TestRedisTLSRefusesPlainAndWrongPassword(t *testing.T) {
	rds := redistest.StartTLS(t)
	dir := t.TempDir()
	badPW := filepath.Join(dir, "bad")
	writeFile(t, badPW, "not-the-password\n")
	for name, args := range map[string][]string{
		"plain TCP":      {"--redis-username", rds.Username, "--redis-password-file", rds.PasswordFile},
		"wrong password": {"--redis-username", rds.Username, "--redis-password-file", badPW, "--redis-tls-ca-file", rds.CAFile},
		"default user":   {"--redis-password-file", rds.PasswordFile, "--redis-tls-ca-file", rds.CAFile},
	} {
		t.Run(name, func(t *testing.T) {
			addr := startRun(t, append([]string{"--listen", "127.0.0.1:0", "--store", "redis",
				"--redis-addr", rds.Addr, "--redis-key-prefix", rds.Prefix}, args...)...)
			resp, err := http.Get("http://" + addr.String() + api.PathReadyz)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusServiceUnavailable {
				t.Fatalf("readyz %d, want 503", resp.StatusCode)
			}
		})
	}
}
