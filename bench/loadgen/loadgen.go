// Package loadgen replays workload sessions against an OpenAI-compatible
// endpoint and records what each request observed.
//
// It speaks the wire protocol itself (streamed chat completions with
// stream_options.include_usage) rather than through an SDK, so that TTFT is
// the arrival of the first chunk that carries generated text, measured on the
// socket, not after an SDK's buffering.
package loadgen

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/report"
	"github.com/istio-llm-filter/istio-llm-filter/bench/workload"
	"github.com/istio-llm-filter/istio-llm-filter/filter/llmfilter"
)

// Options controls one replay.
type Options struct {
	BaseURL string // e.g. http://127.0.0.1:8000
	// BaseURLs, if set, replaces BaseURL: requests go to them in turn
	// (client-side round robin over several gateways, per request, so one
	// conversation's turns meet different gateways).
	BaseURLs  []string
	Model     string
	MaxTokens int // output length (ignore_eos) of turns that set none, so policies compare on equal work

	// Arrival: Concurrency > 0 runs that many sessions at a time; otherwise
	// sessions start as a Poisson process of Rate sessions per second.
	Concurrency int
	Rate        float64
	Seed        uint64

	Timeout  time.Duration // per request
	Client   *http.Client
	Progress func(done, total int) // called after every request, may be nil

	// Plan, if set, maps session groups to worker addresses (ip:port): a
	// planned session's requests go straight to its worker, past the
	// gateways, so that a fixed placement can be measured beside the
	// policies (bench --plan).
	Plan map[string]string

	next *atomic.Uint64 // round-robin position over BaseURLs
}

// Run replays sessions and returns one result per request (turn).
func Run(ctx context.Context, sessions []workload.Session, o Options) []report.Result {
	if o.Client == nil {
		o.Client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}}
	}
	if o.Timeout == 0 {
		o.Timeout = 2 * time.Minute
	}
	if len(o.BaseURLs) == 0 {
		o.BaseURLs = []string{o.BaseURL}
	}
	o.next = new(atomic.Uint64)
	total := 0
	for _, s := range sessions {
		total += len(s.Turns)
	}
	var (
		mu      sync.Mutex
		results = make([]report.Result, 0, total)
		done    atomic.Int64
		wg      sync.WaitGroup
		start   = time.Now()
	)
	record := func(r report.Result) {
		mu.Lock()
		results = append(results, r)
		mu.Unlock()
		if o.Progress != nil {
			o.Progress(int(done.Add(1)), total)
		}
	}
	runSession := func(s workload.Session) {
		defer wg.Done()
		worker, planned := o.Plan[s.Group]
		history := []message{}
		if s.System != "" {
			history = append(history, message{Role: "system", Content: s.System})
		}
		for i, turn := range s.Turns {
			if ctx.Err() != nil {
				return
			}
			if turn.Think > 0 { // the user reads the answer and types
				select {
				case <-time.After(turn.Think):
				case <-ctx.Done():
					return
				}
			}
			history = append(history, message{Role: "user", Content: turn.User})
			base := "http://" + worker
			if !planned {
				base = o.BaseURLs[(o.next.Add(1)-1)%uint64(len(o.BaseURLs))]
			}
			maxTokens := o.MaxTokens
			if turn.MaxTokens > 0 {
				maxTokens = turn.MaxTokens
			}
			r, answer := o.do(ctx, base, history, maxTokens, start)
			if planned {
				r.Worker = worker
			}
			r.Session, r.Turn = s.ID, i
			record(r)
			if !r.OK() {
				return // a conversation cannot go on without its answer
			}
			history = append(history, message{Role: "assistant", Content: answer})
		}
	}
	if o.Concurrency > 0 {
		sem := make(chan struct{}, o.Concurrency)
		for _, s := range sessions {
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
			}
			if ctx.Err() != nil {
				break
			}
			wg.Add(1)
			go func() { defer func() { <-sem }(); runSession(s) }()
		}
	} else {
		rng := rand.New(rand.NewPCG(o.Seed, 7))
		next := time.Now()
		for _, s := range sessions {
			next = next.Add(time.Duration(rng.ExpFloat64() / o.Rate * float64(time.Second)))
			select {
			case <-time.After(time.Until(next)):
			case <-ctx.Done():
			}
			if ctx.Err() != nil {
				break
			}
			wg.Add(1)
			go runSession(s)
		}
	}
	wg.Wait()
	return results
}

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type chunk struct {
	Choices []struct {
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

// do sends one streamed chat completion to base and returns its result and
// the generated text.
func (o Options) do(ctx context.Context, base string, msgs []message, maxTokens int, runStart time.Time) (report.Result, string) {
	body, _ := json.Marshal(map[string]any{
		"model":          o.Model,
		"messages":       msgs,
		"stream":         true,
		"stream_options": map[string]any{"include_usage": true},
		"max_tokens":     maxTokens,
		"min_tokens":     maxTokens,
		"ignore_eos":     true,
		"temperature":    0,
	})
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	t0 := time.Now()
	r := report.Result{Start: t0.Sub(runStart)}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(base, "/")+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		r.Err = err.Error()
		return r, ""
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := o.Client.Do(req)
	if err != nil {
		r.Err, r.Latency = err.Error(), time.Since(t0)
		return r, ""
	}
	defer resp.Body.Close()
	r.Status = resp.StatusCode
	r.Worker = resp.Header.Get(llmfilter.UpstreamHostHeader)
	r.PredictedTTFTms = report.ParsePredictedTTFT(resp.Header.Get(report.PredictedTTFTHeader))
	if resp.StatusCode/100 != 2 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		r.Err, r.Latency = fmt.Sprintf("status %d: %s", resp.StatusCode, bytes.TrimSpace(msg)), time.Since(t0)
		return r, ""
	}
	var answer strings.Builder
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	sawDone := false
	for sc.Scan() {
		line := sc.Bytes()
		data, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue
		}
		data = bytes.TrimSpace(data)
		if string(data) == "[DONE]" {
			sawDone = true
			break
		}
		var c chunk
		if err := json.Unmarshal(data, &c); err != nil {
			r.Err = "bad chunk: " + err.Error()
			break
		}
		for _, ch := range c.Choices {
			if ch.Delta.Content != "" && r.TTFT == 0 {
				r.TTFT = time.Since(t0)
			}
			answer.WriteString(ch.Delta.Content)
		}
		if c.Usage != nil {
			r.PromptTokens, r.CompletionTokens = c.Usage.PromptTokens, c.Usage.CompletionTokens
			if c.Usage.PromptTokensDetails != nil {
				r.CachedTokens = c.Usage.PromptTokensDetails.CachedTokens
			}
		}
	}
	r.Latency = time.Since(t0)
	if err := sc.Err(); err != nil && r.Err == "" {
		r.Err = err.Error()
	}
	if !sawDone && r.Err == "" {
		r.Err = "stream ended without [DONE]"
	}
	return r, answer.String()
}
