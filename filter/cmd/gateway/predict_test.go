package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// metric reads one sample of the gateway's /metrics: the value of the
// first line starting with series (name and labels), -1 when absent.
func metric(t *testing.T, base, series string) float64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("%s: %v", series, err)
			}
			return f
		}
	}
	return -1
}

// Every routed answer states the TTFT the gateway predicted for its pod
// (headers.PredictedTTFT) and the share of the prompt it believed cached
// there (headers.PredictedCachedShare); each first token checks a prediction
// (llm_filter_balancer_ttft_prediction_error counts it), each answer's
// usage checks the belief (llm_filter_balancer_cache_belief_error), and its
// usage.prompt_tokens, streamed or not, moves the model's learnt bytes per
// token from 1 towards the worker's real ratio (canonical prompt bytes over
// the tokens the worker counted). Real gateway, metadata center and worker
// (simulated engine).
func TestPredictionIsStatedCheckedAndLearnsBytesPerToken(t *testing.T) {
	gin.SetMode(gin.ReleaseMode)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	mc := httptest.NewServer(server.New(memstore.New(memstore.Options{}), server.Options{Logger: quiet}).Handler())
	defer mc.Close()
	const cluster, chunk = "tiny-pool", 64
	pod, _ := reportingSimWorker(t, mc.URL, cluster, chunk)
	base := startGateway(t, fmt.Sprintf(`
listen: 127.0.0.1:0
log_level: error
filter:
  metadata_center: {address: %s, query_timeout: 1s}
  prompt_hash: {chunk_size: %d}
  model_mapping_rule:
    qwen:
      - cluster: %s
        backend: llamacpp
  lb_mapping_rule:
    default: {policy: cache_aware}
  endpoints:
    static: {%s: [%s]}
`, mc.URL, chunk, cluster, cluster, pod.Listener.Addr().String()))

	if v := metric(t, base, `llm_filter_balancer_ttft_prediction_error_count`); v > 0 {
		t.Fatalf("%v predictions checked before any request", v)
	}
	const n = 6
	lo, hi := 1e9, 0.0 // the worker's real bytes per token, per request
	for i := range n {
		system := strings.Repeat("You are a patient guide to the rivers of Europe. ", 4+i)
		user := fmt.Sprintf("Question %d: which river is the longest?", i)
		canon := prefix.CanonicalChat([]prefix.Message{
			{Role: "system", Parts: []prefix.Part{{Type: "text", Text: system}}},
			{Role: "user", Parts: []prefix.Part{{Type: "text", Text: user}}},
		})
		stream := i%2 == 1
		req := map[string]any{"model": "qwen", "stream": stream, "max_tokens": 4, "ignore_eos": true,
			"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": user}}}
		if stream {
			req["stream_options"] = map[string]any{"include_usage": true}
		}
		b, _ := json.Marshal(req)
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(string(b)))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
		if ms, err := strconv.ParseFloat(resp.Header.Get(headers.PredictedTTFT), 64); err != nil || ms <= 0 {
			t.Fatalf("request %d: %s = %q, want a positive number of milliseconds", i, headers.PredictedTTFT, resp.Header.Get(headers.PredictedTTFT))
		}
		// Each system prompt is new to the pod, but the previous one's
		// first blocks are alike: a share, never more than the prompt.
		if share, err := strconv.ParseFloat(resp.Header.Get(headers.PredictedCachedShare), 64); err != nil || share < 0 || share > 1 ||
			i == 0 && share != 0 {
			t.Fatalf("request %d: %s = %q, want a share of the prompt (0 for the first)", i, headers.PredictedCachedShare,
				resp.Header.Get(headers.PredictedCachedShare))
		}
		tokens := promptTokens(t, body, stream)
		r := float64(len(canon)) / float64(tokens)
		lo, hi = min(lo, r), max(hi, r)
	}
	if lo == 1 && hi == 1 {
		t.Fatal("the worker's ratio is 1: the test would not see the gateway learn it")
	}
	wait.For(t, 5*time.Second, "every first token to check its prediction, every usage the cache belief", func() bool {
		return metric(t, base, `llm_filter_balancer_ttft_prediction_error_count`) == n &&
			metric(t, base, `llm_filter_balancer_cache_belief_error_count`) == n
	})
	// The learnt ratio is a weighted mean of the requests' ratios.
	got := metric(t, base, `llm_filter_balancer_bytes_per_token{model_name="qwen"}`)
	if got < lo-1e-9 || got > hi+1e-9 {
		t.Fatalf("learnt bytes per token %v, want within the requests' ratios [%v, %v]", got, lo, hi)
	}
}

// promptTokens reads usage.prompt_tokens of a JSON answer or of a stream's
// usage chunk.
func promptTokens(t *testing.T, body []byte, stream bool) int {
	t.Helper()
	var u struct {
		Usage *struct {
			PromptTokens int `json:"prompt_tokens"`
		} `json:"usage"`
	}
	if !stream {
		if err := json.Unmarshal(body, &u); err != nil || u.Usage == nil {
			t.Fatalf("no usage in %s", body)
		}
		return u.Usage.PromptTokens
	}
	for _, line := range strings.Split(string(body), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		if json.Unmarshal([]byte(data), &u) == nil && u.Usage != nil && u.Usage.PromptTokens > 0 {
			return u.Usage.PromptTokens
		}
	}
	t.Fatalf("no usage chunk in %s", body)
	return 0
}
