package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/llama"
	"github.com/istio-llm-filter/istio-llm-filter/worker/kvcache"
	"github.com/istio-llm-filter/istio-llm-filter/worker/mcreport"
	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
	"github.com/istio-llm-filter/istio-llm-filter/worker/scheduler"
	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

type worker struct {
	url   string
	sched *scheduler.Scheduler
	eng   engine.Engine
	reg   *prometheus.Registry
}

type opts struct {
	nCtx, nSeq int
	sched      scheduler.Config
	mc         *mcreport.Reporter
	logger     *slog.Logger
	model      string // default: the tiny test model
	threads    int    // default 1
	vllm       bool   // export the vLLM metrics (scheduler.ExportVLLM)
}

func startWorker(t testing.TB, o opts) *worker {
	t.Helper()
	if o.nCtx == 0 {
		o.nCtx = 4096
	}
	if o.nSeq == 0 {
		o.nSeq = 8
	}
	if o.model == "" {
		o.model = testmodel.Path(t)
	}
	if o.threads == 0 {
		o.threads = 1
	}
	eng, err := llama.Open(llama.Config{ModelPath: o.model, NCtx: o.nCtx, NSeqMax: o.nSeq, Threads: o.threads})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	o.sched.Metrics = scheduler.NewMetrics(reg)
	tmpl, _, err := openai.LoadTemplate(o.model)
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{Registry: reg, RequestTimeout: o.sched.RequestTimeout, ModelName: "tiny", Logger: o.logger, Template: tmpl}
	if o.mc != nil {
		o.sched.OnEvictAt = o.mc.EvictAt
		cfg.Evictions = o.mc.Recent
	}
	sched, err := scheduler.New(eng, o.sched.WithDefaults())
	if err != nil {
		t.Fatal(err)
	}
	if o.vllm {
		if err := sched.ExportVLLM(reg, "tiny", nil); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { sched.Run(ctx); close(done) }()
	srv := httptest.NewServer(New(sched, eng, cfg))
	t.Cleanup(func() {
		srv.CloseClientConnections()
		cancel()
		<-done
		srv.Close()
		eng.Close()
	})
	return &worker{url: srv.URL, sched: sched, eng: eng, reg: reg}
}

func (w *worker) inspect(t *testing.T, fn func(scheduler.View)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := w.sched.Inspect(ctx, fn); err != nil {
		t.Fatal(err)
	}
}

type chatResp struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Choices []struct {
		Message struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		Text         string `json:"text"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	Usage openai.Usage `json:"usage"`
}

type errBody struct {
	Error struct {
		Code    int    `json:"code"`
		Type    string `json:"type"`
		Message string `json:"message"`
	} `json:"error"`
}

func post(t *testing.T, url, path string, body any) (*http.Response, []byte) {
	t.Helper()
	var b []byte
	switch v := body.(type) {
	case string:
		b = []byte(v)
	default:
		b, _ = json.Marshal(v)
	}
	resp, err := http.Post(url+path, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp, out
}

func msgs(pairs ...string) []map[string]string {
	var out []map[string]string
	for i := 0; i+1 < len(pairs); i += 2 {
		out = append(out, map[string]string{"role": pairs[i], "content": pairs[i+1]})
	}
	return out
}

func chat(t *testing.T, w *worker, m []map[string]string, extra map[string]any) chatResp {
	t.Helper()
	body := map[string]any{"model": "tiny", "messages": m, "temperature": 0, "max_tokens": 16, "ignore_eos": true}
	for k, v := range extra {
		body[k] = v
	}
	resp, out := post(t, w.url, "/v1/chat/completions", body)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, out)
	}
	var c chatResp
	if err := json.Unmarshal(out, &c); err != nil {
		t.Fatal(err)
	}
	return c
}

func longText(n int, salt string) string {
	var sb strings.Builder
	for i := 0; sb.Len() < n; i++ {
		fmt.Fprintf(&sb, "%s sentence %d talks about the weather and the sea. ", salt, i)
	}
	return sb.String()
}

func TestSecondTurnReportsCachedTokensAndPrefillsLess(t *testing.T) {
	w := startWorker(t, opts{})
	turn1 := msgs("system", "You are terse.", "user", longText(1500, "first"))
	a := chat(t, w, turn1, nil)
	if a.Usage.PromptTokens < 1500 || a.Usage.CompletionTokens != 16 || a.Usage.PromptTokensDetails == nil || a.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("turn 1 usage %+v", a.Usage)
	}
	if a.Object != "chat.completion" || a.Choices[0].Message.Role != "assistant" || a.Choices[0].FinishReason != "length" {
		t.Fatalf("turn 1 %+v", a)
	}
	turn2 := append(slices.Clone(turn1), msgs("assistant", a.Choices[0].Message.Content, "user", "and tomorrow?")...)
	b := chat(t, w, turn2, nil)
	cached := b.Usage.PromptTokensDetails.CachedTokens
	if cached < a.Usage.PromptTokens || cached >= b.Usage.PromptTokens {
		t.Fatalf("turn 2: %d of %d prompt tokens cached; turn 1 had %d", cached, b.Usage.PromptTokens, a.Usage.PromptTokens)
	}
	computed := b.Usage.PromptTokens - cached
	if computed > 100 {
		t.Fatalf("turn 2 prefilled %d tokens; only the new turn should be", computed)
	}
	// The same conversation on a fresh worker: no cache, same greedy text.
	cold := startWorker(t, opts{})
	c := chat(t, cold, turn2, nil)
	if c.Usage.PromptTokensDetails.CachedTokens != 0 || c.Choices[0].Message.Content != b.Choices[0].Message.Content {
		t.Fatalf("cold %q (cached %d) vs warm %q", c.Choices[0].Message.Content, c.Usage.PromptTokensDetails.CachedTokens, b.Choices[0].Message.Content)
	}
	metrics := scrape(t, w)
	for _, want := range []string{`llmf_worker_prompt_tokens_total{source="cached"}`, "llmf_worker_ttft_seconds_count 2", "llmf_worker_generated_tokens_total 32",
		"llmf_worker_queue_depth", "llmf_worker_seq_ids_in_use", "llmf_worker_kv_cache_bytes", "llmf_worker_kv_cache_items", "llmf_worker_running_requests"} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

func scrape(t *testing.T, w *worker) string {
	t.Helper()
	resp, err := http.Get(w.url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// sse reads a stream's data payloads up to [DONE].
func sse(t testing.TB, r io.Reader) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("not an SSE data line: %q", line)
		}
		out = append(out, data)
		if data == "[DONE]" {
			return out
		}
	}
	t.Fatalf("stream ended without [DONE]: %v (%v)", out, sc.Err())
	return nil
}

func TestStreamingMatchesTheWholeAnswer(t *testing.T) {
	w := startWorker(t, opts{})
	m := msgs("user", "Tell me a story about a robot.")
	whole := chat(t, w, m, map[string]any{"max_tokens": 24})
	b, _ := json.Marshal(map[string]any{"model": "tiny", "messages": m, "temperature": 0, "max_tokens": 24, "ignore_eos": true,
		"stream": true, "stream_options": map[string]any{"include_usage": true}})
	resp, err := http.Post(w.url+"/v1/chat/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("status %d type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	events := sse(t, resp.Body)
	var text strings.Builder
	var finish string
	var usage *openai.Usage
	for _, e := range events[:len(events)-1] {
		var c struct {
			Object  string `json:"object"`
			Choices []struct {
				Delta struct {
					Content *string `json:"content"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
			Usage *openai.Usage `json:"usage"`
		}
		if err := json.Unmarshal([]byte(e), &c); err != nil {
			t.Fatalf("event %q: %v", e, err)
		}
		if c.Object != "chat.completion.chunk" {
			t.Fatalf("object %q", c.Object)
		}
		for _, ch := range c.Choices {
			if ch.Delta.Content != nil {
				text.WriteString(*ch.Delta.Content)
			}
			if ch.FinishReason != nil {
				finish = *ch.FinishReason
			}
		}
		if c.Usage != nil {
			usage = c.Usage
		}
	}
	if text.String() != whole.Choices[0].Message.Content || finish != "length" {
		t.Fatalf("streamed %q (%s), whole %q", text.String(), finish, whole.Choices[0].Message.Content)
	}
	if usage == nil || usage.CompletionTokens != 24 || usage.PromptTokensDetails.CachedTokens == 0 {
		t.Fatalf("usage %+v: the repeat should reuse the first request's cells", usage)
	}
}

func TestStopSequenceCutsTheText(t *testing.T) {
	w := startWorker(t, opts{})
	m := msgs("user", "count with me")
	full := chat(t, w, m, map[string]any{"max_tokens": 40}).Choices[0].Message.Content
	// Random weights write arbitrary bytes; pick two printable ASCII
	// characters in a row past the start as the stop string.
	stop := ""
	for i := 4; i+2 <= len(full); i++ {
		if full[i] > ' ' && full[i] < 0x7f && full[i+1] > ' ' && full[i+1] < 0x7f {
			stop = full[i : i+2]
			break
		}
	}
	if stop == "" {
		t.Skipf("greedy output %q has no ASCII pair to stop at", full)
	}
	want := full[:strings.Index(full, stop)]
	got := chat(t, w, m, map[string]any{"max_tokens": 40, "stop": []string{stop}})
	if got.Choices[0].Message.Content != want || got.Choices[0].FinishReason != "stop" {
		t.Fatalf("stop %q: got %q (%s), want %q", stop, got.Choices[0].Message.Content, got.Choices[0].FinishReason, want)
	}
	if got.Usage.CompletionTokens >= 40 {
		t.Fatalf("generation did not stop: %d tokens", got.Usage.CompletionTokens)
	}
}

func TestCompletionsEndpoint(t *testing.T) {
	w := startWorker(t, opts{})
	resp, out := post(t, w.url, "/v1/completions", map[string]any{"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": true})
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, out)
	}
	var c chatResp
	json.Unmarshal(out, &c)
	if c.Object != "text_completion" || c.Choices[0].FinishReason != "length" || c.Usage.CompletionTokens != 8 {
		t.Fatalf("%s", out)
	}
}

func TestBadInputGets400InTheSeedFormat(t *testing.T) {
	w := startWorker(t, opts{nCtx: 512})
	cases := map[string]struct {
		path, body string
	}{
		"malformed JSON":                    {"/v1/chat/completions", `{"model": "tiny", "messages": [`},
		"missing messages":                  {"/v1/chat/completions", `{"model": "tiny"}`},
		"negative max_tokens":               {"/v1/chat/completions", `{"model": "tiny", "messages": [{"role":"user","content":"hi"}], "max_tokens": -5}`},
		"prompt too long":                   {"/v1/chat/completions", fmt.Sprintf(`{"model": "tiny", "messages": [{"role":"user","content":%q}]}`, longText(2000, "x"))},
		"completion too long":               {"/v1/completions", fmt.Sprintf(`{"model": "tiny", "prompt": %q}`, longText(2000, "x"))},
		"missing prompt":                    {"/v1/completions", `{"model": "tiny"}`},
		"max_tokens past the context":       {"/v1/chat/completions", `{"model": "tiny", "messages": [{"role":"user","content":"hi"}], "max_tokens": 1000000000000}`},
		"stop token outside the vocabulary": {"/v1/chat/completions", `{"model": "tiny", "messages": [{"role":"user","content":"hi"}], "stop_token_ids": [1000000]}`},
	}
	for name, c := range cases {
		resp, out := post(t, w.url, c.path, c.body)
		var e errBody
		if err := json.Unmarshal(out, &e); err != nil || resp.StatusCode != 400 || e.Error.Code != 400 || e.Error.Type == "" || e.Error.Message == "" {
			t.Errorf("%s: status %d body %s", name, resp.StatusCode, out)
		}
	}
	resp, out := post(t, w.url, "/v1/chat/completions", fmt.Sprintf(`{"model": "tiny", "messages": [{"role":"user","content":%q}]}`, longText(2000, "x")))
	if !strings.Contains(string(out), "context holds 512") {
		t.Errorf("too-long message should name the context size: %d %s", resp.StatusCode, out)
	}
	// What the context cannot hold is refused as OpenAI does, naming the
	// parameter, instead of running until the context is full.
	resp, out = post(t, w.url, "/v1/chat/completions", `{"model": "tiny", "messages": [{"role":"user","content":"hi"}], "max_tokens": 500}`)
	if resp.StatusCode != 400 || !strings.Contains(string(out), "context holds 512 tokens") || !strings.Contains(string(out), "500 in the completion") {
		t.Errorf("max_tokens 500 in a 512-token context: %d %s", resp.StatusCode, out)
	}
	w.inspect(t, func(v scheduler.View) {
		if v.Pool.InUse() != 0 {
			t.Fatalf("refused requests hold %d seq ids", v.Pool.InUse())
		}
	})
}

func TestOverloadGets429WithRetryAfter(t *testing.T) {
	w := startWorker(t, opts{sched: scheduler.Config{MaxRunning: 1, MaxQueue: 1, MaxOutputTokens: 4000}})
	b, _ := json.Marshal(map[string]any{"model": "tiny", "messages": msgs("user", "go"), "max_tokens": 3000, "ignore_eos": true})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	background := func() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequestWithContext(ctx, "POST", w.url+"/v1/chat/completions", bytes.NewReader(b))
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
	}
	waitFor := func(what string, cond func(scheduler.Stats) bool) {
		if !wait.Until(10*time.Second, func() bool { return cond(w.sched.Stats()) }) {
			t.Fatalf("never saw %s: %+v", what, w.sched.Stats())
		}
	}
	background()
	waitFor("one running", func(s scheduler.Stats) bool { return s.Running == 1 })
	background()
	waitFor("one queued", func(s scheduler.Stats) bool { return s.Queued == 1 })
	for range 3 {
		resp, out := post(t, w.url, "/v1/chat/completions", string(b))
		var e errBody
		json.Unmarshal(out, &e)
		if resp.StatusCode != 429 || e.Error.Code != 429 || e.Error.Type == "" || resp.Header.Get("Retry-After") == "" {
			t.Fatalf("overloaded worker answered %d (Retry-After %q): %s", resp.StatusCode, resp.Header.Get("Retry-After"), out)
		}
	}
	cancel()
	wg.Wait()
	waitIdle(t, w)
}

// waitIdle waits until no request runs and every held seq id belongs to an idle cache entry.
func waitIdle(t *testing.T, w *worker) {
	t.Helper()
	if !wait.Until(20*time.Second, func() (idle bool) {
		w.inspect(t, func(v scheduler.View) {
			idle = len(v.States) == 0 && v.Pool.InUse() == v.KV.Idle() && v.KV.Idle() == v.KV.Len()
		})
		return idle
	}) {
		t.Fatal("worker never went idle: a seq id leaked")
	}
}

func TestTimeoutGets408AndKeepsTheCells(t *testing.T) {
	w := startWorker(t, opts{sched: scheduler.Config{RequestTimeout: 300 * time.Millisecond, MaxOutputTokens: 4000}})
	resp, out := post(t, w.url, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": msgs("user", "go"), "max_tokens": 4000, "ignore_eos": true})
	var e errBody
	json.Unmarshal(out, &e)
	if resp.StatusCode != 408 || e.Error.Code != 408 || e.Error.Type != openai.TypeTimeout {
		t.Fatalf("status %d body %s", resp.StatusCode, out)
	}
	// Its seq id passed to an idle cache entry holding what it computed.
	waitIdle(t, w)
	var ids, entries int
	w.inspect(t, func(v scheduler.View) { ids, entries = v.Pool.InUse(), v.KV.Len() })
	if ids != 1 || entries != 1 {
		t.Fatalf("after a timeout: %d seq ids, %d entries; want its one idle entry", ids, entries)
	}
}

func TestVanishedClientEndsItsRequest(t *testing.T) {
	w := startWorker(t, opts{sched: scheduler.Config{MaxOutputTokens: 4000}})
	b, _ := json.Marshal(map[string]any{"model": "tiny", "messages": msgs("user", "stream forever"), "max_tokens": 4000, "ignore_eos": true, "stream": true})
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", w.url+"/v1/chat/completions", bytes.NewReader(b))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first line %q %v", line, err)
	}
	var chunk struct{ ID string }
	json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &chunk)
	held := false
	w.inspect(t, func(v scheduler.View) { _, held = v.Pool.Lookup(chunk.ID) })
	if !held {
		t.Fatalf("streaming request %q holds no seq id", chunk.ID)
	}
	cancel()
	resp.Body.Close()
	// It leaves the running set; its cells stay as an idle entry.
	waitFor(t, w, "the vanished client's request to end", func(v scheduler.View) bool {
		e, ok := v.KV.Get(chunk.ID)
		return len(v.States) == 0 && ok && !e.InUse && v.Pool.InUse() == 1
	})
	if m := scrape(t, w); !strings.Contains(m, `llmf_worker_requests_total{state="CANCELLED"} 1`) {
		t.Fatal("the request did not end CANCELLED")
	}
}

type center struct {
	mu     sync.Mutex
	hashes map[string]bool
	all    int
}

func (c *center) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var b api.CacheEvict
	if r.URL.Path != api.PathCacheEvict || json.NewDecoder(r.Body).Decode(&b) != nil {
		http.Error(w, "bad", 400)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if b.All {
		c.all++
	}
	for _, h := range b.Hashes {
		c.hashes[h] = true
	}
}

func TestEvictionUnderASmallMemoryLimitSparesRunningRequestsAndIsReported(t *testing.T) {
	mc, rep := reportingTo(t)
	// The tiny model's cells take 512 bytes per token: 1 MiB holds 2048
	// tokens and eviction starts past 1638. Each request below holds ~700.
	w := startWorker(t, opts{nSeq: 16, mc: rep, sched: scheduler.Config{MaxRunning: 3,
		KV: kvcache.Limits{MaxBytes: 1 << 20, Threshold: 0.8}, CleanupInterval: 20 * time.Millisecond}})
	var stopWatch = make(chan struct{})
	var watched sync.WaitGroup
	watched.Add(1)
	go func() {
		defer watched.Done()
		for {
			select {
			case <-stopWatch:
				return
			case <-time.After(2 * time.Millisecond):
			}
			w.inspect(t, func(v scheduler.View) {
				for id, st := range v.States {
					if st != scheduler.Processing {
						continue
					}
					if e, ok := v.KV.Get(id); !ok || !e.InUse {
						t.Errorf("running request %s lost its KV entry", id)
					}
				}
			})
		}
	}()
	var wg sync.WaitGroup
	texts := make([]string, 8)
	for i := range texts {
		texts[i] = longText(600, fmt.Sprint("conversation", i))
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := chat(t, w, msgs("user", texts[i]), map[string]any{"max_tokens": 64})
			if c.Usage.CompletionTokens != 64 {
				t.Errorf("request %d: %+v", i, c.Usage)
			}
		}()
	}
	wg.Wait()
	close(stopWatch)
	watched.Wait()
	if !strings.Contains(scrape(t, w), `llmf_worker_kv_evictions_total{cause="threshold"}`) {
		t.Fatal("no eviction metric")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := rep.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	// Every hash reported belongs to an evicted conversation, and the
	// conversations still cached have none of theirs reported.
	held := map[string]bool{}
	w.inspect(t, func(v scheduler.View) {
		if v.KV.OverThreshold() {
			t.Errorf("idle entries left above the threshold")
		}
		for _, e := range v.KV.Entries() {
			for _, h := range prefix.Wire(e.Hashes) {
				held[h] = true
			}
		}
	})
	mc.mu.Lock()
	defer mc.mu.Unlock()
	if mc.all != 1 || len(mc.hashes) == 0 {
		t.Fatalf("evict-all %d, hashes %d", mc.all, len(mc.hashes))
	}
	hasher := prefix.Hasher{}
	evicted := 0
	for i, text := range texts {
		req, _, e := openai.ParseChat([]byte(fmt.Sprintf(`{"model":"tiny","messages":[{"role":"user","content":%q}]}`, text)))
		if e != nil {
			t.Fatal(e)
		}
		ws := prefix.Wire(hasher.Sum("tiny", req.Canonical()))
		n := 0
		for _, h := range ws {
			if mc.hashes[h] {
				n++
			}
			if mc.hashes[h] && held[h] {
				t.Fatalf("conversation %d: hash %s reported evicted but still held", i, h)
			}
		}
		if n == len(ws) {
			evicted++
		} else if n != 0 {
			t.Fatalf("conversation %d: %d of %d hashes reported", i, n, len(ws))
		}
	}
	if evicted == 0 {
		t.Fatal("no conversation's hashes were reported")
	}
}

func TestModelsHealthAndUnknownRoutes(t *testing.T) {
	w := startWorker(t, opts{})
	resp, err := http.Get(w.url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var l openai.ModelList
	json.NewDecoder(resp.Body).Decode(&l)
	resp.Body.Close()
	if len(l.Data) != 1 || l.Data[0].ID != "tiny" {
		t.Fatalf("models %+v", l)
	}
	for _, path := range []string{"/healthz", "/health"} {
		resp, _ = http.Get(w.url + path)
		if resp.StatusCode != 200 {
			t.Fatalf("%s %d", path, resp.StatusCode)
		}
		resp.Body.Close()
	}
	resp, _ = http.Get(w.url + "/v1/nothing")
	var e errBody
	json.NewDecoder(resp.Body).Decode(&e)
	resp.Body.Close()
	if resp.StatusCode != 404 || e.Error.Code != 404 {
		t.Fatalf("unknown route: %d %+v", resp.StatusCode, e)
	}
}

func TestConcurrentClientsUnderRace(t *testing.T) {
	w := startWorker(t, opts{sched: scheduler.Config{MaxRunning: 4, MaxQueue: 64}})
	var wg sync.WaitGroup
	for i := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			stream := i%2 == 0
			body := map[string]any{"model": "tiny", "messages": msgs("system", "shared system prompt for all", "user", fmt.Sprint("question ", i%3)),
				"max_tokens": 8 + i, "temperature": 0.7, "seed": i, "stream": stream}
			b, _ := json.Marshal(body)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, "POST", w.url+"/v1/chat/completions", bytes.NewReader(b))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			defer resp.Body.Close()
			if i%5 == 4 {
				return // leave early: cancelled mid-flight
			}
			if resp.StatusCode != 200 {
				out, _ := io.ReadAll(resp.Body)
				t.Errorf("%d: %d %s", i, resp.StatusCode, out)
				return
			}
			if stream {
				sse(t, resp.Body)
			} else {
				io.Copy(io.Discard, resp.Body)
			}
		}()
	}
	wg.Wait()
	waitIdle(t, w)
}

// stop_token_ids end the answer with finish_reason "stop" before the token;
// the penalties reach the sampler (the output changes).
func TestStopTokenIDsAndPenaltiesOverHTTP(t *testing.T) {
	w := startWorker(t, opts{})
	m := msgs("user", "tell me a story about a fox")
	free := chat(t, w, m, nil).Choices[0].Message.Content
	// The generated model's vocabulary is bytes (token 3+b): stop at the
	// first ASCII letter of the free answer.
	i := strings.IndexFunc(free, func(r rune) bool { return r < 128 && unicode.IsLetter(r) })
	if i < 0 {
		t.Skipf("the greedy answer %q has no ASCII letter to stop at", free)
	}
	stop := 3 + int(free[i])
	stopped := chat(t, w, m, map[string]any{"stop_token_ids": []int{stop}})
	if c := stopped.Choices[0]; c.FinishReason != "stop" || c.Message.Content != free[:i] {
		t.Fatalf("stop_token_ids [%d] (%q): %q (%s), want %q (stop)", stop, free[i], c.Message.Content, c.FinishReason, free[:i])
	}
	pen := chat(t, w, m, map[string]any{"presence_penalty": 2, "frequency_penalty": 2})
	if pen.Choices[0].Message.Content == free {
		t.Fatalf("penalties 2/2 left the greedy answer unchanged: %q", pen.Choices[0].Message.Content)
	}
}

func TestQueueWaitTimeoutGets408WithTheTraceID(t *testing.T) {
	w := startWorker(t, opts{sched: scheduler.Config{MaxRunning: 1, MaxQueue: 4, QueueTimeout: 200 * time.Millisecond, MaxOutputTokens: 4000}})
	long, _ := json.Marshal(map[string]any{"model": "tiny", "messages": msgs("user", "go"), "max_tokens": 3000, "ignore_eos": true})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		req, _ := http.NewRequestWithContext(ctx, "POST", w.url+"/v1/chat/completions", bytes.NewReader(long))
		if resp, err := http.DefaultClient.Do(req); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	if !wait.Until(10*time.Second, func() bool { return w.sched.Stats().Running == 1 }) {
		t.Fatal("the long request never ran")
	}
	for _, stream := range []bool{false, true} {
		b, _ := json.Marshal(map[string]any{"model": "tiny", "messages": msgs("user", "queued"), "max_tokens": 2, "stream": stream})
		req, _ := http.NewRequest("POST", w.url+"/v1/chat/completions", bytes.NewReader(b))
		req.Header.Set(headers.RequestID, "trace-queued")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		out, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var e struct {
			errBody
			TraceID string `json:"trace_id"`
		}
		json.Unmarshal(out, &e)
		// Nothing was streamed before the timeout, so a stream gets the
		// real status too, as the gateway needs to see a failure before
		// the first token.
		if resp.StatusCode != 408 || e.Error.Code != 408 || e.Error.Type != openai.TypeTimeout ||
			!strings.Contains(e.Error.Message, "queue") || e.TraceID != "trace-queued" {
			t.Fatalf("stream=%v: status %d body %s", stream, resp.StatusCode, out)
		}
	}
	// The loop updates the gauge right after it answered the requests.
	var m string
	if !wait.Until(5*time.Second, func() bool {
		m = scrape(t, w)
		return strings.Contains(m, `llmf_worker_requests_total{state="TIMEOUT"} 2`) && strings.Contains(m, "llmf_worker_queue_depth 0")
	}) {
		t.Fatalf("metrics after two queue timeouts:\n%s", m)
	}
	cancel()
	<-done
	waitIdle(t, w)
}

// reportingTo starts an eviction reporter that reports to a fake metadata
// center, which records what it is told; both stop with the test.
func reportingTo(t *testing.T) (*center, *mcreport.Reporter) {
	t.Helper()
	mc := &center{hashes: map[string]bool{}}
	mcs := httptest.NewServer(mc)
	t.Cleanup(mcs.Close)
	rep, err := mcreport.New(mcreport.Config{URL: mcs.URL, Cluster: "c", Host: "127.0.0.1:1"})
	if err != nil {
		t.Fatal(err)
	}
	rctx, rcancel := context.WithCancel(context.Background())
	t.Cleanup(rcancel)
	go rep.Run(rctx)
	return mc, rep
}
