package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
	"github.com/istio-llm-filter/istio-llm-filter/worker/scheduler"
)

// A request that ends early keeps the cells it computed as an idle cache
// entry, as a finished one does: the client that retries it (an agent
// after its own timeout, a user pressing regenerate) finds its prompt
// cached. One test per way a request can end early; each retries the same
// conversation after the first has left the running set and checks
// usage.prompt_tokens_details.cached_tokens.

// history is a conversation of about 2,200 prompt tokens.
func history(salt string) []map[string]string {
	return msgs("system", "You are a helpful assistant.", "user", longText(2000, salt), "assistant", "Noted.", "user", "Go on.")
}

// abortWorker serves the tests below: room for the history and a long answer.
func abortWorker(t *testing.T, cfg scheduler.Config) *worker {
	cfg.MaxOutputTokens = 4000
	return startWorker(t, opts{nCtx: 8192, sched: cfg})
}

// openStream starts a streamed chat request the caller cancels.
func openStream(t *testing.T, w *worker, m []map[string]string, maxTokens int) (*http.Response, context.CancelFunc) {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"model": "tiny", "messages": m, "temperature": 0, "max_tokens": maxTokens, "ignore_eos": true, "stream": true})
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", w.url+"/v1/chat/completions", bytes.NewReader(b))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if resp.StatusCode != 200 {
		out, _ := io.ReadAll(resp.Body)
		cancel()
		t.Fatalf("stream: status %d: %s", resp.StatusCode, out)
	}
	return resp, cancel
}

// firstChunk reads the stream's first data line.
func firstChunk(t *testing.T, resp *http.Response) {
	t.Helper()
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first line %q %v", line, err)
	}
}

// waitFor polls the loop's books until cond holds, for at most 20 s.
func waitFor(t *testing.T, w *worker, what string, cond func(scheduler.View) bool) {
	t.Helper()
	wait.For(t, 20*time.Second, what, func() (ok bool) {
		w.inspect(t, func(v scheduler.View) { ok = cond(v) })
		return ok
	})
}

func nothingRuns(v scheduler.View) bool { return len(v.States) == 0 }

// retryIsCached sends m again and checks that at least 95% of its prompt
// was served from the cache.
func retryIsCached(t *testing.T, w *worker, m []map[string]string, how string) {
	t.Helper()
	c := chat(t, w, m, map[string]any{"max_tokens": 4})
	u := c.Usage
	if u.PromptTokensDetails == nil || u.PromptTokens < 2000 {
		t.Fatalf("%s: retry usage %+v", how, u)
	}
	cached := u.PromptTokensDetails.CachedTokens
	t.Logf("%s: the retry had %d of %d prompt tokens cached", how, cached, u.PromptTokens)
	if 100*cached < 95*u.PromptTokens {
		t.Fatalf("%s: the retry had %d of %d prompt tokens cached, want at least 95%%", how, cached, u.PromptTokens)
	}
}

func TestRetryAfterClientLeftAfterTheFirstTokenIsCached(t *testing.T) {
	w := abortWorker(t, scheduler.Config{})
	m := history("left after the first token")
	resp, cancel := openStream(t, w, m, 3000)
	firstChunk(t, resp)
	cancel()
	resp.Body.Close()
	waitFor(t, w, "the cancelled request to leave", nothingRuns)
	retryIsCached(t, w, m, "client left after the first token")
	if !strings.Contains(scrape(t, w), `llmf_worker_requests_total{state="CANCELLED"} 1`) {
		t.Fatal("the first request did not end CANCELLED")
	}
}

func TestRetryAfterClientLeftDuringPrefillIsCached(t *testing.T) {
	w := abortWorker(t, scheduler.Config{})
	m := history("left during prefill")
	resp, cancel := openStream(t, w, m, 3000)
	defer resp.Body.Close()
	// The response headers come before the first token; wait until part of
	// the prompt is in the cache, and leave.
	waitFor(t, w, "the prefill to start", func(v scheduler.View) bool {
		for _, e := range v.KV.Entries() {
			if e.InUse && len(e.Tokens) > 0 {
				return true
			}
		}
		return false
	})
	cancel()
	waitFor(t, w, "the cancelled request to leave", nothingRuns)
	retryIsCached(t, w, m, "client left during prefill")
}

func TestRetryAfterRequestTimeoutIsCached(t *testing.T) {
	w := abortWorker(t, scheduler.Config{RequestTimeout: 500 * time.Millisecond})
	m := history("timed out")
	resp, out := post(t, w.url, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": m, "max_tokens": 3000, "ignore_eos": true})
	if resp.StatusCode != 408 {
		t.Fatalf("status %d: %s", resp.StatusCode, out)
	}
	waitFor(t, w, "the timed-out request to leave", nothingRuns)
	// The timeout may strike before the prefill ends (on a busy machine it
	// does): the retry must find what the request computed, and all of the
	// prompt when it computed all of it. A retry is held to the same
	// timeout, so on a slow moment it may time out too, having computed
	// more: it must keep that as well, and the next retry find it.
	kept := func() (n int) {
		w.inspect(t, func(v scheduler.View) {
			for _, e := range v.KV.Entries() {
				n = max(n, len(e.Tokens))
			}
		})
		return n
	}
	before := kept()
	if before == 0 {
		t.Fatal("the timed-out request left nothing cached")
	}
	for attempt := 1; ; attempt++ {
		resp, out := post(t, w.url, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": m, "temperature": 0, "max_tokens": 4, "ignore_eos": true})
		if resp.StatusCode == 408 && attempt < 5 {
			waitFor(t, w, "the timed-out retry to leave", nothingRuns)
			after := kept()
			t.Logf("retry %d timed out too; cached %d → %d cells", attempt, before, after)
			if after < before {
				t.Fatalf("a timed-out retry left %d cells cached, fewer than the %d it found", after, before)
			}
			before = after
			continue
		}
		if resp.StatusCode != 200 {
			t.Fatalf("retry %d: status %d: %s", attempt, resp.StatusCode, out)
		}
		var c chatResp
		if err := json.Unmarshal(out, &c); err != nil {
			t.Fatal(err)
		}
		u := c.Usage
		if u.PromptTokensDetails == nil {
			t.Fatalf("retry usage %+v", u)
		}
		want := min(before, u.PromptTokens)
		t.Logf("request timeout: %d cells kept before retry %d, which had %d of %d prompt tokens cached", before, attempt, u.PromptTokensDetails.CachedTokens, u.PromptTokens)
		if 100*u.PromptTokensDetails.CachedTokens < 95*want {
			t.Fatalf("the retry had %d of %d prompt tokens cached, want at least 95%% of the %d computed before it", u.PromptTokensDetails.CachedTokens, u.PromptTokens, want)
		}
		return
	}
}

// A request that times out in the queue never computed anything; it must
// not take the cells of the identical request running ahead of it, nor
// report its prompt evicted while they are held.
func TestRetryAfterQueueTimeoutIsCached(t *testing.T) {
	mc, rep := reportingTo(t)
	w := startWorker(t, opts{nCtx: 8192, mc: rep, sched: scheduler.Config{MaxRunning: 1, MaxOutputTokens: 4000, QueueTimeout: 200 * time.Millisecond}})
	m := history("queue timeout")
	resp, cancel := openStream(t, w, m, 3000)
	firstChunk(t, resp)
	r2, out := post(t, w.url, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": m, "max_tokens": 4})
	var e errBody
	json.Unmarshal(out, &e)
	if r2.StatusCode != 408 || e.Error.Type != openai.TypeTimeout {
		t.Fatalf("queued request: status %d: %s", r2.StatusCode, out)
	}
	cancel()
	resp.Body.Close()
	waitFor(t, w, "the running request to leave", nothingRuns)
	retryIsCached(t, w, m, "queue timeout")
	ctx, done := context.WithTimeout(context.Background(), 10*time.Second)
	defer done()
	if err := rep.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	req, _, pe := openai.ParseChat(mustJSON(t, map[string]any{"model": "tiny", "messages": m}))
	if pe != nil {
		t.Fatal(pe)
	}
	mc.mu.Lock()
	defer mc.mu.Unlock()
	for _, h := range prefix.Wire(prefix.Hasher{}.Sum("tiny", req.Canonical())) {
		if mc.hashes[h] {
			t.Fatalf("hash %s of the cached conversation was reported evicted", h)
		}
	}
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
