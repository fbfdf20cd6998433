// Package loadgen replays workload sessions against an OpenAI-compatible
// endpoint and records what each request observed.
//
// Every request is a streamed chat completion of a fixed length with usage,
// sent by bench/client, so TTFT is measured on the socket.
package loadgen

import (
	"context"
	"math/rand/v2"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/client"
	"github.com/istio-llm-filter/istio-llm-filter/bench/report"
	"github.com/istio-llm-filter/istio-llm-filter/bench/workload"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
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

	// Sent, if set, is told every request's result with the messages it
	// sent and the answer it got (bench/floor computes each workload's
	// floor from them). It may be called from several goroutines at once.
	Sent func(r report.Result, msgs []client.Message, answer string)

	next   *atomic.Uint64 // round-robin position over BaseURLs
	client *client.Client
}

// Run replays sessions and returns one result per request (turn).
func Run(ctx context.Context, sessions []workload.Session, o Options) []report.Result {
	if o.Timeout == 0 {
		o.Timeout = 2 * time.Minute
	}
	o.client = &client.Client{HTTP: o.Client, Timeout: o.Timeout}
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
		history := []client.Message{}
		if s.System != "" {
			history = append(history, client.Message{Role: "system", Content: s.System})
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
			history = append(history, client.Message{Role: "user", Content: turn.User})
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
			if o.Sent != nil {
				o.Sent(r, slices.Clone(history), answer)
			}
			record(r)
			if !r.OK() {
				return // a conversation cannot go on without its answer
			}
			history = append(history, client.Message{Role: "assistant", Content: answer})
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

// do sends one streamed chat completion to base and returns its result and
// the generated text.
func (o Options) do(ctx context.Context, base string, msgs []client.Message, maxTokens int, runStart time.Time) (report.Result, string) {
	res := o.client.Do(ctx, base, client.Request{Model: o.Model, Messages: msgs, Stream: true, MaxTokens: maxTokens, FixedLength: true, Usage: true})
	r := report.Result{Start: res.Sent.Sub(runStart), TTFT: res.TTFT, Latency: res.Latency, Status: res.Status, Worker: res.Worker,
		PromptTokens: res.PromptTokens, CompletionTokens: res.CompletionTokens, CachedTokens: res.CachedTokens}
	if res.Header != nil {
		r.PredictedTTFTms = report.ParsePredictedTTFT(res.Header.Get(headers.PredictedTTFT))
		r.PredictedSlotWaitms = report.ParsePredictedTTFT(res.Header.Get(headers.PredictedSlotWait))
		r.PredictedCachedShare = report.ParseShare(res.Header.Get(headers.PredictedCachedShare))
	}
	if res.Outcome != client.OK {
		r.Err = res.Err
	}
	return r, res.Text
}
