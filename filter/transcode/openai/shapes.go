package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"mime/multipart"
	"strconv"
	"strings"

	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// The APIs besides chat and completions are read with encoding/json: they
// are routed to the model's cluster by their "model" field, and their
// prompt, where the body carries one, is rendered into the chat (or
// completion) canonical form for prefix affinity (docs/envoy-filter.md,
// "Paths"). A prompt field of a shape this gateway does not know is not an
// error: the request is routed by load, untouched, and the backend judges it.

// generic is the fields every JSON API shares.
type generic struct {
	Model         json.RawMessage   `json:"model"`
	Stream        json.RawMessage   `json:"stream"`
	LabelSelector map[string]string `json:"label_selector"`
	LoRA          *string           `json:"lora"`
}

// shapeBody is the union of the prompt fields of the JSON APIs.
type shapeBody struct {
	// Responses (OpenAI API reference, "Responses: Create a model response").
	Instructions json.RawMessage `json:"instructions"`
	Input        json.RawMessage `json:"input"` // also embeddings' input
	Text         *struct {
		Format json.RawMessage `json:"format"`
	} `json:"text"`
	Tools json.RawMessage `json:"tools"`
	// Messages (Anthropic API reference, "Messages").
	System   json.RawMessage   `json:"system"`
	Messages []json.RawMessage `json:"messages"`
	// Rerank (vLLM / Jina / Cohere rerank API) and score (vLLM score API).
	Query     json.RawMessage `json:"query"`
	Documents json.RawMessage `json:"documents"`
	Text1     json.RawMessage `json:"text_1"`
	Text2     json.RawMessage `json:"text_2"`
	Queries   json.RawMessage `json:"queries"`
}

// parseShape parses a JSON body of the given kind.
func parseShape(kind transcode.Kind, raw []byte) (*transcode.Request, error) {
	var g generic
	if err := json.Unmarshal(raw, &g); err != nil {
		var ute *json.UnmarshalTypeError
		switch {
		case errors.As(err, &ute) && ute.Field == "":
			return nil, transcode.BadRequest("invalid JSON: request body must be an object")
		case errors.As(err, &ute) && ute.Field == "lora":
			return nil, transcode.BadRequest("field \"lora\" must be a string")
		case errors.As(err, &ute):
			return nil, transcode.BadRequest("field \"label_selector\" must be an object of strings")
		}
		return nil, transcode.BadRequest("invalid JSON: %v", err)
	}
	req, err := g.request(kind, raw)
	if err != nil {
		return nil, err
	}
	// The prompt fields: one of another shape is no error (the fields
	// that did decode are kept; the backend judges the rest).
	var b shapeBody
	_ = json.Unmarshal(raw, &b)
	switch kind {
	case transcode.Responses:
		var format json.RawMessage
		if b.Text != nil {
			format = b.Text.Format
		}
		req.Preamble = prefix.Preamble(b.Tools, format)
		req.Messages = responsesMessages(b.Instructions, b.Input)
	case transcode.Messages:
		req.Preamble = prefix.Preamble(b.Tools, nil)
		req.Messages = anthropicMessages(b.System, b.Messages)
	case transcode.Embeddings:
		req.Prompt, _ = firstInput(b.Input)
	case transcode.Rerank:
		req.Messages = pairMessages(b.Query, b.Documents)
	case transcode.Score:
		q, d := b.Text1, b.Text2
		if len(q) == 0 && len(d) == 0 {
			q, d = b.Queries, b.Documents
		}
		req.Messages = pairMessages(q, d)
	}
	return req, nil
}

// request checks the model and reads the fields every API shares.
func (g *generic) request(kind transcode.Kind, raw []byte) (*transcode.Request, error) {
	if len(g.Model) == 0 || string(g.Model) == "null" {
		return nil, transcode.BadRequest("missing required field \"model\"")
	}
	var model string
	if err := json.Unmarshal(g.Model, &model); err != nil {
		return nil, transcode.BadRequest("field \"model\" must be a string")
	}
	if model == "" {
		return nil, transcode.BadRequest("field \"model\" must not be empty")
	}
	req := &transcode.Request{Kind: kind, Model: model, Body: raw}
	if string(g.Stream) == "true" {
		req.Stream = true
	}
	return req, selector(req, g.LabelSelector, g.LoRA)
}

// selector sets the request's label selector from label_selector and lora.
func selector(req *transcode.Request, labels map[string]string, lora *string) error {
	if len(labels) > 0 {
		req.Selector = labels
	}
	if lora == nil || *lora == "" {
		return nil
	}
	req.LoRA = *lora
	if req.Selector == nil {
		req.Selector = map[string]string{}
	}
	if v, ok := req.Selector[LoRALabel]; ok && v != req.LoRA {
		return transcode.BadRequest("\"lora\" %q contradicts label_selector %s=%q", req.LoRA, LoRALabel, v)
	}
	req.Selector[LoRALabel] = req.LoRA
	return nil
}

// jsonString decodes raw as a string; ok is false for any other shape.
func jsonString(raw json.RawMessage) (string, bool) {
	if len(raw) == 0 || raw[0] != '"' {
		return "", false
	}
	var s string
	return s, json.Unmarshal(raw, &s) == nil
}

// block is one content part of the Responses and Anthropic APIs (and a
// Responses input item, which has the same "type" discriminator).
type block struct {
	Type     string          `json:"type"`
	Text     *string         `json:"text"`
	Role     string          `json:"role"`
	Content  json.RawMessage `json:"content"`
	ImageURL *string         `json:"image_url"`
	FileID   *string         `json:"file_id"`
	FileData *string         `json:"file_data"`
	FileURL  *string         `json:"file_url"`
	Source   *struct {
		Data *string `json:"data"`
		URL  *string `json:"url"`
	} `json:"source"`
}

// part renders one content block: text as text, anything else as a digest
// of what identifies it (its data or URL, else its raw JSON).
func (b *block) part(raw json.RawMessage) prefix.Part {
	switch {
	case b.Type == "text" || b.Type == "input_text" || b.Type == "output_text":
		if b.Text != nil {
			return prefix.Part{Type: "text", Text: *b.Text}
		}
	case b.Type == "input_image" && (b.ImageURL != nil || b.FileID != nil):
		// The chat API's image_url part: one image hashes alike in both.
		return prefix.Part{Type: "image_url", URL: deref(b.ImageURL) + deref(b.FileID)}
	case b.Type == "input_file":
		return prefix.Part{Type: "file", URL: deref(b.FileID) + ":" + deref(b.FileData) + deref(b.FileURL)}
	case b.Type == "image" && b.Source != nil && (b.Source.Data != nil || b.Source.URL != nil):
		return prefix.Part{Type: "image", URL: deref(b.Source.Data) + deref(b.Source.URL)}
	}
	return prefix.Part{Type: b.Type, URL: string(raw)}
}

// contentParts renders a content that is a string or an array of blocks.
func contentParts(raw json.RawMessage) []prefix.Part {
	if s, ok := jsonString(raw); ok {
		return []prefix.Part{{Type: "text", Text: s}}
	}
	var blocks []json.RawMessage
	if json.Unmarshal(raw, &blocks) != nil {
		if len(raw) == 0 || string(raw) == "null" {
			return nil
		}
		return []prefix.Part{{Type: "content", URL: string(raw)}}
	}
	parts := make([]prefix.Part, 0, len(blocks))
	for _, r := range blocks {
		var b block
		if json.Unmarshal(r, &b) != nil {
			parts = append(parts, prefix.Part{Type: "content", URL: string(r)})
			continue
		}
		parts = append(parts, b.part(r))
	}
	return parts
}

// responsesMessages renders a Responses request as a conversation:
// instructions as the system message, a string input as one user message,
// message items by role and content, and any other item (function calls
// and their outputs, reasoning) as one digest under its type. A request
// with the same instructions and input text as a chat request's system and
// user messages renders alike, as the backend's template renders both.
func responsesMessages(instructions, input json.RawMessage) []prefix.Message {
	var msgs []prefix.Message
	if s, ok := jsonString(instructions); ok && s != "" {
		msgs = append(msgs, prefix.Message{Role: "system", Parts: []prefix.Part{{Type: "text", Text: s}}})
	}
	if s, ok := jsonString(input); ok {
		return append(msgs, prefix.Message{Role: "user", Parts: []prefix.Part{{Type: "text", Text: s}}})
	}
	var items []json.RawMessage
	if json.Unmarshal(input, &items) != nil {
		return msgs
	}
	for _, r := range items {
		var it block
		if json.Unmarshal(r, &it) != nil {
			continue
		}
		if it.Role != "" && (it.Type == "" || it.Type == "message") {
			msgs = append(msgs, prefix.Message{Role: it.Role, Parts: contentParts(it.Content)})
			continue
		}
		msgs = append(msgs, prefix.Message{Role: it.Type, Parts: []prefix.Part{{Type: it.Type, URL: string(r)}}})
	}
	return msgs
}

// anthropicMessages renders an Anthropic Messages request: system (a
// string or text blocks) as the system message, then each message's role
// and content blocks.
func anthropicMessages(system json.RawMessage, messages []json.RawMessage) []prefix.Message {
	var msgs []prefix.Message
	if sys := contentParts(system); len(sys) > 0 {
		msgs = append(msgs, prefix.Message{Role: "system", Parts: sys})
	}
	for _, r := range messages {
		var m struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		}
		if json.Unmarshal(r, &m) != nil {
			continue
		}
		msgs = append(msgs, prefix.Message{Role: m.Role, Parts: contentParts(m.Content)})
	}
	return msgs
}

// pairMessages renders a rerank or score request: the query, then each
// document, as messages of roles "query" and "document" (every pair the
// backend scores starts with the query).
func pairMessages(query, docs json.RawMessage) []prefix.Message {
	var msgs []prefix.Message
	for _, q := range texts(query) {
		msgs = append(msgs, prefix.Message{Role: "query", Parts: []prefix.Part{q}})
	}
	if len(msgs) == 0 {
		return nil
	}
	for _, d := range texts(docs) {
		msgs = append(msgs, prefix.Message{Role: "document", Parts: []prefix.Part{d}})
	}
	return msgs
}

// texts reads a string, an array of strings, or an array of {"text": ...}
// objects (rerank documents); other elements count by their raw JSON.
func texts(raw json.RawMessage) []prefix.Part {
	if s, ok := jsonString(raw); ok {
		return []prefix.Part{{Type: "text", Text: s}}
	}
	var elems []json.RawMessage
	if json.Unmarshal(raw, &elems) != nil {
		return nil
	}
	out := make([]prefix.Part, 0, len(elems))
	for _, e := range elems {
		if s, ok := jsonString(e); ok {
			out = append(out, prefix.Part{Type: "text", Text: s})
			continue
		}
		var d struct {
			Text *string `json:"text"`
		}
		if json.Unmarshal(e, &d) == nil && d.Text != nil {
			out = append(out, prefix.Part{Type: "text", Text: *d.Text})
			continue
		}
		out = append(out, prefix.Part{Type: "document", URL: string(e)})
	}
	return out
}

// firstInput reads embeddings' "input" as completions read "prompt": a
// string, strings, token ids or arrays of token ids, the first of a batch
// (token ids rendered as "id " each).
func firstInput(raw json.RawMessage) (string, bool) {
	if s, ok := jsonString(raw); ok {
		return s, true
	}
	var elems []json.RawMessage
	if json.Unmarshal(raw, &elems) != nil || len(elems) == 0 {
		return "", false
	}
	if s, ok := jsonString(elems[0]); ok {
		return s, true
	}
	var ids []int64
	if json.Unmarshal(elems[0], &ids) != nil {
		if json.Unmarshal(raw, &ids) != nil {
			return "", false
		}
	}
	var sb strings.Builder
	for _, id := range ids {
		sb.WriteString(strconv.FormatInt(id, 10))
		sb.WriteByte(' ')
	}
	return sb.String(), true
}

// maxFormField bounds one multipart form value read (model, stream, ...).
const maxFormField = 4096

// parseAudio reads a multipart/form-data body (OpenAI API reference,
// "Audio: Create transcription / translation"): the model from its "model"
// field, stream from "stream". The audio itself is no prompt: the request
// is routed by load. contentType may be "" (the boundary is then read from
// the body's first line, which is where every client puts it).
func parseAudio(contentType string, raw []byte) (*transcode.Request, error) {
	boundary := ""
	if mt, params, err := mime.ParseMediaType(contentType); err == nil && strings.HasPrefix(mt, "multipart/") {
		boundary = params["boundary"]
	}
	if boundary == "" {
		line, _, _ := bytes.Cut(raw, []byte("\n"))
		b, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r"), []byte("--"))
		if !ok || len(b) == 0 {
			return nil, transcode.BadRequest("audio request body must be multipart/form-data")
		}
		boundary = string(b)
	}
	mr := multipart.NewReader(bytes.NewReader(raw), boundary)
	var g generic
	for {
		p, err := mr.NextPart()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, transcode.BadRequest("invalid multipart body: %v", err)
		}
		name := p.FormName()
		if name != "model" && name != "stream" && name != "lora" {
			continue // NextPart skips the rest of this part
		}
		v, err := io.ReadAll(io.LimitReader(p, maxFormField))
		if err != nil {
			return nil, transcode.BadRequest("invalid multipart body: %v", err)
		}
		switch name {
		case "model":
			g.Model, _ = json.Marshal(string(v))
		case "stream":
			g.Stream = json.RawMessage(strings.ToLower(strings.TrimSpace(string(v))))
		case "lora":
			s := string(v)
			g.LoRA = &s
		}
	}
	return g.request(transcode.Audio, raw)
}

// parseOther reads the model of a body on a path this gateway does not
// know; ok is false when the body is not a JSON object naming one.
func parseOther(raw []byte) (*transcode.Request, bool) {
	var g generic
	if json.Unmarshal(raw, &g) != nil {
		return nil, false
	}
	req, err := g.request(transcode.Other, raw)
	if err != nil {
		return nil, false
	}
	return req, true
}
