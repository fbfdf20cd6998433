package vllmsim

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
)

// Handler is a pod's HTTP API: POST /v1/chat/completions and
// /v1/completions, GET /v1/models,
// GET /health and GET /metrics, as vLLM's OpenAI server has them.
func (p *Pod) Handler() http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(newCollector(p))
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", p.chat)
	mux.HandleFunc("POST /v1/completions", p.completion)
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		openai.WriteJSON(w, http.StatusOK, openai.NewModelList(time.Now(), "vllm", p.cfg.ModelName))
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		openai.WriteError(w, &openai.Error{Status: http.StatusNotFound, Type: openai.TypeNotFound,
			Message: r.Method + " " + r.URL.Path + " is not served here"})
	})
	return mux
}

// template renders chat messages to the prompt the model reads.
var template = openai.ChatML()

// ChatPrompt is the prompt text a pod reads for chat messages (Tokenize
// gives its tokens).
func ChatPrompt(msgs []openai.Message) (string, error) { return template.Render(msgs, true) }

func (p *Pod) chat(w http.ResponseWriter, hr *http.Request) {
	body, aerr := openai.ReadBody(w, hr, 0)
	if aerr != nil {
		openai.WriteError(w, aerr)
		return
	}
	req, params, aerr := openai.ParseChat(body)
	if aerr != nil {
		openai.WriteError(w, aerr)
		return
	}
	text, err := ChatPrompt(req.Messages)
	if err != nil {
		openai.WriteError(w, err)
		return
	}
	p.generate(w, hr, params, text, "messages", true)
}

func (p *Pod) completion(w http.ResponseWriter, hr *http.Request) {
	body, aerr := openai.ReadBody(w, hr, 0)
	if aerr != nil {
		openai.WriteError(w, aerr)
		return
	}
	req, params, aerr := openai.ParseCompletion(body)
	if aerr != nil {
		openai.WriteError(w, aerr)
		return
	}
	p.generate(w, hr, params, req.PromptText(), "prompt", false)
}

// generate runs one request of prompt text through the engine and answers
// it as a chat completion or a text completion, streamed or whole.
func (p *Pod) generate(w http.ResponseWriter, hr *http.Request, params openai.Params, text, promptParam string, chat bool) {
	if params.Model != p.cfg.ModelName {
		openai.WriteError(w, openai.ModelNotFound(params.Model))
		return
	}
	prompt := Tokenize(text)
	maxTokens := params.MaxTokens
	if maxTokens == 0 {
		maxTokens = p.cfg.MaxModelLen - len(prompt)
	}
	if len(prompt)+maxTokens > p.cfg.MaxModelLen || maxTokens < 1 || len(prompt) == 0 {
		openai.WriteError(w, openai.BadRequest(promptParam,
			"this model's maximum context length is %d tokens; the request asks for %d (%d in the %s, %d in the completion)",
			p.cfg.MaxModelLen, len(prompt)+maxTokens, len(prompt), promptParam, maxTokens))
		return
	}
	r := &request{tokens: prompt, promptLen: len(prompt), maxTokens: maxTokens, arrival: time.Now(),
		notify: make(chan struct{}, 1)}
	p.submit(r)
	created := time.Now()
	if !params.Stream {
		finish := openai.FinishLength
		if !p.wait(hr.Context(), r) {
			return
		}
		p.mu.Lock()
		content, usage := strings.Join(r.output, ""), openai.NewUsage(r.promptLen, len(r.output), r.cached)
		p.mu.Unlock()
		if chat {
			openai.WriteJSON(w, http.StatusOK, openai.NewChatCompletion(openai.NewChatID(), p.cfg.ModelName, created,
				[]openai.ChatChoice{{Message: openai.ChatMessage{Role: openai.RoleAssistant, Content: &content}, FinishReason: openai.FinishLength}}, usage))
		} else {
			openai.WriteJSON(w, http.StatusOK, openai.NewCompletion(openai.NewCompletionID(), p.cfg.ModelName, created,
				[]openai.CompletionChoice{{Text: content, FinishReason: &finish}}, usage))
		}
		return
	}
	var send func(string) error
	var finish func(*openai.Usage) error
	if chat {
		// As vLLM's chat server, the assistant-role chunk goes out with the
		// first token, not at admission: a proxy timing the first byte of
		// the body sees the time to first token.
		s := openai.NewChatStream(w, openai.NewChatID(), p.cfg.ModelName, created, params.IncludeUsage)
		send = func(text string) error { return s.Content(0, text, nil) }
		finish = func(u *openai.Usage) error {
			if err := s.Finish(0, openai.FinishLength); err != nil {
				return err
			}
			return s.End(u)
		}
	} else {
		s := openai.NewCompletionStream(w, openai.NewCompletionID(), p.cfg.ModelName, created, params.IncludeUsage)
		send = func(text string) error { return s.Text(0, text, nil) }
		finish = func(u *openai.Usage) error {
			if err := s.Finish(0, openai.FinishLength); err != nil {
				return err
			}
			return s.End(u)
		}
	}
	sent := 0
	for {
		select {
		case <-r.notify:
		case <-hr.Context().Done():
			p.abort(r)
			return
		}
		p.mu.Lock()
		n, done := len(r.output), r.done
		var text string
		if n > sent && (sent == 0 || done || n-sent >= p.cfg.StreamInterval) {
			text = strings.Join(r.output[sent:n], "")
			sent = n
		}
		usage := openai.NewUsage(r.promptLen, n, r.cached)
		p.mu.Unlock()
		if text != "" {
			if err := send(text); err != nil {
				p.abort(r)
				return
			}
		}
		if done {
			finish(usage)
			return
		}
	}
}

// wait blocks until r is done or the client leaves.
func (p *Pod) wait(ctx context.Context, r *request) bool {
	for {
		select {
		case <-r.notify:
			p.mu.Lock()
			done := r.done
			p.mu.Unlock()
			if done {
				return true
			}
		case <-ctx.Done():
			p.abort(r)
			return false
		}
	}
}

// Serve runs one pod on each listener until ctx ends, then shuts them down.
func Serve(ctx context.Context, cfg Config, listeners []net.Listener, log *slog.Logger) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	var wg sync.WaitGroup
	errs := make(chan error, len(listeners))
	var servers []*http.Server
	for _, l := range listeners {
		pod, err := NewPod(cfg)
		if err != nil {
			return err
		}
		srv := &http.Server{Handler: pod.Handler(), ReadHeaderTimeout: 10 * time.Second}
		servers = append(servers, srv)
		wg.Add(2)
		go func() { defer wg.Done(); pod.Run(ctx) }()
		go func() {
			defer wg.Done()
			if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
				errs <- err
			}
		}()
		log.Info("vLLM-like pod serving", "addr", l.Addr().String(), "model", cfg.ModelName)
	}
	var err error
	select {
	case <-ctx.Done():
	case err = <-errs:
	}
	shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, s := range servers {
		s.Shutdown(shut)
	}
	stop()
	wg.Wait()
	return err
}
