// Package server is the worker's OpenAI-compatible HTTP API over the
// scheduler: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
// /healthz, /readyz and /metrics.
//
// A handler parses and validates the request (worker/openai), renders and
// tokenizes the prompt, hashes it the way the router does (for eviction
// reports), and submits it. From then on the scheduler owns the work; the
// handler only turns tokens into text (UTF-8-safe, stop sequences held back)
// and writes it, as one JSON answer or as SSE chunks. The request context is
// the client's: when the client goes away the scheduler sees it and the
// request ends CANCELLED, releasing its seq id.
package server

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/mcreport"
	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
	"github.com/istio-llm-filter/istio-llm-filter/worker/scheduler"
)

// Config of the HTTP layer.
type Config struct {
	// ModelName is the id /v1/models lists. Requests may name any model
	// (as llama-server allows) unless StrictModel is set; the request's
	// name is echoed and seeds the prompt hashes, as the router hashes it.
	ModelName   string
	StrictModel bool
	// Adapters are the LoRA adapters the engine applies to every sequence
	// (an adapter pod). Requests must name one, by "lora" or as the model;
	// /v1/models lists them beside the base model.
	Adapters []string
	Template openai.Template
	// HashChunkSize must equal the router's prompt_hash.chunk_size.
	HashChunkSize  int
	MaxBodyBytes   int64
	RequestTimeout time.Duration // only for the 408 message
	RetryAfter     time.Duration // advice sent with 429; default 1 s
	// Ready, if set, gates GET /readyz: it returns nil once the worker may
	// take traffic, else why not (worker/cmd/worker: the metadata center
	// has not acknowledged the start-up index reset yet). nil: always ready.
	Ready func() error
	// Evictions, if set, lists the recent evictions and since when the
	// list is complete (mcreport.Reporter.Recent), for /debug/kv/prefixes.
	Evictions func() ([]mcreport.Eviction, time.Time)
	Registry  *prometheus.Registry
	Logger    *slog.Logger
}

// Server is an http.Handler.
type Server struct {
	cfg     Config
	sched   *scheduler.Scheduler
	eng     engine.Engine
	info    engine.Info
	hasher  prefix.Hasher
	mux     *http.ServeMux
	log     *slog.Logger
	started time.Time
	pending pending // accepted requests' hashes, for /debug/kv/prefixes
	drain   drain   // the shutdown gate (drain.go)
}

// New wires the routes. The scheduler must be running (or about to).
func New(sched *scheduler.Scheduler, eng engine.Engine, cfg Config) *Server {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.RetryAfter <= 0 {
		cfg.RetryAfter = time.Second
	}
	if cfg.Template.Family == "" {
		cfg.Template = openai.ChatML()
	}
	info := eng.Info()
	if cfg.ModelName == "" {
		cfg.ModelName = info.Name
	}
	s := &Server{cfg: cfg, sched: sched, eng: eng, info: info, hasher: prefix.Hasher{ChunkSize: cfg.HashChunkSize},
		mux: http.NewServeMux(), log: cfg.Logger, started: time.Now()}
	s.mux.HandleFunc("POST /v1/chat/completions", s.chat)
	s.mux.HandleFunc("POST /v1/completions", s.completion)
	s.mux.HandleFunc("GET /v1/models", s.models)
	s.mux.HandleFunc("GET /healthz", s.healthz)
	s.mux.HandleFunc("GET /readyz", s.readyz)
	s.mux.HandleFunc("GET "+PathDebugKVPrefixes, s.kvPrefixes)
	if cfg.Registry != nil {
		s.mux.Handle("GET /metrics", promhttp.HandlerFor(cfg.Registry, promhttp.HandlerOpts{Registry: cfg.Registry}))
	}
	s.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		openai.WriteError(w, &openai.Error{Status: http.StatusNotFound, Type: openai.TypeNotFound,
			Message: fmt.Sprintf("no route for %s %s", r.Method, r.URL.Path)})
	})
	return s
}

// ServeHTTP gives every request a trace id (the gateway's X-Request-Id, or
// a new one) and echoes it, so errors and log lines name it.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	id := r.Header.Get(openai.TraceHeader)
	if id == "" || len(id) > maxTraceID {
		id = uuid.NewString()
	}
	w.Header().Set(openai.TraceHeader, id)
	if generation(r) {
		if !s.drain.begin() {
			openai.WriteError(w, draining())
			return
		}
		defer s.drain.end()
	}
	s.mux.ServeHTTP(w, r)
}

// maxTraceID bounds an echoed trace id; a longer one is replaced.
const maxTraceID = 256

func (s *Server) models(w http.ResponseWriter, r *http.Request) {
	openai.WriteJSON(w, http.StatusOK, openai.NewModelList(s.started, "istio-llm-filter", append([]string{s.cfg.ModelName}, s.cfg.Adapters...)...))
}

func (s *Server) healthz(w http.ResponseWriter, r *http.Request) {
	st := s.sched.Stats()
	openai.WriteJSON(w, http.StatusOK, map[string]any{"status": "ok", "model": s.cfg.ModelName, "queued": st.Queued, "running": st.Running})
}

// readyz is the readiness probe: 200 once Config.Ready says so, else 503 in
// the error format with the reason; 503 from Drain on. /healthz stays the liveness probe.
func (s *Server) readyz(w http.ResponseWriter, r *http.Request) {
	if s.drain.on() {
		openai.WriteError(w, draining())
		return
	}
	if s.cfg.Ready != nil {
		if err := s.cfg.Ready(); err != nil {
			openai.WriteError(w, &openai.Error{Status: http.StatusServiceUnavailable, Type: openai.TypeUnavailable,
				Message: "not ready: " + err.Error(), RetryAfter: time.Second})
			return
		}
	}
	openai.WriteJSON(w, http.StatusOK, map[string]any{"status": "ready", "model": s.cfg.ModelName})
}

// job is what both endpoints hand to generate.
type job struct {
	id      string
	model   string
	prompt  []int
	hashes  []prefix.Hash
	params  openai.Params
	created time.Time
	chat    bool
}

func (s *Server) checkModel(p openai.Params) *openai.Error {
	if len(s.cfg.Adapters) > 0 {
		// The adapters run on every sequence of this engine: a request that
		// names none of them would silently get adapted output.
		switch {
		case p.LoRA != "" && !slices.Contains(s.cfg.Adapters, p.LoRA):
			return openai.AdapterNotFound(p.LoRA, s.cfg.Adapters)
		case p.LoRA == "" && !slices.Contains(s.cfg.Adapters, p.Model):
			return openai.AdapterNotFound("", s.cfg.Adapters)
		}
		if slices.Contains(s.cfg.Adapters, p.Model) {
			return nil
		}
	} else if p.LoRA != "" {
		return openai.AdapterNotFound(p.LoRA, nil)
	}
	if s.cfg.StrictModel && p.Model != s.cfg.ModelName {
		return openai.ModelNotFound(p.Model)
	}
	return nil
}

func (s *Server) chat(w http.ResponseWriter, r *http.Request) {
	body, e := openai.ReadBody(w, r, s.cfg.MaxBodyBytes)
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	req, params, e := openai.ParseChat(body)
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	if e := s.checkModel(params); e != nil {
		openai.WriteError(w, e)
		return
	}
	text, err := s.cfg.Template.Render(req.Messages, true)
	if err != nil {
		openai.WriteError(w, asBadRequest("messages", err))
		return
	}
	// Rendered templates carry their own BOS text when they want one.
	toks, err := s.eng.Tokenize(text, false)
	if err != nil {
		openai.WriteError(w, openai.BadRequest("messages", "cannot tokenize the prompt: %v", err))
		return
	}
	s.generate(w, r, &job{id: openai.NewChatID(), model: params.Model, prompt: toks, params: params, created: time.Now(), chat: true,
		hashes: s.hasher.Sum(params.Model, req.Canonical())})
}

func (s *Server) completion(w http.ResponseWriter, r *http.Request) {
	body, e := openai.ReadBody(w, r, s.cfg.MaxBodyBytes)
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	req, params, e := openai.ParseCompletion(body)
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	if e := s.checkModel(params); e != nil {
		openai.WriteError(w, e)
		return
	}
	text := req.PromptText()
	toks, err := s.eng.Tokenize(text, true)
	if err != nil {
		openai.WriteError(w, openai.BadRequest("prompt", "cannot tokenize the prompt: %v", err))
		return
	}
	s.generate(w, r, &job{id: openai.NewCompletionID(), model: params.Model, prompt: toks, params: params, created: time.Now(),
		hashes: s.hasher.Sum(params.Model, req.Canonical())})
}

func asBadRequest(param string, err error) *openai.Error {
	var e *openai.Error
	if errors.As(err, &e) {
		return e
	}
	return openai.BadRequest(param, "%v", err)
}

// submitError maps Submit's refusals to answers.
func (s *Server) submitError(j *job, err error) *openai.Error {
	switch {
	case errors.Is(err, scheduler.ErrQueueFull):
		return openai.TooManyRequests("the worker's request queue is full; retry later", s.cfg.RetryAfter)
	case errors.Is(err, scheduler.ErrTooLong):
		param := "prompt"
		if j.chat {
			param = "messages"
		}
		return openai.BadRequest(param, "the prompt is %d tokens; this worker's context holds %d", len(j.prompt), s.info.NCtx)
	case errors.Is(err, scheduler.ErrMaxTokens):
		return openai.BadRequest("max_tokens", "%v", err)
	case errors.Is(err, scheduler.ErrStopTokenID):
		return openai.BadRequest("stop_token_ids", "%v", err)
	case errors.Is(err, scheduler.ErrBadInput):
		return openai.BadRequest("", "%v", err)
	case errors.Is(err, scheduler.ErrShutdown):
		return unavailable()
	}
	return openai.Internal("submitting the request: %v", err)
}

func unavailable() *openai.Error {
	return &openai.Error{Status: http.StatusServiceUnavailable, Type: openai.TypeUnavailable,
		Message: "the worker is shutting down", RetryAfter: time.Second}
}

// resultError maps a failed result to its answer.
func (s *Server) resultError(res *scheduler.Result) *openai.Error {
	switch res.State {
	case scheduler.Timeout:
		if errors.Is(res.Err, scheduler.ErrQueueTimeout) {
			return &openai.Error{Status: http.StatusRequestTimeout, Type: openai.TypeTimeout,
				Message: fmt.Sprintf("request waited %s in the worker's queue without starting; retry later or elsewhere", res.QueueWait.Round(time.Millisecond))}
		}
		return openai.Timeout(s.cfg.RequestTimeout)
	case scheduler.Failed:
		if errors.Is(res.Err, scheduler.ErrShutdown) {
			return unavailable()
		}
		if errors.Is(res.Err, scheduler.ErrQueueFull) {
			return openai.TooManyRequests("the worker's queue empties too slowly to start this request within its queue timeout; retry later or elsewhere", s.cfg.RetryAfter)
		}
		return openai.Internal("generation failed: %v", res.Err)
	}
	return openai.Internal("request ended %s: %v", res.State, res.Err)
}

// output turns tokens into text the client may see.
type output struct {
	eng   engine.Engine
	dec   openai.TextDecoder
	stop  *openai.StopMatcher
	count int // completion tokens up to and including a matched stop
}

// push decodes toks and returns the text to send; stopped reports a match.
func (o *output) push(toks []int) (string, bool) {
	var text string
	for _, t := range toks {
		if o.stop.Stopped() {
			break
		}
		o.count++
		if o.eng.IsEOG(t) {
			continue // ignore_eos / min_tokens kept going past it; it has no text
		}
		emit, stopped := o.stop.Push(o.dec.Add(o.eng.Piece(t)))
		text += emit
		if stopped {
			return text, true
		}
	}
	return text, o.stop.Stopped()
}

func (o *output) flush() string {
	if o.stop.Stopped() {
		return ""
	}
	emit, _ := o.stop.Push(o.dec.Flush())
	if o.stop.Stopped() {
		return emit
	}
	return emit + o.stop.Flush()
}

// sink is the response writer of one request: JSON or SSE.
type sink interface {
	text(string) error
	finish(reason string, u *openai.Usage) error
	fail(e *openai.Error)
}

func (s *Server) generate(w http.ResponseWriter, r *http.Request, j *job) {
	p := j.params
	req := &scheduler.Request{
		ID: j.id, Prompt: j.prompt, Hashes: j.hashes, MaxTokens: p.MaxTokens, MinTokens: p.MinTokens, IgnoreEOS: p.IgnoreEOS,
		StopTokenIDs: p.StopTokenIDs,
		Sampling: engine.SamplingParams{Temperature: float32(p.Temperature), TopP: float32(p.TopP),
			FrequencyPenalty: float32(p.FrequencyPenalty), PresencePenalty: float32(p.PresencePenalty)},
	}
	if p.Seed != nil {
		req.Sampling.Seed, req.Sampling.SeedSet = uint32(*p.Seed), true
	}
	if len(j.prompt) == 0 {
		openai.WriteError(w, openai.BadRequest("prompt", "the prompt is empty"))
		return
	}
	start := time.Now()
	status := http.StatusOK
	var res *scheduler.Result
	defer func() { s.access(w, j, status, res, time.Since(start)) }()
	h, err := s.sched.Submit(r.Context(), req)
	if err != nil {
		s.pending.refuse(j.hashes, time.Now())
		e := s.submitError(j, err)
		status = e.Status
		openai.WriteError(w, e)
		return
	}
	s.pending.add(j.id, j.hashes)
	defer s.pending.remove(j.id)
	var out sink
	switch {
	case p.Stream && j.chat:
		out = &chatStream{s: openai.NewChatStream(w, j.id, j.model, j.created, p.IncludeUsage)}
	case p.Stream:
		out = &completionStream{s: openai.NewCompletionStream(w, j.id, j.model, j.created, p.IncludeUsage)}
	default:
		out = &whole{w: w, j: j}
	}
	o := &output{eng: s.eng, stop: openai.NewStopMatcher(p.Stop)}
	for {
		select {
		case <-h.Ready():
		case <-r.Context().Done():
			return
		}
		var toks []int
		toks, res = h.Take()
		text, stopped := o.push(toks)
		if stopped {
			h.Stop()
		}
		if res == nil {
			if err := out.text(text); err != nil {
				return
			}
			continue
		}
		if res.State != scheduler.Completed {
			if res.State == scheduler.Cancelled {
				status = statusClientClosed
				return
			}
			if text != "" {
				out.text(text)
			}
			s.log.Info("request failed", "id", j.id, "trace_id", w.Header().Get(openai.TraceHeader), "state", res.State.String(), "err", res.Err)
			e := s.resultError(res)
			status = e.Status
			out.fail(e)
			return
		}
		text += o.flush()
		reason := res.Finish
		n := res.CompletionTokens
		if o.stop.Stopped() {
			reason, n = scheduler.FinishStop, o.count
		}
		if err := out.text(text); err != nil {
			return
		}
		out.finish(reason, openai.NewUsage(res.PromptTokens, n, res.CachedTokens))
		return
	}
}

// statusClientClosed is nginx's 499: the client left before the answer.
const statusClientClosed = 499

// access writes the request's access line: what a request cost the worker
// (prompt, cached and generated tokens, time queued, time to first token),
// under the gateway's trace id. res is nil when the request never ran.
func (s *Server) access(w http.ResponseWriter, j *job, status int, res *scheduler.Result, took time.Duration) {
	if res == nil && status == http.StatusOK {
		status = statusClientClosed // left while queued, before any result
	}
	attrs := []any{"id", j.id, "trace_id", w.Header().Get(openai.TraceHeader), "model", j.model, "status", status, "duration_ms", took.Milliseconds()}
	if res != nil {
		attrs = append(attrs, "state", res.State.String(), "prompt_tokens", res.PromptTokens, "cached_tokens", res.CachedTokens,
			"completion_tokens", res.CompletionTokens, "queue_wait_ms", res.QueueWait.Milliseconds(), "ttft_ms", res.TTFT.Milliseconds())
	}
	s.log.Info("access", attrs...)
}

type chatStream struct{ s *openai.ChatStream }

// text sends nothing for empty text, so that a request failing before its
// first token still gets a real status (408, 500) instead of an error event.
func (c *chatStream) text(t string) error {
	if t == "" {
		return nil
	}
	return c.s.Content(t)
}
func (c *chatStream) finish(reason string, u *openai.Usage) error {
	return c.s.Finish(reason, u)
}
func (c *chatStream) fail(e *openai.Error) { c.s.SSE().Error(e) }

type completionStream struct{ s *openai.CompletionStream }

func (c *completionStream) text(t string) error { return c.s.Text(t) }
func (c *completionStream) finish(reason string, u *openai.Usage) error {
	return c.s.Finish(reason, u)
}
func (c *completionStream) fail(e *openai.Error) { c.s.SSE().Error(e) }

// whole collects the text for a non-streamed answer.
type whole struct {
	w    http.ResponseWriter
	j    *job
	body []byte
}

func (o *whole) text(t string) error { o.body = append(o.body, t...); return nil }
func (o *whole) finish(reason string, u *openai.Usage) error {
	if o.j.chat {
		return openai.WriteJSON(o.w, http.StatusOK, openai.NewChatCompletion(o.j.id, o.j.model, o.j.created, string(o.body), reason, u))
	}
	return openai.WriteJSON(o.w, http.StatusOK, openai.NewCompletion(o.j.id, o.j.model, o.j.created, string(o.body), reason, u))
}
func (o *whole) fail(e *openai.Error) { openai.WriteError(o.w, e) }
