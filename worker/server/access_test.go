package server

import (
	"bufio"
	"bytes"
	"encoding/json"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
)

type lockedBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuf) lines(msg string) []map[string]any {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(l.b.Bytes()))
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) == nil && m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

// Every request leaves one access line with the gateway's trace id and
// what it cost: prompt, cached and completion tokens, queue wait, TTFT —
// here from real llama.cpp compute, the second request reusing the first
// one's KV cache.
func TestAccessLinePerRequest(t *testing.T) {
	var buf lockedBuf
	w := startWorker(t, opts{logger: slog.New(slog.NewJSONHandler(&buf, nil))})
	body := map[string]any{"model": "tiny", "max_tokens": 3, "messages": []any{
		map[string]any{"role": "user", "content": strings.Repeat("a shared prefix for the cache ", 20)}}}
	for i, trace := range []string{"trace-one", "trace-two"} {
		b, _ := json.Marshal(body)
		req, _ := http.NewRequest("POST", w.url+"/v1/chat/completions", bytes.NewReader(b))
		req.Header.Set("content-type", "application/json")
		req.Header.Set("x-request-id", trace)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d", i, resp.StatusCode)
		}
	}
	lines := buf.lines("access")
	if len(lines) != 2 {
		t.Fatalf("%d access lines, want 2: %v", len(lines), lines)
	}
	for i, l := range lines {
		if l["trace_id"] != []string{"trace-one", "trace-two"}[i] || l["status"] != float64(200) || l["state"] != "COMPLETED" ||
			l["completion_tokens"].(float64) > 3 || !strings.HasPrefix(l["id"].(string), "chatcmpl-") {
			t.Fatalf("line %d: %v", i, l)
		}
		for _, k := range []string{"prompt_tokens", "cached_tokens", "queue_wait_ms", "ttft_ms", "duration_ms"} {
			if _, ok := l[k].(float64); !ok {
				t.Fatalf("line %d lacks %s: %v", i, k, l)
			}
		}
		if l["prompt_tokens"].(float64) < 20 {
			t.Fatalf("line %d: prompt_tokens %v", i, l["prompt_tokens"])
		}
	}
	if lines[0]["cached_tokens"] != float64(0) || lines[1]["cached_tokens"].(float64) <= 0 {
		t.Fatalf("cached tokens %v then %v: the second request should reuse the first one's cache", lines[0]["cached_tokens"], lines[1]["cached_tokens"])
	}
}
