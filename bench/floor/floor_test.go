package floor

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/client"
	"github.com/istio-llm-filter/istio-llm-filter/bench/vllmsim"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/cgoenv"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/sim"
	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
)

// A vLLM-like pod with 16-token blocks, 64 tokens a step, 10 ms a step and
// 1 ms a prefill token. Worked by hand:
//   - a 100-token prompt sharing 40 tokens reuses 2 whole blocks (32); the
//     68 left take a step of 64 and one of 4: (10 + 64) + (10 + 4) = 88 ms;
//   - sharing all 100, it reuses the blocks before the last token's, 6
//     blocks (96): one step of 4 tokens, 14 ms;
//   - sharing 15 tokens (less than a block), nothing: 64 + 36 tokens,
//     (10 + 64) + (10 + 36) = 120 ms.
func TestVLLMFloorHandWorked(t *testing.T) {
	v := VLLM{Config: vllmsim.Config{BlockSize: 16, MaxNumBatchedTokens: 64, StepTime: 10 * time.Millisecond, PrefillPerToken: time.Millisecond}}
	for _, c := range []struct {
		shared, n, reuse int
		ttft             time.Duration
	}{{40, 100, 32, 88 * time.Millisecond}, {100, 100, 96, 14 * time.Millisecond}, {15, 100, 0, 120 * time.Millisecond}} {
		r := v.Reuse(c.shared, c.n)
		if r != c.reuse {
			t.Errorf("Reuse(%d, %d) = %d, want %d", c.shared, c.n, r, c.reuse)
		}
		if got := v.TTFT(c.n, r); got != c.ttft {
			t.Errorf("TTFT(%d, %d) = %v, want %v", c.n, r, got, c.ttft)
		}
	}
}

// Our worker's simulated engine, 4 tokens a step (n_batch), 1 ms a step,
// 1 ms a token, 2 ms a sample, 1 ms per token per 1000 cells of context
// (1 µs a token-cell). A 10-token prompt sharing 4 tokens: a chunk of 4
// at positions 4–7 (attention 4·4 + 4·5/2 = 26 token-cells) costs
// 1 + 4 + 0.026 ms; the last chunk of 2 at 8–9 (2·8 + 3 = 19) samples:
// 1 + 2 + 2 + 0.019 ms. 10.045 ms in all. Sharing all 10 reuses 9 (the
// last is always evaluated): 1 + 1 + 2 + (9 + 1) µs = 4.010 ms.
func TestSimFloorHandWorked(t *testing.T) {
	s, err := NewSim(openai.ChatML(), 4, sim.Cost{StepOverhead: time.Millisecond, PerToken: time.Millisecond,
		PerSample: 2 * time.Millisecond, PerKCtxToken: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if r := s.Reuse(4, 10); r != 4 {
		t.Errorf("Reuse(4, 10) = %d, want 4", r)
	}
	if got, want := s.TTFT(10, 4), 10045*time.Microsecond; got != want {
		t.Errorf("TTFT(10, 4) = %v, want %v", got, want)
	}
	if r := s.Reuse(10, 10); r != 9 {
		t.Errorf("Reuse(10, 10) = %d, want 9", r)
	}
	if got, want := s.TTFT(10, 9), 4010*time.Microsecond; got != want {
		t.Errorf("TTFT(10, 9) = %v, want %v", got, want)
	}
}

// bytesEngine is an engine for the worked example of TTFTs: a token per byte of
// the messages' text, every shared token reused but the last, 1 ms per
// token computed.
type bytesEngine struct{}

func (bytesEngine) Tokens(r Request) (prompt, held []int, err error) {
	for _, m := range r.Messages {
		for _, b := range []byte(m.Content) {
			prompt = append(prompt, int(b))
		}
	}
	held = prompt
	if r.Answer != "" {
		for _, b := range []byte(r.Answer[:len(r.Answer)-1]) {
			held = append(held, int(b))
		}
	}
	return prompt, held, nil
}
func (bytesEngine) Reuse(shared, n int) int { return min(shared, n-1) }
func (bytesEngine) TTFT(n, cached int) time.Duration {
	return time.Duration(n-cached) * time.Millisecond
}

// Worked by hand: "aaaa" (answered "xy") is first, 4 ms; "aaab" shares 3
// with it, 1 ms; "aaaax" + "q" shares "aaaa" and the answer's evaluated
// "x" (its "y" was sampled, never evaluated), 5 of 6: 1 ms; "bbbb" shares
// nothing, 4 ms; "aaab" + "c" shares 4 with the second request, not 3 with
// the first: 1 ms.
func TestTTFTsTakeTheLongestPrefixOfAnyEarlierRequest(t *testing.T) {
	req := func(text, answer string) Request {
		return Request{Messages: []Message{{Role: "user", Content: text}}, Answer: answer}
	}
	got, err := TTFTs(bytesEngine{}, []Request{req("aaaa", "xy"), req("aaab", ""), req("aaaaxq", ""), req("bbbb", ""), req("aaabc", "")})
	if err != nil {
		t.Fatal(err)
	}
	want := []time.Duration{4, 1, 1, 4, 1}
	for i := range want {
		if got[i] != want[i]*time.Millisecond {
			t.Errorf("request %d: floor %v, want %v", i, got[i], want[i]*time.Millisecond)
		}
	}
}

// The floor's model of a vLLM-like pod against a real one (bench/vllmsim
// on loopback): a conversation's first turn, then its second carrying the
// answer, each alone on the idle pod. The pod reports the prompt's tokens
// and the cached tokens the floor counts, and no first token comes sooner
// than the floor says.
func TestVLLMFloorAgreesWithAPod(t *testing.T) {
	c := vllmsim.DefaultConfig()
	c.NumBlocks, c.MaxModelLen, c.MaxNumBatchedTokens = 256, 2048, 64
	c.StepTime, c.PrefillPerToken = 2*time.Millisecond, 50*time.Microsecond
	base := startPod(t, c)
	v := VLLM{Config: c}
	msgs := []Message{{"system", strings.Repeat("You answer questions about the shared manual of the fleet. ", 12)},
		{"user", "How do I restart a pod?"}}
	var earlier []Request
	for turn := range 2 {
		prompt, cached, answer, ttft := send(t, base, msgs)
		r := Request{Messages: msgs, Answer: answer}
		p, _, err := v.Tokens(r)
		if err != nil {
			t.Fatal(err)
		}
		floors, err := TTFTs(v, append(earlier, r))
		if err != nil {
			t.Fatal(err)
		}
		// The reuse the floor counts for this request, from the prefix it shares.
		shared := longestShared(v, p, earlier)
		if prompt != len(p) || cached != v.Reuse(shared, len(p)) {
			t.Errorf("turn %d: the pod counted %d prompt tokens, %d cached; the floor %d, %d", turn, prompt, cached, len(p), v.Reuse(shared, len(p)))
		}
		if turn == 1 && cached == 0 {
			t.Errorf("turn 1 found nothing cached")
		}
		if f := floors[len(floors)-1]; ttft < f {
			t.Errorf("turn %d: first token after %v, sooner than the floor %v", turn, ttft, f)
		}
		earlier = append(earlier, r)
		msgs = append(msgs, Message{"assistant", answer}, Message{"user", "And how do I drain it first?"})
	}
}

// A vLLM-like pod running at most 4 sequences, 8 ms a step, 0.5 ms per
// decoding sequence, 0.1 ms a prefill token. A request of 100 tokens, 20
// cached, 11 out: 80 × 0.1 = 8 ms of prefill and 10 decode steps at
// 8/4 + 0.5 = 2.5 ms each, 33 ms. Two such requests on 3 pods: 3 × 2 /
// 0.066 s ≈ 90.9 requests/s.
func TestVLLMBusyHandWorked(t *testing.T) {
	v := VLLM{Config: vllmsim.Config{BlockSize: 16, MaxNumSeqs: 4, StepTime: 8 * time.Millisecond,
		DecodePerSeq: 500 * time.Microsecond, PrefillPerToken: 100 * time.Microsecond}}
	if got, want := v.Busy(100, 20, 11), 33*time.Millisecond; got != want {
		t.Errorf("Busy(100, 20, 11) = %v, want %v", got, want)
	}
	if got, want := v.Busy(100, 20, 1), 8*time.Millisecond; got != want {
		t.Errorf("Busy(100, 20, 1) = %v, want %v", got, want)
	}
}

// busyBytes is bytesEngine with 1 ms a computed token and 10 ms an output
// token past the first.
type busyBytes struct{ bytesEngine }

func (busyBytes) Busy(n, cached, out int) time.Duration {
	return time.Duration(n-cached)*time.Millisecond + time.Duration(out-1)*10*time.Millisecond
}

// Bounds' capacity counts each request's work after the longest prefix it shares
// with any earlier one: "aaaa" answered "xy" (4 computed, 2 out: 14 ms),
// then "aaaaxq" (the held "aaaax" shared, the last token computed: 1 ms,
// 1 out), "bbbb" (4 ms): 19 ms for 3 requests, on 2 pods 6/0.019 s.
func TestCapacityTakesEachRequestsLeastWork(t *testing.T) {
	req := func(text, answer string) Request {
		return Request{Messages: []Message{{Role: "user", Content: text}}, Answer: answer}
	}
	got, err := Bounds(busyBytes{}, []Request{req("aaaa", "xy"), req("aaaaxq", ""), req("bbbb", "")}, 2)
	if err != nil {
		t.Fatal(err)
	}
	if want := 6 / 0.019; math.Abs(got.Capacity-want) > 1e-9*want {
		t.Errorf("Capacity = %v, want %v", got.Capacity, want)
	}
	// The same pass gives the floors (4, 1 and 4 ms: TTFTs).
	if want := []time.Duration{4 * time.Millisecond, time.Millisecond, 4 * time.Millisecond}; !slices.Equal(got.TTFTs, want) {
		t.Errorf("floors %v, want %v", got.TTFTs, want)
	}
	if got, err := Bounds(bytesEngine{}, []Request{req("a", "")}, 2); got.Capacity != 0 || err != nil {
		t.Errorf("an engine without Busy: %v, %v; want no capacity, nil", got.Capacity, err)
	}
}

// The bound against a real vLLM-like pod (bench/vllmsim on loopback),
// kept saturated: 12 requests at once on a pod that runs 4, each sharing
// a system prompt. The pod takes at least the least time the bound
// counts for them, so it serves them no faster than Bounds says.
func TestAPodServesNoFasterThanItsCapacity(t *testing.T) {
	c := vllmsim.DefaultConfig()
	c.NumBlocks, c.MaxModelLen, c.MaxNumSeqs, c.MaxNumBatchedTokens = 256, 2048, 4, 256
	c.StepTime, c.PrefillPerToken, c.DecodePerSeq = 4*time.Millisecond, 20*time.Microsecond, 500*time.Microsecond
	base := startPod(t, c)
	system := strings.Repeat("You answer questions about the shared manual of the fleet. ", 8)
	const n = 12
	reqs := make([]Request, n)
	errs := make(chan error, n)
	start := time.Now()
	for i := range n {
		go func() {
			msgs := []Message{{"system", system}, {"user", fmt.Sprintf("Question %d: how do I restart pod %d?", i, i)}}
			res := (&client.Client{}).Do(context.Background(), base, client.Request{Model: "tiny",
				Messages: []client.Message{{Role: "system", Content: system}, {Role: "user", Content: msgs[1].Content}},
				Stream:   true, MaxTokens: 24, FixedLength: true})
			if res.Outcome != client.OK {
				errs <- fmt.Errorf("%s: %s", res.Outcome, res.Err)
				return
			}
			reqs[i] = Request{Messages: msgs, Answer: res.Text}
			errs <- nil
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	elapsed := time.Since(start)
	b, err := Bounds(VLLM{Config: c}, reqs, 1)
	if err != nil {
		t.Fatal(err)
	}
	bound := b.Capacity
	if served := n / elapsed.Seconds(); served > bound {
		t.Errorf("the pod served %.1f requests/s, above the bound %.1f", served, bound)
	}
	t.Logf("served %.1f requests/s, bound %.1f", n/elapsed.Seconds(), bound)
}

// The floor's model of our worker on its simulated engine against the real
// worker process (its defaults: ChatML, n_batch 512, the bench
// calibration), the same conversation of two turns, each alone: the worker
// counts the prompt's tokens and the cached tokens the floor counts, and
// no first token comes sooner than the floor says.
func TestSimFloorAgreesWithAWorker(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and starts the worker")
	}
	_, file, _, _ := runtime.Caller(0)
	bin := t.TempDir()
	cmd := exec.Command("go", "build", "-o", bin+"/", "./worker/cmd/worker")
	cmd.Dir = filepath.Join(filepath.Dir(file), "..", "..")
	cmd.Env = cgoenv.Environ()
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	w := exec.Command(filepath.Join(bin, "worker"), "--listen", addr, "--engine", "sim", "--model-name", "tiny")
	w.Stderr = io.Discard
	if err := w.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = w.Process.Kill(); _ = w.Wait() }()
	base := "http://" + addr
	wait.For(t, 30*time.Second, "the worker on "+addr, func() bool {
		resp, err := http.Get(base + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	e, _, err := For("sim", nil, "")
	if err != nil {
		t.Fatal(err)
	}
	msgs := []Message{{"system", strings.Repeat("You answer questions about the shared manual of the fleet. ", 6)},
		{"user", "How do I restart a pod?"}}
	var earlier []Request
	for turn := range 2 {
		prompt, cached, answer, ttft := send(t, base, msgs)
		r := Request{Messages: msgs, Answer: answer}
		p, _, err := e.Tokens(r)
		if err != nil {
			t.Fatal(err)
		}
		shared := longestShared(e, p, earlier)
		if prompt != len(p) || cached != e.Reuse(shared, len(p)) {
			t.Errorf("turn %d: the worker counted %d prompt tokens, %d cached; the floor %d, %d", turn, prompt, cached, len(p), e.Reuse(shared, len(p)))
		}
		if turn == 1 && cached == 0 {
			t.Errorf("turn 1 found nothing cached")
		}
		floors, err := TTFTs(e, append(earlier, r))
		if err != nil {
			t.Fatal(err)
		}
		if f := floors[len(floors)-1]; ttft < f {
			t.Errorf("turn %d: first token after %v, sooner than the floor %v", turn, ttft, f)
		}
		earlier = append(earlier, r)
		msgs = append(msgs, Message{"assistant", answer}, Message{"user", "And how do I drain it first?"})
	}
}

// startPod serves one vLLM-like pod of c on loopback until the test ends
// and returns its base URL.
func startPod(t *testing.T, c vllmsim.Config) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- vllmsim.Serve(ctx, c, []net.Listener{l}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return "http://" + l.Addr().String()
}

// send posts one streamed chat completion of 8 tokens with the
// benchmarks' client and returns the usage it reports, the answer and the
// time to its first content.
func send(t *testing.T, base string, msgs []Message) (prompt, cached int, answer string, ttft time.Duration) {
	t.Helper()
	cm := make([]client.Message, len(msgs))
	for i, m := range msgs {
		cm[i] = client.Message{Role: m.Role, Content: m.Content}
	}
	res := (&client.Client{}).Do(context.Background(), base, client.Request{Model: "tiny", Messages: cm, Stream: true,
		MaxTokens: 8, FixedLength: true, Usage: true})
	if res.Outcome != client.OK {
		t.Fatalf("%s: %s", res.Outcome, res.Err)
	}
	return res.PromptTokens, res.CachedTokens, res.Text, res.TTFT
}

func TestForReadsThePodsFlags(t *testing.T) {
	e, _, err := For("vllm", []string{"--num-gpu-blocks", "96", "--max-num-batched-tokens=256", "--step-time", "5ms"}, "")
	if err != nil {
		t.Fatal(err)
	}
	if c := e.(VLLM).Config; c.MaxNumBatchedTokens != 256 || c.StepTime != 5*time.Millisecond || c.BlockSize != 16 {
		t.Errorf("vllm config %+v", c)
	}
	e, _, err = For("sim", []string{"--max-concurrent-requests=4", "--n-batch", "128", "--sim-per-token=1ms"}, "")
	if err != nil {
		t.Fatal(err)
	}
	if s := e.(*Sim); s.NBatch != 128 || s.Cost.PerToken != time.Millisecond || s.Cost.StepOverhead != sim.BenchCost().StepOverhead {
		t.Errorf("sim floor %+v", s)
	}
	if _, _, err := For("vllm", []string{"--no-such-flag"}, ""); err == nil {
		t.Error("an unknown vllmsim flag was accepted")
	}
	if e, why, err := For("llama", nil, ""); e != nil || why == "" || err != nil {
		t.Errorf("llama: %v, %q, %v; want no floor and a reason", e, why, err)
	}
}

// longestShared is the longest prefix of prompt that a pod holds after
// serving any of earlier.
func longestShared(e Engine, prompt []int, earlier []Request) int {
	shared := 0
	for _, r := range earlier {
		_, h, _ := e.Tokens(r)
		shared = max(shared, commonPrefix(prompt, h))
	}
	return shared
}
