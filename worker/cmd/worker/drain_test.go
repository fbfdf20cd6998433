package main

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

// runMainEnv makes the test binary run the worker's main instead of the
// tests: the drain test signals a real process, as the kubelet does.
const runMainEnv = "LLMF_TEST_RUN_WORKER_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(runMainEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// process is the worker running as its own process.
type process struct {
	cmd    *exec.Cmd
	url    string
	exited chan error
}

func startProcess(t *testing.T, args ...string) *process {
	t.Helper()
	cmd := exec.Command(os.Args[0], append(args, "--listen", "127.0.0.1:0")...)
	cmd.Env = append(os.Environ(), runMainEnv+"=1")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &process{cmd: cmd, exited: make(chan error, 1)}
	addr := make(chan string, 1)
	go func() {
		// Reads stderr to its end, so that the pipe never blocks the worker.
		ready := regexp.MustCompile(`msg="worker ready" addr=(\S+)`)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			if m := ready.FindStringSubmatch(sc.Text()); m != nil {
				addr <- m[1]
			}
		}
		p.exited <- cmd.Wait()
	}()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
		}
	})
	select {
	case a := <-addr:
		p.url = "http://" + a
	case <-time.After(60 * time.Second):
		t.Fatal("the worker process did not start")
	}
	return p
}

func TestSIGTERMDrainsRunningAndQueuedRequestsThenExitsZero(t *testing.T) {
	p := startProcess(t, "--model", testmodel.Path(t), "--n-ctx", "4096", "--n-seq-max", "4", "--threads", "1",
		"--max-concurrent-requests", "1", "--max-output-tokens", "3500", "--drain-timeout", "60s", "--log-level", "info")

	stream := longStream(t, p.url)
	// A request queued behind it (one running slot).
	queued := make(chan int, 1)
	go func() {
		r, err := http.Post(p.url+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"ignore_eos":true}`))
		if err != nil {
			queued <- 0
			return
		}
		io.Copy(io.Discard, r.Body)
		r.Body.Close()
		queued <- r.StatusCode
	}()
	waitUntil(t, "the second request to queue", func() bool {
		var h struct{ Queued int }
		r, err := http.Get(p.url + "/healthz")
		if err != nil {
			return false
		}
		defer r.Body.Close()
		json.NewDecoder(r.Body).Decode(&h)
		return h.Queued == 1
	})

	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// Readiness turns false at once.
	waitUntil(t, "/readyz to answer 503", func() bool {
		r, err := http.Get(p.url + "/readyz")
		if err != nil {
			t.Fatalf("/readyz while draining: %v", err)
		}
		r.Body.Close()
		return r.StatusCode == http.StatusServiceUnavailable
	})
	// New requests get 503 with Retry-After in the error format.
	r, err := http.Post(p.url+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"late"}],"max_tokens":4}`))
	if err != nil {
		t.Fatal(err)
	}
	var e struct {
		Error struct {
			Code int    `json:"code"`
			Type string `json:"type"`
		} `json:"error"`
	}
	json.NewDecoder(r.Body).Decode(&e)
	r.Body.Close()
	if r.StatusCode != 503 || r.Header.Get("Retry-After") == "" || e.Error.Code != 503 || e.Error.Type == "" {
		t.Fatalf("a new request while draining: status %d, Retry-After %q, body %+v", r.StatusCode, r.Header.Get("Retry-After"), e)
	}
	// The running stream finishes whole, the queued request runs.
	tokens, done := 0, false
	for !done {
		l, err := stream.ReadString('\n')
		if err != nil {
			t.Fatalf("the stream was cut after %d chunks: %v", tokens, err)
		}
		switch {
		case l == "data: [DONE]\n":
			done = true
		case strings.Contains(l, `"error"`):
			t.Fatalf("the stream ended with an error: %s", l)
		case strings.HasPrefix(l, "data: "):
			tokens++
		}
	}
	if st := <-queued; st != 200 {
		t.Fatalf("the queued request got %d", st)
	}
	exitsZero(t, p, "draining")
}

// waitUntil polls cond for at most 20 s.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	wait.For(t, 20*time.Second, what, cond)
}

// When --drain-timeout ends first, what still runs fails with a 503 in the
// error format, as the stream's last event (never a silent cut), and the
// worker exits 0.
func TestSIGTERMDrainTimeoutFailsWhatStillRunsThenExitsZero(t *testing.T) {
	p := startProcess(t, "--model", testmodel.Path(t), "--n-ctx", "4096", "--n-seq-max", "4", "--threads", "1",
		"--max-concurrent-requests", "1", "--max-output-tokens", "3500", "--drain-timeout", "1s", "--log-level", "info")

	stream := longStream(t, p.url)
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	var last string
	for {
		l, err := stream.ReadString('\n')
		if err != nil {
			break
		}
		if l == "data: [DONE]\n" {
			break
		}
		if strings.HasPrefix(l, "data: ") {
			last = l
		}
	}
	var ev struct {
		Error struct {
			Code int    `json:"code"`
			Type string `json:"type"`
		} `json:"error"`
	}
	if err := json.Unmarshal([]byte(strings.TrimPrefix(strings.TrimSpace(last), "data: ")), &ev); err != nil || ev.Error.Code != 503 || ev.Error.Type == "" {
		t.Fatalf("the stream's last event %q (%v): want a 503 error event", last, err)
	}
	exitsZero(t, p, "its drain timeout")
}

// longStream starts a 3,500-token stream on the worker at url and returns
// it once its first chunk has arrived: a request running, mid-answer.
func longStream(t *testing.T, url string) *bufio.Reader {
	t.Helper()
	body := `{"model":"m","messages":[{"role":"user","content":"tell a long story"}],"max_tokens":3500,"ignore_eos":true,"temperature":0,"stream":true}`
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("stream: %v %v", resp, err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	stream := bufio.NewReader(resp.Body)
	if l, err := stream.ReadString('\n'); err != nil || !strings.HasPrefix(l, "data: ") {
		t.Fatalf("first line %q %v", l, err)
	}
	return stream
}

// exitsZero waits (30 s at most) for the worker to exit after what, and
// fails the test unless it exits 0.
func exitsZero(t *testing.T, p *process, after string) {
	t.Helper()
	select {
	case err := <-p.exited:
		if err != nil {
			t.Fatalf("the worker exited with %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("the worker did not exit after %s", after)
	}
}
