// Package openai parses the requests of the OpenAI-compatible APIs
// (docs/envoy-filter.md, "Paths") — chat/completions and completions with
// a fast decoder of their own, responses, Anthropic messages, embeddings,
// rerank, score and audio with encoding/json and mime/multipart — and
// passes them through to OpenAI-speaking backends, translating chat and
// completions for Triton backends.
//
// Beyond the OpenAI schema it reads two optional body fields that steer
// endpoint selection: "label_selector" (object of label -> value every chosen
// endpoint must carry) and "lora" (adapter name; adds lora=<name> to the
// selector).
package openai

import (
	"bytes"
	"errors"
	"slices"
	"strings"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode"
	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode/triton"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// Paths of the endpoints, matched as suffixes: any API prefix before them
// is accepted ("/v1", "/v2", none, a proxy's own prefix).
const (
	ChatPath           = "/chat/completions"
	CompletionPath     = "/completions"
	ResponsesPath      = "/responses"
	MessagesPath       = "/messages"
	EmbeddingsPath     = "/embeddings"
	RerankPath         = "/rerank"
	ScorePath          = "/score"
	TranscriptionsPath = "/audio/transcriptions"
	TranslationsPath   = "/audio/translations"
)

// paths maps path suffixes to kinds, longest first where one ends another.
var paths = []struct {
	suffix string
	kind   transcode.Kind
}{
	{ChatPath, transcode.Chat},
	{CompletionPath, transcode.Completion},
	{ResponsesPath, transcode.Responses},
	{MessagesPath, transcode.Messages},
	{EmbeddingsPath, transcode.Embeddings},
	{RerankPath, transcode.Rerank},
	{ScorePath, transcode.Score},
	{TranscriptionsPath, transcode.Audio},
	{TranslationsPath, transcode.Audio},
}

// LoRALabel is the endpoint label a "lora" request field selects on.
const LoRALabel = "lora"

// Transcoder is the "openai" protocol. The zero value is ready.
type Transcoder struct {
	// LazyCanonical leaves Request.Canonical nil: the caller renders it with
	// Request.AppendCanonical into a buffer of its own (the engine pools
	// them; the 8 KiB per request were a third of a decision's garbage).
	LazyCanonical bool
}

// New returns the openai transcoder.
func New() Transcoder { return Transcoder{} }

// kindOf maps a :path to its endpoint: an empty path returns kind 0 (the
// body decides between chat and completion), an unknown one Other.
func kindOf(path string) transcode.Kind {
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	path = strings.TrimRight(path, "/")
	if path == "" {
		return 0
	}
	for _, p := range paths {
		if strings.HasSuffix(path, p.suffix) {
			return p.kind
		}
	}
	return transcode.Other
}

// Parse implements transcode.Transcoder.
func (t Transcoder) Parse(path string, raw []byte) (*transcode.Request, error) {
	return t.ParseBuffered(path, raw, nil)
}

// ParseBuffered is Parse decoding the prompt texts (message contents, text
// parts, the completion prompt) into *texts, appended, instead of into
// fresh strings; nil texts is Parse. The Request's strings then alias
// *texts: the caller must neither change nor reuse that memory while it
// reads the Request, and must not keep the strings past that. The engine
// passes a pooled buffer that it recycles after its decision: the texts
// were two thirds of a decision's garbage, and garbage sets its tail.
func (t Transcoder) ParseBuffered(path string, raw []byte, texts *[]byte) (*transcode.Request, error) {
	return t.ParseHTTP(path, "", raw, texts)
}

// ParseHTTP is ParseBuffered knowing the request's content-type ("" if
// unknown), which carries a multipart body's boundary.
func (t Transcoder) ParseHTTP(path, contentType string, raw []byte, texts *[]byte) (*transcode.Request, error) {
	kind := kindOf(path)
	switch kind {
	case 0, transcode.Chat, transcode.Completion:
	case transcode.Audio:
		return parseAudio(contentType, raw)
	case transcode.Other:
		// Unknown shapes pass through untouched, to the model's cluster
		// when the body names a model.
		req, ok := parseOther(raw)
		if !ok {
			return nil, transcode.NotFound("unsupported path %q: the body names no model to route on", path)
		}
		return req, nil
	default:
		if len(bytes.TrimLeft(raw, " \t\r\n")) == 0 {
			return nil, transcode.BadRequest("empty request body")
		}
		req, err := parseShape(kind, raw)
		if err == nil && !t.LazyCanonical {
			req.Canonical = req.AppendCanonical(nil)
		}
		return req, err
	}
	if texts != nil {
		// Decoded texts are at most the body's size unless invalid UTF-8
		// grows into U+FFFD; growing mid-parse is still safe (scanner.text).
		*texts = slices.Grow(*texts, len(raw))
	}
	if len(bytes.TrimLeft(raw, " \t\r\n")) == 0 {
		return nil, transcode.BadRequest("empty request body")
	}
	b, err := decodeBodyTexts(raw, texts)
	if err != nil {
		var te *typeError
		switch {
		case errors.As(err, &te):
			return nil, transcode.BadRequest("%s", te.Error())
		case errors.Is(err, errNotObject):
			return nil, transcode.BadRequest("invalid JSON: request body must be an object")
		}
		return nil, transcode.BadRequest("invalid JSON: %v", err)
	}
	if b.model == nil {
		return nil, transcode.BadRequest("missing required field \"model\"")
	}
	if *b.model == "" {
		return nil, transcode.BadRequest("field \"model\" must not be empty")
	}
	req := &transcode.Request{Model: *b.model, Body: raw}
	if b.stream != nil {
		req.Stream = *b.stream
	}
	hasMessages, hasPrompt := b.hasMessages, b.prompt != nil
	if kind == 0 {
		switch {
		case hasMessages && hasPrompt:
			return nil, transcode.BadRequest("request has both \"messages\" and \"prompt\"")
		case hasMessages:
			kind = transcode.Chat
		case hasPrompt:
			kind = transcode.Completion
		default:
			return nil, transcode.BadRequest("missing required field \"messages\" or \"prompt\"")
		}
	}
	req.Kind = kind
	switch kind {
	case transcode.Chat:
		if !hasMessages {
			return nil, transcode.BadRequest("missing required field \"messages\"")
		}
		if hasPrompt {
			return nil, transcode.BadRequest("chat request must not carry \"prompt\"")
		}
		if len(b.messages) == 0 {
			return nil, transcode.BadRequest("field \"messages\" must not be empty")
		}
		msgs, err := convertMessages(b.messages)
		if err != nil {
			return nil, err
		}
		req.Messages = msgs
		req.Preamble = prefix.Preamble(b.tools, b.responseFormat)
		if !t.LazyCanonical {
			req.Canonical = req.AppendCanonical(nil)
		}
	case transcode.Completion:
		if !hasPrompt {
			return nil, transcode.BadRequest("missing required field \"prompt\"")
		}
		if hasMessages {
			return nil, transcode.BadRequest("completion request must not carry \"messages\"")
		}
		req.Prompt = b.prompt.text
		// A completion has no chat template to render tools into.
		req.Preamble = prefix.Preamble(nil, b.responseFormat)
		if !t.LazyCanonical {
			req.Canonical = req.AppendCanonical(nil)
		}
	}
	if len(b.labelSelector) > 0 {
		req.Selector = b.labelSelector
	}
	if b.lora != nil && *b.lora != "" {
		req.LoRA = *b.lora
		if req.Selector == nil {
			req.Selector = map[string]string{}
		}
		if v, ok := req.Selector[LoRALabel]; ok && v != req.LoRA {
			return nil, transcode.BadRequest("\"lora\" %q contradicts label_selector %s=%q", req.LoRA, LoRALabel, v)
		}
		req.Selector[LoRALabel] = req.LoRA
	}
	return req, nil
}

func convertMessages(in []message) ([]prefix.Message, error) {
	out := make([]prefix.Message, len(in))
	var content []prefix.Part // reused: ChatMessage copies it
	for i := range in {
		m := &in[i]
		if m.role == nil || *m.role == "" {
			return nil, transcode.BadRequest("messages[%d].role is required", i)
		}
		content = content[:0]
		switch c := &m.content; {
		case c.text != nil:
			content = append(content, prefix.Part{Type: "text", Text: *c.text})
		default:
			// null or absent content is an assistant turn that only calls tools.
			for j, p := range c.parts {
				hp, err := convertPart(p)
				if err != nil {
					return nil, transcode.BadRequest("messages[%d].content[%d]: %s", i, j, err.Message)
				}
				content = append(content, hp)
			}
		}
		// Tool calls are part of the prefix the backend sees; their exact
		// bytes are as stable as the client that resends them.
		out[i] = prefix.ChatMessage(*m.role, deref(m.name), deref(m.toolCallID), content, m.toolCalls)
	}
	return out, nil
}

func deref(p *string) string {
	if p == nil {
		return ""
	}
	return *p
}

func convertPart(p part) (prefix.Part, *transcode.Error) {
	typ := deref(p.typ)
	switch typ {
	case "":
		return prefix.Part{}, transcode.BadRequest("missing part type")
	case "text":
		if p.text == nil {
			return prefix.Part{}, transcode.BadRequest("text part without \"text\"")
		}
		return prefix.Part{Type: "text", Text: *p.text}, nil
	case "image_url":
		if deref(p.imageURL) == "" {
			return prefix.Part{}, transcode.BadRequest("image_url part without \"image_url.url\"")
		}
		return prefix.Part{Type: typ, URL: *p.imageURL}, nil
	case "input_audio":
		if deref(p.audioData) == "" {
			return prefix.Part{}, transcode.BadRequest("input_audio part without \"input_audio.data\"")
		}
		return prefix.Part{Type: typ, URL: deref(p.audioFmt) + ":" + *p.audioData}, nil
	case "file":
		if deref(p.fileData) == "" && deref(p.fileID) == "" {
			return prefix.Part{}, transcode.BadRequest("file part without \"file.file_data\" or \"file.file_id\"")
		}
		return prefix.Part{Type: typ, URL: deref(p.fileID) + ":" + deref(p.fileData)}, nil
	}
	// Unknown part types still count towards the prefix, by their text if any.
	if p.text != nil {
		return prefix.Part{Type: typ, URL: *p.text}, nil
	}
	return prefix.Part{Type: typ}, nil
}

// Upstream implements transcode.Transcoder: OpenAI-speaking backends get the
// request unchanged; Triton backends get chat and completions translated
// and refuse the other APIs, which Triton's generate endpoint cannot serve.
func (Transcoder) Upstream(req *transcode.Request, backend string) (transcode.Upstream, error) {
	if backend == config.BackendTriton {
		if req.Kind != transcode.Chat && req.Kind != transcode.Completion {
			return transcode.Upstream{}, transcode.BadRequest("%s requests cannot be sent to a triton backend: it serves chat/completions and completions", req.Kind)
		}
		return triton.Translate(req)
	}
	return transcode.Upstream{}, nil
}

// Canonical parses a request body and returns its model and canonical
// prompt bytes exactly as the gateway computes them, for parties that must
// reproduce the gateway's prompt hashes (workers reporting evictions):
// prefix.Hasher{ChunkSize: n}.Sum(model, canonical).
func Canonical(path string, body []byte) (model string, canonical []byte, err error) {
	req, err := Transcoder{}.Parse(path, body)
	if err != nil {
		return "", nil, err
	}
	return req.Model, req.Canonical, nil
}
