package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// The test binary doubles as the command: with this variable set it runs
// main(), so the SIGTERM test exercises the real signal handling.
const envBeMain = "LLMF_MC_TEST_BE_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(envBeMain) == "1" {
		os.Args = append([]string{"metadata-center"}, strings.Fields(os.Getenv("LLMF_MC_TEST_ARGS"))...)
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func post(t *testing.T, url, token, body string) int {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestRunRedis starts the command in process on the real Redis, with the
// token from the environment, and stops it by cancelling its context.
func TestRunRedis(t *testing.T) {
	srv := redistest.Shared(t)
	t.Setenv(envAuthToken, "tok")
	ctx, cancel := context.WithCancel(context.Background())
	addrs := make(chan net.Addr, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--listen", "127.0.0.1:0", "--store", "redis", "--redis-addr", srv.Addr,
			"--redis-key-prefix", srv.Prefix, "--lease-ttl", "1m"}, io.Discard, func(a net.Addr) { addrs <- a })
	}()
	var base string
	select {
	case a := <-addrs:
		base = "http://" + a.String()
	case err := <-done:
		t.Fatalf("run: %v", err)
	}
	body := `{"cluster":"c","host":"10.0.0.1:1","request_id":"r","prompt_length":3}`
	if code := post(t, base+api.PathLoadStats, "", body); code != 401 {
		t.Fatalf("without token: %d", code)
	}
	if code := post(t, base+api.PathLoadStats, "tok", body); code != 200 {
		t.Fatalf("with token: %d", code)
	}
	req, _ := http.NewRequest("GET", base+api.PathLoadStats+"?cluster=c", nil)
	req.Header.Set("Authorization", "Bearer tok")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var load api.LoadStats
	err = json.NewDecoder(resp.Body).Decode(&load)
	resp.Body.Close()
	if err != nil || load["10.0.0.1:1"].TotalReqs != 1 {
		t.Fatalf("load = %v, %v", load, err)
	}
	if resp, err := http.Get(base + api.PathReadyz); err != nil || resp.StatusCode != 200 {
		t.Fatalf("readyz: %v %v", resp, err)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run returned %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("run did not stop")
	}
}

func TestFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--store", "etcd"},
		{"--redis-cluster"},
		{"--store", "redis", "--redis-cluster", "--redis-db", "1"},
		{"--store", "redis", "--redis-cluster", "--redis-addr", ","},
		{"--log-level", "loud"},
		{"--tls-cert-file", "/nonexistent/tls.crt"},
		{"--tls-cert-file", "/nonexistent/tls.crt", "--tls-key-file", "/nonexistent/tls.key"},
		{"--auth-token", "t", "--auth-token-file", "/nonexistent/token"},
		{"--redis-password", "p", "--redis-password-file", "/nonexistent/password"},
		{"--store", "redis", "--redis-password-file", "/nonexistent/password"},
		{"--store", "redis", "--redis-tls-ca-file", "/nonexistent/ca.crt"},
		{"extra"},
		{"--no-such-flag"},
	} {
		if err := run(context.Background(), args, io.Discard, nil); err == nil {
			t.Errorf("run(%q) succeeded", args)
		}
	}
}

// TestSIGTERM runs the command as its own process, keeps a slow request in
// flight, sends SIGTERM, and checks that the request still completes and
// the process exits cleanly.
func TestSIGTERM(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), envBeMain+"=1", "LLMF_MC_TEST_ARGS=--listen 127.0.0.1:0 --store memory")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	lines := make(chan map[string]any, 16)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) == nil {
				lines <- m
			}
		}
		close(lines)
	}()
	var addr string
	for addr == "" {
		select {
		case m, ok := <-lines:
			if !ok {
				t.Fatal("process exited before listening")
			}
			if m["msg"] == "metadata center listening" {
				addr, _ = m["addr"].(string)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("no listening log line")
		}
	}
	// A request is in flight when SIGTERM lands: its handler has begun
	// reading the body, which the server shows by answering its
	// "Expect: 100-continue" (net/http sends the 100 on the body's first
	// read), and the body arrives only after shutdown has begun.
	body := `{"cluster":"c","host":"10.0.0.1:1","hashes":["0123456789abcdef"]}`
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n",
		api.PathCacheSave, addr, len(body))
	br := bufio.NewReader(conn)
	if cont, err := http.ReadResponse(br, nil); err != nil || cont.StatusCode != http.StatusContinue {
		t.Fatalf("want 100 Continue once the handler reads the body, got %v %v", cont, err)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// Shutdown has begun once the listener refuses new connections.
	wait.For(t, 10*time.Second, "the listener to close on SIGTERM", func() bool {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			return true
		}
		c.Close()
		return false
	})
	if _, err := io.WriteString(conn, body); err != nil {
		t.Fatal(err)
	}
	if resp, err := http.ReadResponse(br, nil); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("in-flight request during shutdown: %v, error %v", resp, err)
	}
	var stopped bool
	for m := range lines { // until the process closes stderr
		stopped = stopped || m["msg"] == "stopped"
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("exit: %v", err)
	}
	if !stopped {
		t.Fatal(`no "stopped" log line`)
	}
}

// With --scrape-config the command scrapes the vLLM pods the file lists and
// answers their signals; a config it cannot use stops it.
func TestScrapeConfig(t *testing.T) {
	pod := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "vllm:num_requests_running{model_name=\"q\"} 6\nvllm:num_requests_waiting{model_name=\"q\"} 2\nvllm:kv_cache_usage_perc{model_name=\"q\"} 0.5\n")
	}))
	defer pod.Close()
	host := strings.TrimPrefix(pod.URL, "http://")
	dir := t.TempDir()
	cfg := filepath.Join(dir, "scrape.yaml")
	doc := fmt.Sprintf("clusters:\n  pool: {backend: vllm, pods: [%s]}\n", host)
	if err := os.WriteFile(cfg, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	addrs := make(chan net.Addr, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--listen", "127.0.0.1:0", "--scrape-config", cfg, "--scrape-interval", "20ms"}, io.Discard, func(a net.Addr) { addrs <- a })
	}()
	var base string
	select {
	case a := <-addrs:
		base = "http://" + a.String()
	case err := <-done:
		t.Fatalf("run: %v", err)
	}
	wait.For(t, 5*time.Second, "the scraped pod's signals", func() bool {
		resp, err := http.Get(base + api.PathPodSignals + "?cluster=pool")
		if err != nil {
			t.Fatal(err)
		}
		var sig map[string]api.PodSignals
		err = json.NewDecoder(resp.Body).Decode(&sig)
		resp.Body.Close()
		return err == nil && sig[host].Running == 6 && sig[host].Waiting == 2 && sig[host].KVCacheUtil == 0.5
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run returned %v", err)
	}
	if err := os.WriteFile(cfg, []byte("clusters: {pool: {backend: triton, pods: [10.0.0.1:8000]}}"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := run(context.Background(), []string{"--listen", "127.0.0.1:0", "--scrape-config", cfg}, io.Discard, nil); err == nil || !strings.Contains(err.Error(), "--scrape-config") {
		t.Fatalf("an unusable scrape config: %v", err)
	}
	if err := run(context.Background(), []string{"--listen", "127.0.0.1:0", "--scrape-config", filepath.Join(dir, "missing")}, io.Discard, nil); err == nil {
		t.Fatal("a missing scrape config was accepted")
	}
}
