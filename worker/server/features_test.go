package server

import (
	"bytes"
	"encoding/json"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

// promptTokens reads llmf_worker_prompt_tokens_total{source=...}.
func promptTokens(t *testing.T, w *worker, source string) int {
	t.Helper()
	m := regexp.MustCompile(`llmf_worker_prompt_tokens_total\{source="` + source + `"\} (\S+)`).FindStringSubmatch(scrape(t, w))
	if m == nil {
		return 0
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		t.Fatal(err)
	}
	return int(v)
}

type featureChoice struct {
	Index   int `json:"index"`
	Message struct {
		Content string `json:"content"`
	} `json:"message"`
	Text         string `json:"text"`
	FinishReason string `json:"finish_reason"`
	Logprobs     *struct {
		Content []struct {
			Token       string  `json:"token"`
			Logprob     float64 `json:"logprob"`
			Bytes       []int   `json:"bytes"`
			TopLogprobs []struct {
				Token   string  `json:"token"`
				Logprob float64 `json:"logprob"`
			} `json:"top_logprobs"`
		} `json:"content"`
		Tokens        []string             `json:"tokens"`
		TokenLogprobs []float64            `json:"token_logprobs"`
		TopLogprobs   []map[string]float64 `json:"top_logprobs"`
		TextOffset    []int                `json:"text_offset"`
	} `json:"logprobs"`
}

type featureResp struct {
	Choices []featureChoice `json:"choices"`
	Usage   struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

func postOK(t *testing.T, w *worker, path string, body map[string]any) featureResp {
	t.Helper()
	resp, out := post(t, w.url, path, body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, out)
	}
	var r featureResp
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatal(err)
	}
	return r
}

// n choices compute the prompt once: the worker's computed prompt tokens
// grow by one prompt, the cached ones by the n-1 copies.
func TestNChoicesSharePrefill(t *testing.T) {
	w := startWorker(t, opts{})
	m := msgs("user", longText(1500, "shared"))
	r := postOK(t, w, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": m, "n": 4, "max_tokens": 8,
		"ignore_eos": true, "temperature": 1, "seed": 5})
	if len(r.Choices) != 4 {
		t.Fatalf("%d choices", len(r.Choices))
	}
	distinct := map[string]bool{}
	for i, c := range r.Choices {
		if c.Index != i || c.FinishReason != "length" || c.Message.Content == "" {
			t.Fatalf("choice %d: %+v", i, c)
		}
		distinct[c.Message.Content] = true
	}
	if len(distinct) < 2 {
		t.Fatalf("4 choices with seeds 5..8 all wrote %q", r.Choices[0].Message.Content)
	}
	p := r.Usage.PromptTokens
	if r.Usage.CompletionTokens != 32 || p < 1500 {
		t.Fatalf("usage %+v", r.Usage)
	}
	computed, cached := promptTokens(t, w, "computed"), promptTokens(t, w, "cached")
	if computed > p+p/10 || cached < 3*p-p/10 {
		t.Fatalf("prompt of %d tokens, 4 choices: %d computed, %d cached; want about %d and %d", p, computed, cached, p, 3*p)
	}
	// The same seed gives the same choices.
	again := postOK(t, w, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": m, "n": 4, "max_tokens": 8,
		"ignore_eos": true, "temperature": 1, "seed": 5})
	for i := range again.Choices {
		if again.Choices[i].Message.Content != r.Choices[i].Message.Content {
			t.Fatalf("seed 5, choice %d: %q then %q", i, r.Choices[i].Message.Content, again.Choices[i].Message.Content)
		}
	}
}

func TestNChoicesStreamWithTheirIndex(t *testing.T) {
	w := startWorker(t, opts{})
	body, _ := json.Marshal(map[string]any{"model": "tiny", "messages": msgs("user", "hello"), "n": 3, "max_tokens": 6,
		"ignore_eos": true, "temperature": 1, "seed": 1, "stream": true, "stream_options": map[string]any{"include_usage": true}})
	resp, err := http.Post(w.url+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	texts := make([]string, 3)
	finished := make([]bool, 3)
	var usage struct {
		CompletionTokens int `json:"completion_tokens"`
	}
	for _, ev := range sse(t, resp.Body) {
		if ev == "[DONE]" {
			break
		}
		var c struct {
			Choices []struct {
				Index int `json:"index"`
				Delta struct {
					Content *string `json:"content"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
			Usage *struct {
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal([]byte(ev), &c); err != nil {
			t.Fatal(err)
		}
		if c.Usage != nil {
			usage.CompletionTokens = c.Usage.CompletionTokens
		}
		for _, ch := range c.Choices {
			if finished[ch.Index] {
				t.Fatalf("choice %d: a chunk after its finish: %s", ch.Index, ev)
			}
			if ch.Delta.Content != nil {
				texts[ch.Index] += *ch.Delta.Content
			}
			if ch.FinishReason != nil {
				finished[ch.Index] = true
			}
		}
	}
	whole := postOK(t, w, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": msgs("user", "hello"), "n": 3, "max_tokens": 6,
		"ignore_eos": true, "temperature": 1, "seed": 1})
	for i := range texts {
		if !finished[i] || texts[i] != whole.Choices[i].Message.Content {
			t.Fatalf("choice %d streamed %q (finished %v), whole %q", i, texts[i], finished[i], whole.Choices[i].Message.Content)
		}
	}
	if usage.CompletionTokens != 18 {
		t.Fatalf("usage counts %d completion tokens, want 18", usage.CompletionTokens)
	}
}

func TestLogprobsOverHTTP(t *testing.T) {
	w := startWorker(t, opts{})
	r := postOK(t, w, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": msgs("user", "hi"), "max_tokens": 8,
		"ignore_eos": true, "temperature": 0, "logprobs": true, "top_logprobs": 3})
	c := r.Choices[0]
	if c.Logprobs == nil || len(c.Logprobs.Content) != 8 {
		t.Fatalf("logprobs %+v", c.Logprobs)
	}
	var joined []byte
	for i, tl := range c.Logprobs.Content {
		if tl.Logprob > 0 || len(tl.TopLogprobs) != 3 || tl.TopLogprobs[0].Logprob != tl.Logprob {
			t.Fatalf("token %d: %+v (greedy: the token is the most likely)", i, tl)
		}
		for _, b := range tl.Bytes {
			joined = append(joined, byte(b))
		}
	}
	// The content shows each byte that is not UTF-8 as U+FFFD.
	if string([]rune(string(joined))) != c.Message.Content {
		t.Fatalf("the tokens' bytes %q are not the content %q", joined, c.Message.Content)
	}
	// Without logprobs the field is null.
	if r := postOK(t, w, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": msgs("user", "hi"), "max_tokens": 2}); r.Choices[0].Logprobs != nil {
		t.Fatalf("logprobs without asking: %+v", r.Choices[0].Logprobs)
	}
	// Completions: the legacy form.
	r = postOK(t, w, "/v1/completions", map[string]any{"model": "tiny", "prompt": "once", "max_tokens": 5, "ignore_eos": true, "temperature": 0, "logprobs": 2})
	l := r.Choices[0].Logprobs
	if l == nil || len(l.Tokens) != 5 || len(l.TokenLogprobs) != 5 || len(l.TopLogprobs) != 5 || len(l.TextOffset) != 5 {
		t.Fatalf("legacy logprobs %+v", l)
	}
	for i := range l.Tokens {
		if l.TokenLogprobs[i] > 0 || len(l.TopLogprobs[i]) == 0 || len(l.TopLogprobs[i]) > 2 {
			t.Fatalf("legacy token %d: %q %v %v", i, l.Tokens[i], l.TokenLogprobs[i], l.TopLogprobs[i])
		}
	}
}

func TestResponseFormatGivesJSON(t *testing.T) {
	w := startWorker(t, opts{})
	schema := map[string]any{"type": "object", "properties": map[string]any{
		"city": map[string]any{"type": "string", "enum": []string{"Paris", "Oslo"}}, "rain": map[string]any{"type": "boolean"},
		"days": map[string]any{"type": "integer"}}, "required": []string{"city", "rain", "days"}, "additionalProperties": false}
	for seed := range 3 {
		r := postOK(t, w, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": msgs("user", "weather?"), "max_tokens": 200,
			"seed": seed, "response_format": map[string]any{"type": "json_schema", "json_schema": map[string]any{"name": "w", "schema": schema}}})
		out := r.Choices[0].Message.Content
		var v struct {
			City *string `json:"city"`
			Rain *bool   `json:"rain"`
			Days *int64  `json:"days"`
		}
		dec := json.NewDecoder(strings.NewReader(out))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&v); err != nil || v.City == nil || (*v.City != "Paris" && *v.City != "Oslo") || v.Rain == nil || v.Days == nil {
			t.Fatalf("seed %d: %q does not validate against the schema: %v", seed, out, err)
		}
		if r.Choices[0].FinishReason != "stop" {
			t.Fatalf("seed %d: finish %q", seed, r.Choices[0].FinishReason)
		}
	}
	resp, out := post(t, w.url, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": msgs("user", "x"),
		"response_format": map[string]any{"type": "json_schema", "json_schema": map[string]any{"name": "w", "schema": map[string]any{"type": "object", "properties": 7}}}})
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(out), "response_format") {
		t.Fatalf("a schema llama.cpp cannot compile: %d %s", resp.StatusCode, out)
	}
}

const cityTool = `{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
	"parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"], "additionalProperties": false}}}`

type toolResp struct {
	Choices []struct {
		Message struct {
			Content   *string `json:"content"`
			ToolCalls []struct {
				ID       string `json:"id"`
				Type     string `json:"type"`
				Function struct {
					Name      string `json:"name"`
					Arguments string `json:"arguments"`
				} `json:"function"`
			} `json:"tool_calls"`
		} `json:"message"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
}

// With tool_choice required or named, the grammar makes even the
// random-weights model answer with a valid call, parsed into tool_calls.
func TestToolChoiceRequiredGivesACall(t *testing.T) {
	w := startWorker(t, opts{model: testmodel.ToolsPath(t)})
	var tool map[string]any
	if err := json.Unmarshal([]byte(cityTool), &tool); err != nil {
		t.Fatal(err)
	}
	for _, choice := range []any{"required", map[string]any{"type": "function", "function": map[string]any{"name": "get_weather"}}} {
		for seed := range 2 {
			resp, out := post(t, w.url, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": msgs("user", "Weather in Paris?"),
				"tools": []any{tool}, "tool_choice": choice, "seed": seed, "max_tokens": 100})
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, out)
			}
			var r toolResp
			if err := json.Unmarshal(out, &r); err != nil {
				t.Fatal(err)
			}
			c := r.Choices[0]
			if c.FinishReason != "tool_calls" || len(c.Message.ToolCalls) != 1 || c.Message.Content != nil {
				t.Fatalf("tool_choice %v seed %d: %s", choice, seed, out)
			}
			call := c.Message.ToolCalls[0]
			var args struct {
				City string `json:"city"`
			}
			if err := json.Unmarshal([]byte(call.Function.Arguments), &args); err != nil || call.Function.Name != "get_weather" ||
				(args.City != "Paris" && args.City != "Oslo") || call.Type != "function" || !strings.HasPrefix(call.ID, "call_") {
				t.Fatalf("tool_choice %v seed %d: call %+v (%v)", choice, seed, call, err)
			}
		}
	}
	// A template that never reads tools cannot offer them to the model.
	plain := startWorker(t, opts{})
	resp, out := post(t, plain.url, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": msgs("user", "x"), "tools": []any{tool}})
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(out), "does not render tools") {
		t.Fatalf("tools on a template without them: %d %s", resp.StatusCode, out)
	}
	// tool_choice none: no call, and the tools stay out of the prompt.
	r := postOK(t, plain, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": msgs("user", "x"), "tools": []any{tool},
		"tool_choice": "none", "max_tokens": 4, "ignore_eos": true})
	if r.Choices[0].FinishReason != "length" {
		t.Fatalf("tool_choice none: %+v", r.Choices[0])
	}
}

func TestToolCallsStream(t *testing.T) {
	w := startWorker(t, opts{model: testmodel.ToolsPath(t)})
	var tool map[string]any
	json.Unmarshal([]byte(cityTool), &tool)
	body, _ := json.Marshal(map[string]any{"model": "tiny", "messages": msgs("user", "Weather in Oslo?"), "tools": []any{tool},
		"tool_choice": "required", "seed": 3, "max_tokens": 100, "stream": true})
	resp, err := http.Post(w.url+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var calls []map[string]any
	finish := ""
	for _, ev := range sse(t, resp.Body) {
		if ev == "[DONE]" {
			break
		}
		var c struct {
			Choices []struct {
				Delta struct {
					Content   *string          `json:"content"`
					ToolCalls []map[string]any `json:"tool_calls"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(ev), &c); err != nil {
			t.Fatal(err)
		}
		for _, ch := range c.Choices {
			if ch.Delta.Content != nil && *ch.Delta.Content != "" {
				t.Fatalf("content streamed beside a required call: %s", ev)
			}
			calls = append(calls, ch.Delta.ToolCalls...)
			if ch.FinishReason != nil {
				finish = *ch.FinishReason
			}
		}
	}
	if finish != "tool_calls" || len(calls) != 1 {
		t.Fatalf("finish %q, calls %v", finish, calls)
	}
	fn, _ := calls[0]["function"].(map[string]any)
	var args map[string]string
	if fn == nil || fn["name"] != "get_weather" || json.Unmarshal([]byte(fn["arguments"].(string)), &args) != nil || calls[0]["index"] != 0.0 {
		t.Fatalf("streamed call %v", calls[0])
	}
}

// Streamed logprobs ride on the content chunks: one entry per token, and
// the completions endpoint serves n choices too.
func TestStreamedLogprobsAndCompletionChoices(t *testing.T) {
	w := startWorker(t, opts{})
	body, _ := json.Marshal(map[string]any{"model": "tiny", "messages": msgs("user", "hi"), "max_tokens": 7, "ignore_eos": true,
		"temperature": 0, "logprobs": true, "stream": true})
	resp, err := http.Post(w.url+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	entries := 0
	for _, ev := range sse(t, resp.Body) {
		var c struct {
			Choices []struct {
				Logprobs *struct {
					Content []struct {
						Logprob float64 `json:"logprob"`
					} `json:"content"`
				} `json:"logprobs"`
			} `json:"choices"`
		}
		json.Unmarshal([]byte(ev), &c)
		for _, ch := range c.Choices {
			if ch.Logprobs != nil {
				for _, e := range ch.Logprobs.Content {
					if e.Logprob > 0 {
						t.Fatalf("logprob %v in %s", e.Logprob, ev)
					}
					entries++
				}
			}
		}
	}
	if entries != 7 {
		t.Fatalf("%d logprob entries streamed for 7 tokens", entries)
	}
	r := postOK(t, w, "/v1/completions", map[string]any{"model": "tiny", "prompt": "once upon", "n": 2, "max_tokens": 5,
		"ignore_eos": true, "seed": 9})
	if len(r.Choices) != 2 || r.Choices[1].Index != 1 || r.Choices[0].Text == "" || r.Usage.CompletionTokens != 10 {
		t.Fatalf("completion choices %+v usage %+v", r.Choices, r.Usage)
	}
}
