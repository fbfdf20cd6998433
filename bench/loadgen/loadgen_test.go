package loadgen

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/client"
	"github.com/istio-llm-filter/istio-llm-filter/bench/report"
	"github.com/istio-llm-filter/istio-llm-filter/bench/vllmsim"
	"github.com/istio-llm-filter/istio-llm-filter/bench/workload"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
)

// backend is an OpenAI server on a real listener that records what it was
// sent; it reads requests with the worker's parser and answers with the
// worker's SSE writer (worker/openai), as a gateway in front of a worker
// does, upstream-host header included.
type backend struct {
	mu       sync.Mutex
	bodies   []map[string]any
	inflight atomic.Int64
	peak     atomic.Int64
	fail     string // user text that gets a 503
}

func (b *backend) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := b.inflight.Add(1)
	// The request leaves before its last bytes are written: a client may
	// send its next request as soon as it reads them, before this handler
	// returns.
	leave := sync.OnceFunc(func() { b.inflight.Add(-1) })
	defer leave()
	for {
		p := b.peak.Load()
		if n <= p || b.peak.CompareAndSwap(p, n) {
			break
		}
	}
	raw, _ := io.ReadAll(r.Body)
	req, p, e := openai.ParseChat(raw)
	if e != nil {
		leave()
		openai.WriteError(w, e)
		return
	}
	var body map[string]any
	_ = json.Unmarshal(raw, &body)
	b.mu.Lock()
	b.bodies = append(b.bodies, body)
	b.mu.Unlock()
	msgs := req.Messages
	if b.fail != "" && strings.Contains(msgs[len(msgs)-1].Content.String(), b.fail) {
		leave()
		openai.WriteError(w, &openai.Error{Status: http.StatusServiceUnavailable, Type: openai.TypeUnavailable, Message: "no"})
		return
	}
	w.Header().Set(headers.UpstreamHost, "10.0.0.1:8000")
	s := openai.NewChatStream(w, "id", p.Model, time.Now(), p.IncludeUsage)
	s.Begin(0)
	for i := 0; i < 3; i++ {
		s.Content(0, fmt.Sprintf("w%d ", i), nil)
	}
	s.Finish(0, "length")
	leave()
	s.End(openai.NewUsage(len(msgs)*10, 3, 7))
}

func TestMultiTurnCarriesAnswersAndMeasures(t *testing.T) {
	be := &backend{}
	srv := httptest.NewServer(be)
	defer srv.Close()
	sessions, _ := workload.Generate(workload.Spec{Kind: "multi-turn", Sessions: 3, Turns: 3, SystemBytes: 50, UserBytes: 20})
	var progress atomic.Int64
	var mu sync.Mutex
	sent := map[string][]client.Message{} // session/turn → messages, answer last
	rs := Run(context.Background(), sessions, Options{BaseURL: srv.URL, Model: "m", MaxTokens: 3, Concurrency: 2,
		Progress: func(done, total int) { progress.Store(int64(done)); _ = total },
		Sent: func(r report.Result, msgs []client.Message, answer string) {
			mu.Lock()
			sent[fmt.Sprintf("%s/%d", r.Session, r.Turn)] = append(msgs, client.Message{Role: "answer", Content: answer})
			mu.Unlock()
		}})
	if len(rs) != 9 || progress.Load() != 9 || len(sent) != 9 {
		t.Fatalf("results %d, progress %d, told of %d; want 9", len(rs), progress.Load(), len(sent))
	}
	// Sent is told what each request carried: a third turn, its system
	// prompt, two turns with their answers, its own question, and its answer.
	if m := sent[sessions[0].ID+"/2"]; len(m) != 7 || m[0].Role != "system" || m[2].Content != "w0 w1 w2 " ||
		m[5].Content != sessions[0].Turns[2].User || m[6].Content != "w0 w1 w2 " {
		t.Errorf("third turn's messages as told: %+v", m)
	}
	for _, r := range rs {
		if !r.OK() {
			t.Fatalf("request failed: %+v", r)
		}
		if r.TTFT <= 0 || r.TTFT > r.Latency {
			t.Fatalf("TTFT %v not within the latency %v", r.TTFT, r.Latency)
		}
		if r.CachedTokens != 7 || r.CompletionTokens != 3 || r.Worker != "10.0.0.1:8000" {
			t.Fatalf("usage/worker not parsed: %+v", r)
		}
		// system + (user, assistant) per earlier turn + user
		if want := 10 * (2 + 2*r.Turn); r.PromptTokens != want {
			t.Fatalf("turn %d sent %d messages' worth, want %d", r.Turn, r.PromptTokens, want)
		}
	}
	// The third turn of a session must carry the first two answers verbatim.
	found := false
	for _, b := range be.bodies {
		msgs := b["messages"].([]any)
		if len(msgs) == 6 {
			found = true
			if got := msgs[2].(map[string]any)["content"]; got != "w0 w1 w2 " {
				t.Fatalf("assistant history = %q", got)
			}
			if b["ignore_eos"] != true || b["max_tokens"] != float64(3) || b["stream"] != true {
				t.Fatalf("request lacks fixed-length streaming knobs: %v", b)
			}
		}
	}
	if !found {
		t.Fatal("no third turn seen")
	}
	if p := be.peak.Load(); p > 2 {
		t.Fatalf("peak concurrency %d exceeds 2", p)
	}
}

func TestFailureStopsSessionAndIsRecorded(t *testing.T) {
	be := &backend{fail: "BOOM"}
	srv := httptest.NewServer(be)
	defer srv.Close()
	sessions := []workload.Session{{ID: "s", Turns: []workload.Turn{{User: "BOOM"}, {User: "never sent"}}}}
	rs := Run(context.Background(), sessions, Options{BaseURL: srv.URL, Model: "m", MaxTokens: 3, Concurrency: 1})
	if len(rs) != 1 || rs[0].OK() || rs[0].Status != 503 || !strings.Contains(rs[0].Err, "503") {
		t.Fatalf("results = %+v", rs)
	}
}

func TestPoissonArrivals(t *testing.T) {
	be := &backend{}
	srv := httptest.NewServer(be)
	defer srv.Close()
	sessions, _ := workload.Generate(workload.Spec{Kind: "no-sharing", Requests: 10, SystemBytes: 10, QuestionBytes: 10})
	t0 := time.Now()
	rs := Run(context.Background(), sessions, Options{BaseURL: srv.URL, Model: "m", MaxTokens: 3, Rate: 200, Seed: 3})
	if len(rs) != 10 {
		t.Fatalf("got %d results", len(rs))
	}
	starts := map[time.Duration]bool{}
	for _, r := range rs {
		if !r.OK() {
			t.Fatalf("failed: %+v", r)
		}
		starts[r.Start] = true
	}
	if len(starts) < 5 || time.Since(t0) > 10*time.Second {
		t.Fatalf("arrivals not spread: %d distinct starts", len(starts))
	}
}

// TestRoundRobinOverGateways: with BaseURLs every request goes to the next
// gateway in turn, so a conversation's turns meet several gateways.
func TestRoundRobinOverGateways(t *testing.T) {
	var bes [3]*backend
	var urls []string
	for i := range bes {
		bes[i] = &backend{}
		srv := httptest.NewServer(bes[i])
		defer srv.Close()
		urls = append(urls, srv.URL)
	}
	sessions, _ := workload.Generate(workload.Spec{Kind: "multi-turn", Sessions: 4, Turns: 3, SystemBytes: 50, UserBytes: 20})
	rs := Run(context.Background(), sessions, Options{BaseURLs: urls, Model: "m", MaxTokens: 3, Concurrency: 1})
	if len(rs) != 12 {
		t.Fatalf("results %d, want 12", len(rs))
	}
	for i, be := range bes {
		if n := len(be.bodies); n != 4 {
			t.Fatalf("gateway %d got %d requests, want 4 of 12", i, n)
		}
	}
	// One session at a time: the first session's turn i went to gateway i
	// (system + user, then an assistant and a user per earlier turn).
	for i, be := range bes {
		if msgs := be.bodies[0]["messages"].([]any); len(msgs) != 2+2*i {
			t.Fatalf("gateway %d's first request has %d messages, want turn %d's %d", i, len(msgs), i, 2+2*i)
		}
	}
}

func TestPlannedSessionsGoStraightToTheirWorker(t *testing.T) {
	var gw, w0, w1 backend
	gwSrv, w0Srv, w1Srv := httptest.NewServer(&gw), httptest.NewServer(&w0), httptest.NewServer(&w1)
	defer gwSrv.Close()
	defer w0Srv.Close()
	defer w1Srv.Close()
	addr := func(s *httptest.Server) string { return strings.TrimPrefix(s.URL, "http://") }
	sessions, _ := workload.Generate(workload.Spec{Kind: "shared-prefix", Systems: 2, Users: 2, Questions: 3, SystemBytes: 50, UserBytes: 20, QuestionBytes: 10})
	// s0's users on two workers, s1's through the gateway.
	plan := map[string]string{"s0/u0": addr(w0Srv), "s0/u1": addr(w1Srv)}
	rs := Run(context.Background(), sessions, Options{BaseURL: gwSrv.URL, Model: "m", MaxTokens: 3, Concurrency: 2, Plan: plan})
	if len(rs) != 12 {
		t.Fatalf("results %d, want 12", len(rs))
	}
	if len(w0.bodies) != 3 || len(w1.bodies) != 3 || len(gw.bodies) != 6 {
		t.Fatalf("requests: worker 0 %d, worker 1 %d, gateway %d; want 3, 3, 6", len(w0.bodies), len(w1.bodies), len(gw.bodies))
	}
	for _, r := range rs {
		want := "10.0.0.1:8000" // the gateway's upstream header
		switch {
		case strings.HasPrefix(r.Session, "sp-0-0-"):
			want = addr(w0Srv)
		case strings.HasPrefix(r.Session, "sp-0-1-"):
			want = addr(w1Srv)
		}
		if !r.OK() || r.Worker != want {
			t.Fatalf("%s: ok %v, worker %q; want %q", r.Session, r.OK(), r.Worker, want)
		}
	}
}

// Against a real vLLM-like pod: each turn asks for its own output length,
// a turn's think time passes between the previous answer and it, and the
// gateway's predicted TTFT, slot wait and cached share headers (added here
// as the gateway adds them) are recorded.
func TestPerTurnOutputsThinkTimeAndPredictedTTFT(t *testing.T) {
	cfg := vllmsim.DefaultConfig()
	cfg.StepTime, cfg.PrefillPerToken, cfg.DecodePerSeq = time.Millisecond, 0, 0
	pod, err := vllmsim.NewPod(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go pod.Run(ctx)
	api := pod.Handler()
	var asked atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(headers.PredictedTTFT, "42.5")
		if asked.Add(1) == 2 { // the second turn waits for an end and is believed half cached
			w.Header().Set(headers.PredictedSlotWait, "30")
			w.Header().Set(headers.PredictedCachedShare, "0.500")
		}
		api.ServeHTTP(w, r)
	}))
	defer srv.Close()
	sess := workload.Session{ID: "s", System: "a system prompt", Turns: []workload.Turn{
		{User: "first", MaxTokens: 7}, {User: "second", MaxTokens: 19, Think: 300 * time.Millisecond}, {User: "third"}}}
	rs := Run(ctx, []workload.Session{sess}, Options{BaseURL: srv.URL, Model: cfg.ModelName, MaxTokens: 5, Concurrency: 1})
	if len(rs) != 3 {
		t.Fatalf("%d results", len(rs))
	}
	slices.SortFunc(rs, func(a, b report.Result) int { return a.Turn - b.Turn })
	for i, want := range []int{7, 19, 5} {
		if !rs[i].OK() || rs[i].CompletionTokens != want || rs[i].PredictedTTFTms != 42.5 {
			t.Fatalf("turn %d: %+v, want %d tokens and the predicted 42.5 ms", i, rs[i], want)
		}
		if wantWait := map[bool]float64{true: 30}[i == 1]; rs[i].PredictedSlotWaitms != wantWait {
			t.Fatalf("turn %d: predicted slot wait %v ms, want %v", i, rs[i].PredictedSlotWaitms, wantWait)
		}
		if share := rs[i].PredictedCachedShare; (share != nil) != (i == 1) || i == 1 && *share != 0.5 {
			t.Fatalf("turn %d: predicted cached share %v, want 0.5 on the second turn only", i, share)
		}
	}
	if gap := rs[1].Start - (rs[0].Start + rs[0].Latency); gap < 300*time.Millisecond {
		t.Fatalf("the second turn came %v after the first answer, want at least its 300ms think time", gap)
	}
	if rs[1].CachedTokens == 0 {
		t.Fatal("the second turn hit nothing of the first turn's history")
	}
}
