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
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/trace"

	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
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
	// Tracer, when set, traces each generation (tracing.go) as the child
	// of the request's W3C traceparent; nil traces nothing.
	Tracer trace.TracerProvider
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
	// /health as llama-server, vLLM and SGLang serve it: routers of other
	// makes (the SGLang router) check a worker there before sending to it.
	s.mux.HandleFunc("GET /health", s.healthz)
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
	id := r.Header.Get(headers.RequestID)
	if id == "" || len(id) > maxTraceID {
		id = uuid.NewString()
	}
	w.Header().Set(headers.RequestID, id)
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
	tools   *openai.ToolSet // chat with tools the model may call; nil otherwise
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
	ts := req.ToolSet
	var tools []json.RawMessage
	if ts != nil && ts.Choice == openai.ToolChoiceNone {
		ts = nil // tools the model may not call stay out of the prompt
	}
	if ts != nil {
		if !s.cfg.Template.RendersTools() {
			openai.WriteError(w, openai.BadRequest("tools", "this model's chat template does not render tools: the worker renders the GGUF's own tokenizer.chat_template, and this model's never reads `tools`"))
			return
		}
		tools = ts.Raw
	}
	text, err := s.cfg.Template.RenderTools(req.Messages, tools, true)
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
		tools: ts, hashes: s.hasher.Sum(params.Model, req.Canonical())})
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

// statusClientClosed is nginx's 499: the client left before the answer.
const statusClientClosed = 499

// access writes the request's access line: what a request cost the worker
// (prompt, cached and generated tokens, time queued, time to first token),
// under the gateway's trace id. res is nil when the request never ran.
func (s *Server) access(w http.ResponseWriter, j *job, status int, res *scheduler.Result, took time.Duration) {
	if res == nil && status == http.StatusOK {
		status = statusClientClosed // left while queued, before any result
	}
	attrs := []any{"id", j.id, "trace_id", w.Header().Get(headers.RequestID), "model", j.model, "status", status, "duration_ms", took.Milliseconds()}
	if j.params.N > 1 {
		attrs = append(attrs, "n", j.params.N) // tokens below are over all choices
	}
	if res != nil {
		attrs = append(attrs, "state", res.State.String(), "prompt_tokens", res.PromptTokens, "cached_tokens", res.CachedTokens,
			"completion_tokens", res.CompletionTokens, "queue_wait_ms", res.QueueWait.Milliseconds(), "ttft_ms", res.TTFT.Milliseconds())
	}
	s.log.Info("access", attrs...)
}
