// Package redistest gives tests a real redis-server on loopback.
//
// StartTLS (tls.go) launches a private server that speaks TLS only and
// knows one ACL user.
//
// Shared returns the server that `make test` (scripts/test.sh) started for the
// whole run, with a key prefix private to the calling test, so packages running
// in parallel never see each other's keys. Start launches a private server the
// test owns, for tests that must stop and restart Redis (outage handling).
// Without LLMF_TEST_REDIS_ADDR, Shared falls back to Start, so `go test` works
// on any machine that has redis-server on its PATH.
package redistest

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// EnvAddr names the variable that points tests at an already running server.
const EnvAddr = "LLMF_TEST_REDIS_ADDR"

// Server is one redis-server reachable on loopback.
type Server struct {
	Addr   string // host:port
	Prefix string // key prefix private to this test

	t    testing.TB
	port int
	cmd  *exec.Cmd
	dir  string
}

// Shared returns the run-wide server if there is one, else a private one.
func Shared(t testing.TB) *Server {
	t.Helper()
	if addr := os.Getenv(EnvAddr); addr != "" {
		return &Server{Addr: addr, Prefix: uniquePrefix(), t: t}
	}
	return Start(t)
}

// Start launches a private redis-server and stops it when the test ends.
func Start(t testing.TB) *Server {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Fatalf("redis-server not on PATH (install Debian's redis-server, or run `make test`): %v", err)
	}
	s := &Server{t: t, dir: t.TempDir(), Prefix: uniquePrefix()}
	s.port = freePort(t)
	s.Addr = fmt.Sprintf("127.0.0.1:%d", s.port)
	s.launch()
	t.Cleanup(s.Stop)
	return s
}

// Stop kills a private server; the address stays reserved for Restart.
func (s *Server) Stop() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
}

// Restart brings a stopped private server back on the same port, empty.
func (s *Server) Restart() {
	s.t.Helper()
	if s.port == 0 {
		s.t.Fatal("redistest: Restart needs a server made by Start")
	}
	s.Stop()
	s.launch()
}

func (s *Server) launch() {
	s.t.Helper()
	s.cmd = spawn(s.t, "--port", fmt.Sprint(s.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", s.dir,
		"--protected-mode", "no")
}

// spawn starts redis-server with args and returns once it accepts
// connections.
func spawn(t testing.TB, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("redis-server", args...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start redis-server: %v", err)
	}
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stdout)
		signalled := false
		for sc.Scan() {
			if !signalled && strings.Contains(sc.Text(), "Ready to accept connections") {
				close(ready)
				signalled = true
			}
		}
	}()
	select {
	case <-ready:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatal("redis-server did not become ready in 10s")
	}
	return cmd
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func uniquePrefix() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return "t" + hex.EncodeToString(b)
}
