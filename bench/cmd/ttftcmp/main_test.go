package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
)

func selfCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// spin burns d of this process's CPU time (not wall time: the machine may
// be loaded).
func spin(d time.Duration) {
	for end := selfCPU() + d; selfCPU() < end; {
	}
}

// TestSpinHelper is the child of the test below.
func TestSpinHelper(t *testing.T) {
	if os.Getenv("TTFTCMP_SPIN") == "" {
		t.Skip("helper")
	}
	spin(400 * time.Millisecond)
	io.Copy(io.Discard, os.Stdin) // until the parent closes our stdin
}

// treeCPU counts this process's own work and that of a child it started.
func TestTreeCPUCountsTheProcessAndItsChildren(t *testing.T) {
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no /proc")
	}
	t0, r0 := treeCPU(os.Getpid()), selfCPU()
	spin(300 * time.Millisecond)
	own := treeCPU(os.Getpid()) - t0
	if want := selfCPU() - r0; own < want-50*time.Millisecond || own > want+50*time.Millisecond {
		t.Fatalf("treeCPU counted %v of this process's %v", own, want)
	}
	cmd := exec.Command(os.Args[0], "-test.run=TestSpinHelper")
	cmd.Env = append(os.Environ(), "TTFTCMP_SPIN=1")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { stdin.Close(); cmd.Wait() }()
	t1, r1 := treeCPU(os.Getpid()), selfCPU()
	var child time.Duration
	if !wait.Until(60*time.Second, func() bool {
		child = treeCPU(os.Getpid()) - t1 - (selfCPU() - r1)
		return child >= 350*time.Millisecond
	}) {
		t.Fatalf("a child's 400 ms of work counted as %v", child)
	}
	if treeCPU(0) != 0 {
		t.Fatal("pid 0 has CPU time")
	}
}

// server is an OpenAI server on a real listener that answers with the
// worker's own parser and SSE writer (worker/openai); it counts the
// requests it saw and fails the test on one it cannot parse.
func server(t *testing.T, text string, seen *atomic.Int64) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		raw, _ := io.ReadAll(r.Body)
		_, p, e := openai.ParseChat(raw)
		if e != nil || !p.Stream || p.Temperature != 0 {
			t.Errorf("request %s: %v, params %+v", raw, e, p)
			openai.WriteError(w, openai.BadRequest("", "bad request"))
			return
		}
		seen.Add(1)
		s := openai.NewChatStream(w, "id", p.Model, time.Now(), p.IncludeUsage)
		s.Begin(0)
		if text != "" {
			s.Content(0, text, nil)
		}
		s.Finish(0, "stop")
		s.End(nil)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// A run over two servers, one of which ends every answer before any text:
// warm-ups, then every scenario's users on each server, and a table with a
// row per scenario and a column per server.
func TestRunComparesServers(t *testing.T) {
	var a, b atomic.Int64
	sa, sb := server(t, "hello", &a), server(t, "", &b)
	c := config{targets: targets{{"worker", sa.URL, "tiny"}, {"other", sb.URL, "tiny.gguf"}}, pids: pids{},
		scenarios: []string{"cold", "shared", "distinct"}, rounds: 2, users: 3, systemTokens: 64, coldTokens: 64, maxTokens: 2, timeout: 10 * time.Second}
	var out bytes.Buffer
	if err := run(context.Background(), c, &out); err != nil {
		t.Fatal(err)
	}
	// A warm-up, then per round: one cold request and the users of two scenarios.
	if want := int64(1 + 2*(1+3+3)); a.Load() != want || b.Load() != want {
		t.Fatalf("requests %d and %d, want %d each", a.Load(), b.Load(), want)
	}
	for _, want := range []string{"| scenario | worker | other |", "| cold | ", "| shared | ", "| distinct | "} {
		if !strings.Contains(out.String(), want) {
			t.Fatalf("output lacks %q:\n%s", want, out.String())
		}
	}
	dead := server(t, "x", new(atomic.Int64))
	dead.Close()
	c.targets = targets{{"dead", dead.URL, "tiny"}}
	if err := run(context.Background(), c, io.Discard); err == nil || !strings.Contains(err.Error(), "dead: warm-up") {
		t.Fatalf("run against a closed server: %v", err)
	}
}
