package server

import (
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
	"github.com/istio-llm-filter/istio-llm-filter/worker/scheduler"
)

// A request with n > 1 runs as n scheduler requests over the same prompt
// tokens, submitted together: the first to bind prefills the prompt and the
// others follow it (kvcache's followers), taking its cells as they are
// computed, so the prompt is computed once and each choice only decodes.
// Each choice has its own sampler (seed+i when the client set a seed).

// choice is one of a request's n generations.
type choice struct {
	index int
	req   *scheduler.Request
	h     *scheduler.Handle
	lp    engine.LogprobSource // nil without logprobs
	recs  []engine.Sampled     // records of tokens sampled but not yet taken
	out   *output
	res   *scheduler.Result
}

// output turns tokens into text the client may see.
type output struct {
	eng   engine.Engine
	dec   openai.TextDecoder
	stop  *openai.StopMatcher
	count int // completion tokens up to and including a matched stop
}

// push decodes toks and returns the text to send and how many of toks are
// part of the output (all, unless a stop sequence matched among them);
// stopped reports a match.
func (o *output) push(toks []int) (text string, used int, stopped bool) {
	for _, t := range toks {
		if o.stop.Stopped() {
			break
		}
		o.count++
		used++
		if o.eng.IsEOG(t) {
			continue // ignore_eos / min_tokens kept going past it; it has no text
		}
		emit, stopped := o.stop.Push(o.dec.Add(o.eng.Piece(t)))
		text += emit
		if stopped {
			return text, used, true
		}
	}
	return text, used, o.stop.Stopped()
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

// logprobs describes the logprobs of the first used of toks (nil without
// logprobs). The sampler records a token when it samples it, before the
// handle emits it: records beyond toks wait for the next call.
func (s *Server) logprobs(c *choice, toks []int, used int) []openai.TokenLogprob {
	if c.lp == nil {
		return nil
	}
	c.recs = append(c.recs, c.lp.TakeLogprobs()...)
	k := min(len(toks), len(c.recs))
	recs := c.recs[:k]
	c.recs = c.recs[k:]
	out := make([]openai.TokenLogprob, 0, used)
	for i := 0; i < used && i < len(recs); i++ {
		r := recs[i]
		t := openai.NewTopLogprob(s.eng.Piece(toks[i]), r.Logprob)
		lp := openai.TokenLogprob{Token: t.Token, Logprob: t.Logprob, Bytes: t.Bytes, TopLogprobs: []openai.TopLogprob{}}
		for _, a := range r.Top {
			lp.TopLogprobs = append(lp.TopLogprobs, openai.NewTopLogprob(s.eng.Piece(a.Token), a.Logprob))
		}
		out = append(out, lp)
	}
	return out
}

// sink is the response writer of one request: JSON or SSE.
type sink interface {
	// text sends choice i's next text and the logprobs of its tokens.
	text(i int, t string, lp []openai.TokenLogprob) error
	// toolCalls sends choice i's tool calls (chat only), before its finish.
	toolCalls(i int, calls []openai.ToolCall) error
	finish(i int, reason string) error
	// end closes the answer once every choice finished.
	end(u *openai.Usage) error
	fail(e *openai.Error)
}

// samplers makes each choice's sampler. An engine that cannot honour the
// request (no logits, a schema llama.cpp cannot compile) gets a 400.
func (s *Server) samplers(p openai.Params) ([]engine.Sampler, *openai.Error) {
	sms := make([]engine.Sampler, p.N)
	for i := range sms {
		sp := engine.SamplingParams{Temperature: float32(p.Temperature), TopP: float32(p.TopP),
			FrequencyPenalty: float32(p.FrequencyPenalty), PresencePenalty: float32(p.PresencePenalty),
			JSONSchema: p.JSONSchema, Logprobs: p.Logprobs, TopLogprobs: p.TopLogprobs}
		if p.Seed != nil {
			sp.Seed, sp.SeedSet = uint32(*p.Seed+int64(i)), true
		}
		sm, err := s.eng.NewSampler(sp)
		switch {
		case errors.Is(err, engine.ErrUnsupported) && p.JSONSchema != nil:
			return nil, openai.BadRequest("response_format", "%v", err)
		case errors.Is(err, engine.ErrUnsupported):
			return nil, openai.BadRequest("logprobs", "%v", err)
		case err != nil:
			return nil, openai.Internal("making a sampler: %v", err)
		}
		if _, ok := sm.(engine.LogprobSource); p.Logprobs && !ok {
			return nil, openai.BadRequest("logprobs", "this worker's engine does not report logprobs")
		}
		sms[i] = sm
	}
	return sms, nil
}

func (s *Server) generate(w http.ResponseWriter, r *http.Request, j *job) {
	p := j.params
	if len(j.prompt) == 0 {
		openai.WriteError(w, openai.BadRequest("prompt", "the prompt is empty"))
		return
	}
	sms, e := s.samplers(p)
	if e != nil {
		openai.WriteError(w, e)
		return
	}
	start := time.Now()
	status := http.StatusOK
	var res *scheduler.Result
	defer func() { s.access(w, j, status, res, time.Since(start)) }()
	if span := s.startSpan(r, j, start); span != nil {
		defer func() { endSpans(span, start, status, res) }()
	}
	cs := make([]*choice, p.N)
	for i := range cs {
		id := j.id
		if i > 0 {
			id = fmt.Sprintf("%s-%d", j.id, i)
		}
		c := &choice{index: i, out: &output{eng: s.eng, stop: openai.NewStopMatcher(p.Stop)},
			req: &scheduler.Request{ID: id, Prompt: j.prompt, Hashes: j.hashes, MaxTokens: p.MaxTokens, MinTokens: p.MinTokens,
				IgnoreEOS: p.IgnoreEOS, StopTokenIDs: p.StopTokenIDs, Sampler: sms[i]}}
		c.lp, _ = sms[i].(engine.LogprobSource)
		if !p.Logprobs {
			c.lp = nil
		}
		h, err := s.sched.Submit(r.Context(), c.req)
		if err != nil {
			// Choices already submitted end with the request's context.
			s.pending.refuse(j.hashes, time.Now())
			e := s.submitError(j, err)
			status = e.Status
			openai.WriteError(w, e)
			return
		}
		c.h = h
		s.pending.add(id, j.hashes)
		defer s.pending.remove(id)
		cs[i] = c
	}
	var out sink
	switch {
	case p.Stream && j.chat:
		out = &chatStream{s: openai.NewChatStream(w, j.id, j.model, j.created, p.IncludeUsage)}
	case p.Stream:
		out = &completionStream{s: openai.NewCompletionStream(w, j.id, j.model, j.created, p.IncludeUsage)}
	default:
		out = newWhole(w, j)
	}
	if j.tools != nil {
		out = &toolSink{sink: out, ts: j.tools, held: make([]string, p.N), sent: make([]bool, p.N)}
	}
	wake, quit := merge(cs)
	defer quit()
	usage := openai.Usage{PromptTokens: len(j.prompt)}
	cached := len(j.prompt)
	for left := len(cs); left > 0; {
		select {
		case <-wake:
		case <-r.Context().Done():
			return
		}
		for _, c := range cs {
			if c.res != nil {
				continue
			}
			toks, cres := c.h.Take()
			text, used, stopped := c.out.push(toks)
			lps := s.logprobs(c, toks, used)
			if stopped {
				c.h.Stop()
			}
			if cres == nil {
				if err := out.text(c.index, text, lps); err != nil {
					return
				}
				continue
			}
			if c.index == 0 || res == nil {
				res = cres
			}
			if cres.State != scheduler.Completed {
				res = cres
				if cres.State == scheduler.Cancelled {
					status = statusClientClosed
					return
				}
				if text != "" {
					out.text(c.index, text, lps)
				}
				s.log.Info("request failed", "id", c.req.ID, "trace_id", w.Header().Get(headers.RequestID), "state", cres.State.String(), "err", cres.Err)
				e := s.resultError(cres)
				status = e.Status
				out.fail(e)
				return
			}
			c.res = cres
			left--
			text += c.out.flush()
			reason := cres.Finish
			n := cres.CompletionTokens
			if c.out.stop.Stopped() {
				reason, n = scheduler.FinishStop, c.out.count
			}
			usage.CompletionTokens += n
			cached = min(cached, cres.CachedTokens)
			if err := out.text(c.index, text, lps); err != nil {
				return
			}
			if err := out.finish(c.index, reason); err != nil {
				return
			}
		}
	}
	// The prompt is counted once; cached is what the choice that computed
	// the most of it took from the cache. The access line says the same.
	all := *res
	all.CompletionTokens, all.CachedTokens = usage.CompletionTokens, cached
	res = &all
	out.end(openai.NewUsage(usage.PromptTokens, usage.CompletionTokens, cached))
}

// merge signals on one channel whenever any choice's handle is ready; quit
// ends the forwarding.
func merge(cs []*choice) (<-chan struct{}, func()) {
	if len(cs) == 1 {
		return cs[0].h.Ready(), func() {}
	}
	wake := make(chan struct{}, 1)
	done := make(chan struct{})
	for _, c := range cs {
		go func(ready <-chan struct{}) {
			for {
				select {
				case <-ready:
					select {
					case wake <- struct{}{}:
					default:
					}
				case <-done:
					return
				}
			}
		}(c.h.Ready())
	}
	return wake, func() { close(done) }
}

type chatStream struct{ s *openai.ChatStream }

// text sends nothing for empty text, so that a request failing before its
// first token still gets a real status (408, 500) instead of an error event.
func (c *chatStream) text(i int, t string, lp []openai.TokenLogprob) error {
	if t == "" && len(lp) == 0 {
		return nil
	}
	var l *openai.ChatLogprobs
	if lp != nil {
		l = &openai.ChatLogprobs{Content: lp}
	}
	return c.s.Content(i, t, l)
}
func (c *chatStream) toolCalls(i int, calls []openai.ToolCall) error {
	return c.s.ToolCalls(i, calls)
}
func (c *chatStream) finish(i int, reason string) error { return c.s.Finish(i, reason) }
func (c *chatStream) end(u *openai.Usage) error         { return c.s.End(u) }
func (c *chatStream) fail(e *openai.Error)              { c.s.SSE().Error(e) }

type completionStream struct {
	s      *openai.CompletionStream
	offset map[int]int // bytes of text so far per choice, for text_offset
}

func (c *completionStream) text(i int, t string, lp []openai.TokenLogprob) error {
	if c.offset == nil {
		c.offset = map[int]int{}
	}
	var l *openai.CompletionLogprobs
	if len(lp) > 0 {
		l = &openai.CompletionLogprobs{}
		off := c.offset[i]
		for _, tl := range lp {
			l.Add(tl, off)
			off += len(tl.Bytes)
		}
		c.offset[i] = off
	}
	return c.s.Text(i, t, l)
}
func (c *completionStream) toolCalls(int, []openai.ToolCall) error {
	return errors.New("server: a text completion has no tool calls")
}
func (c *completionStream) finish(i int, reason string) error { return c.s.Finish(i, reason) }
func (c *completionStream) end(u *openai.Usage) error         { return c.s.End(u) }
func (c *completionStream) fail(e *openai.Error)              { c.s.SSE().Error(e) }

// whole collects the choices of a non-streamed answer.
type whole struct {
	w       http.ResponseWriter
	j       *job
	texts   [][]byte
	lps     [][]openai.TokenLogprob
	calls   [][]openai.ToolCall
	reasons []string
}

func newWhole(w http.ResponseWriter, j *job) *whole {
	n := j.params.N
	return &whole{w: w, j: j, texts: make([][]byte, n), lps: make([][]openai.TokenLogprob, n), calls: make([][]openai.ToolCall, n),
		reasons: make([]string, n)}
}

func (o *whole) text(i int, t string, lp []openai.TokenLogprob) error {
	o.texts[i] = append(o.texts[i], t...)
	o.lps[i] = append(o.lps[i], lp...)
	return nil
}
func (o *whole) toolCalls(i int, calls []openai.ToolCall) error { o.calls[i] = calls; return nil }
func (o *whole) finish(i int, reason string) error              { o.reasons[i] = reason; return nil }
func (o *whole) end(u *openai.Usage) error {
	logprobs := o.j.params.Logprobs
	if o.j.chat {
		choices := make([]openai.ChatChoice, len(o.texts))
		for i := range choices {
			text := string(o.texts[i])
			choices[i] = openai.ChatChoice{Index: i, FinishReason: o.reasons[i],
				Message: openai.ChatMessage{Role: openai.RoleAssistant, Content: &text, ToolCalls: o.calls[i]}}
			if text == "" && o.calls[i] != nil {
				choices[i].Message.Content = nil // only tool calls
			}
			if logprobs {
				choices[i].Logprobs = &openai.ChatLogprobs{Content: append([]openai.TokenLogprob{}, o.lps[i]...)}
			}
		}
		return openai.WriteJSON(o.w, http.StatusOK, openai.NewChatCompletion(o.j.id, o.j.model, o.j.created, choices, u))
	}
	choices := make([]openai.CompletionChoice, len(o.texts))
	for i := range choices {
		choices[i] = openai.CompletionChoice{Index: i, Text: string(o.texts[i]), FinishReason: &o.reasons[i]}
		if logprobs {
			l := &openai.CompletionLogprobs{}
			off := 0
			for _, tl := range o.lps[i] {
				l.Add(tl, off)
				off += len(tl.Bytes)
			}
			choices[i].Logprobs = l
		}
	}
	return openai.WriteJSON(o.w, http.StatusOK, openai.NewCompletion(o.j.id, o.j.model, o.j.created, choices, u))
}
func (o *whole) fail(e *openai.Error) { openai.WriteError(o.w, e) }

// toolSink finds tool calls in a chat's output. With tool_choice auto the
// content streams as usual except what may be a call (openai.ToolHold),
// which is held and parsed when the choice finishes; with required or a
// named function the grammar made the whole output one call, parsed at the
// end. Text that turns out to be no call is sent as content then.
type toolSink struct {
	sink
	ts   *openai.ToolSet
	held []string
	sent []bool
}

func (t *toolSink) text(i int, text string, lp []openai.TokenLogprob) error {
	t.held[i] += text
	k := 0
	if !t.ts.Constrained() {
		k = openai.ToolHold(t.held[i], t.sent[i])
	}
	send := t.held[i][:k]
	t.held[i] = t.held[i][k:]
	t.sent[i] = t.sent[i] || send != ""
	return t.sink.text(i, send, lp)
}

func (t *toolSink) finish(i int, reason string) error {
	content, calls, ok := t.ts.ParseToolCalls(t.held[i])
	if !ok {
		content = t.held[i]
	}
	if content != "" {
		if err := t.sink.text(i, content, nil); err != nil {
			return err
		}
	}
	if ok {
		if err := t.sink.toolCalls(i, calls); err != nil {
			return err
		}
		reason = openai.FinishToolCalls
	}
	return t.sink.finish(i, reason)
}
