package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
	"unicode/utf8"
)

// Roles a chat message may have. "developer" is OpenAI's newer name for
// "system" and is rendered as one.
const (
	RoleSystem    = "system"
	RoleDeveloper = "developer"
	RoleUser      = "user"
	RoleAssistant = "assistant"
	RoleTool      = "tool"
)

// Limits on request shape; beyond them a request is refused with 400.
const (
	MaxStopSequences = 16
	MaxStopTokenIDs  = 64
	MaxStopLength    = 256
	MaxTemperature   = 2
	// MaxChoices bounds n: every choice is a sequence of its own.
	MaxChoices = 16
	// MaxTopLogprobs is chat's top_logprobs limit, MaxLegacyLogprobs the
	// completions' logprobs limit (OpenAI's).
	MaxTopLogprobs    = 20
	MaxLegacyLogprobs = 5
)

// ContentPart is one element of an array-of-parts message content.
type ContentPart struct {
	Type     string    `json:"type"`
	Text     string    `json:"text,omitempty"`
	ImageURL *ImageURL `json:"image_url,omitempty"`
}

// ImageURL is the image_url object of an image part.
type ImageURL struct {
	URL    string `json:"url"`
	Detail string `json:"detail,omitempty"`
}

// Content is a message's content: a string, an array of parts, or absent
// (null), which only assistant messages may have.
type Content struct {
	Text  string        // the string form
	Parts []ContentPart // the array form; nil for the string form
	Set   bool          // false when absent or null
}

// UnmarshalJSON accepts a string, an array of parts or null.
func (c *Content) UnmarshalJSON(b []byte) error {
	*c = Content{}
	b = bytes.TrimSpace(b)
	switch {
	case bytes.Equal(b, []byte("null")):
		return nil
	case len(b) > 0 && b[0] == '"':
		c.Set = true
		return json.Unmarshal(b, &c.Text)
	case len(b) > 0 && b[0] == '[':
		c.Set = true
		if err := json.Unmarshal(b, &c.Parts); err != nil {
			return err
		}
		if c.Parts == nil {
			c.Parts = []ContentPart{}
		}
		return nil
	}
	return errors.New("must be a string or an array of content parts")
}

// MarshalJSON writes the form that was read.
func (c Content) MarshalJSON() ([]byte, error) {
	switch {
	case !c.Set:
		return []byte("null"), nil
	case c.Parts != nil:
		return json.Marshal(c.Parts)
	}
	return json.Marshal(c.Text)
}

// String is the text templates see: the string form, or the text parts
// joined with "\n" (as vLLM does for string-content templates).
func (c Content) String() string {
	if c.Parts == nil {
		return c.Text
	}
	texts := make([]string, 0, len(c.Parts))
	for _, p := range c.Parts {
		if p.Type == "text" {
			texts = append(texts, p.Text)
		}
	}
	return strings.Join(texts, "\n")
}

// Message is one chat message.
type Message struct {
	Role       string          `json:"role"`
	Content    Content         `json:"content"`
	Name       string          `json:"name,omitempty"`
	ToolCallID string          `json:"tool_call_id,omitempty"`
	ToolCalls  json.RawMessage `json:"tool_calls,omitempty"`
}

// StreamOptions is the stream_options object.
type StreamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// StringList is a string or an array of strings (stop, prompt).
type StringList struct {
	Values []string
	Array  bool // the array form was used
}

// UnmarshalJSON accepts a string, an array of strings or null.
func (s *StringList) UnmarshalJSON(b []byte) error {
	*s = StringList{}
	b = bytes.TrimSpace(b)
	switch {
	case bytes.Equal(b, []byte("null")):
		return nil
	case len(b) > 0 && b[0] == '"':
		var v string
		if err := json.Unmarshal(b, &v); err != nil {
			return err
		}
		s.Values = []string{v}
		return nil
	case len(b) > 0 && b[0] == '[':
		s.Array = true
		var raw []json.RawMessage
		if err := json.Unmarshal(b, &raw); err != nil {
			return err
		}
		for _, r := range raw {
			var v string
			if err := json.Unmarshal(r, &v); err != nil {
				return errors.New("must be a string or an array of strings (token-id arrays are not supported)")
			}
			s.Values = append(s.Values, v)
		}
		return nil
	}
	return errors.New("must be a string or an array of strings")
}

// MarshalJSON writes the form that was read.
func (s StringList) MarshalJSON() ([]byte, error) {
	if !s.Array && len(s.Values) == 1 {
		return json.Marshal(s.Values[0])
	}
	if s.Values == nil {
		return []byte("null"), nil
	}
	return json.Marshal(s.Values)
}

// common holds the fields both endpoints share. Pointers distinguish "absent"
// from zero where the default is not zero.
type common struct {
	Model               string         `json:"model"`
	Stream              bool           `json:"stream"`
	StreamOptions       *StreamOptions `json:"stream_options,omitempty"`
	MaxTokens           *int           `json:"max_tokens,omitempty"`
	MaxCompletionTokens *int           `json:"max_completion_tokens,omitempty"`
	Temperature         *float64       `json:"temperature,omitempty"`
	TopP                *float64       `json:"top_p,omitempty"`
	Seed                *int64         `json:"seed,omitempty"`
	Stop                StringList     `json:"stop"`
	N                   *int           `json:"n,omitempty"`
	FrequencyPenalty    *float64       `json:"frequency_penalty,omitempty"`
	PresencePenalty     *float64       `json:"presence_penalty,omitempty"`
	// vLLM / llama-server extensions benchmarks rely on for fixed-length output.
	IgnoreEOS    bool   `json:"ignore_eos,omitempty"`
	MinTokens    *int   `json:"min_tokens,omitempty"`
	StopTokenIDs []int  `json:"stop_token_ids,omitempty"`
	User         string `json:"user,omitempty"`
	// LoRA names the adapter to serve the request with (the gateway routes
	// on it too: docs/configuration.md).
	LoRA string `json:"lora,omitempty"`

	// Logprobs is a boolean for chat and an integer (the alternatives per
	// token, the legacy form) for completions.
	Logprobs       json.RawMessage `json:"logprobs,omitempty"`
	TopLogprobs    *int            `json:"top_logprobs,omitempty"`
	ResponseFormat *ResponseFormat `json:"response_format,omitempty"`
	// BestOf is read only to refuse it: this server samples no hidden
	// choices to rank.
	BestOf *int `json:"best_of,omitempty"`
}

// ResponseFormat is the response_format object.
type ResponseFormat struct {
	Type       string      `json:"type"`
	JSONSchema *JSONSchema `json:"json_schema,omitempty"`
	// Raw is the object's JSON as received: the gateway hashes these very
	// bytes into the prompt's prefix (prefix.Preamble), and so must we.
	Raw json.RawMessage `json:"-"`
}

// UnmarshalJSON decodes the object and keeps its bytes in Raw.
func (f *ResponseFormat) UnmarshalJSON(b []byte) error {
	type plain ResponseFormat
	var p plain
	if err := json.Unmarshal(b, &p); err != nil {
		return err
	}
	*f = ResponseFormat(p)
	f.Raw = append(json.RawMessage(nil), b...)
	return nil
}

// JSONSchema is response_format.json_schema.
type JSONSchema struct {
	Name   string          `json:"name"`
	Schema json.RawMessage `json:"schema"`
	Strict *bool           `json:"strict,omitempty"`
}

// Response format types.
const (
	FormatText       = "text"
	FormatJSONObject = "json_object"
	FormatJSONSchema = "json_schema"
)

// jsonObjectSchema is the schema json_object output is held to: any JSON
// object.
var jsonObjectSchema = []byte(`{"type":"object"}`)

// responseFormat validates response_format and returns the JSON schema the
// output must match (nil for text).
func (c *common) responseFormat() ([]byte, *Error) {
	f := c.ResponseFormat
	if f == nil {
		return nil, nil
	}
	switch f.Type {
	case "", FormatText:
		return nil, nil
	case FormatJSONObject:
		return jsonObjectSchema, nil
	case FormatJSONSchema:
		if f.JSONSchema == nil {
			return nil, BadRequest("response_format.json_schema", "response_format.json_schema is required for type json_schema")
		}
		sc := bytes.TrimSpace(f.JSONSchema.Schema)
		if len(sc) == 0 || sc[0] != '{' {
			return nil, BadRequest("response_format.json_schema.schema", "response_format.json_schema.schema must be a JSON schema object")
		}
		return sc, nil
	}
	return nil, BadRequest("response_format.type", "response_format.type %q is not one of text, json_object, json_schema", f.Type)
}

// logprobs validates logprobs and top_logprobs: chat takes a boolean and
// top_logprobs 0..20; completions the legacy integer 0..5 and no
// top_logprobs.
func (c *common) logprobs(chat bool) (on bool, top int, e *Error) {
	raw := strings.TrimSpace(string(c.Logprobs))
	if chat {
		switch raw {
		case "", "null", "false":
		case "true":
			on = true
		default:
			return false, 0, BadRequest("logprobs", "logprobs must be a boolean, got %s", raw)
		}
		if c.TopLogprobs != nil {
			top = *c.TopLogprobs
			if top < 0 || top > MaxTopLogprobs {
				return false, 0, BadRequest("top_logprobs", "top_logprobs must be between 0 and %d, got %d", MaxTopLogprobs, top)
			}
			if top > 0 && !on {
				return false, 0, BadRequest("top_logprobs", "top_logprobs needs logprobs set to true")
			}
		}
		return on, top, nil
	}
	if c.TopLogprobs != nil {
		return false, 0, BadRequest("top_logprobs", "top_logprobs is a chat parameter; completions take logprobs as the number of alternatives")
	}
	if raw == "" || raw == "null" {
		return false, 0, nil
	}
	var n int
	if err := json.Unmarshal([]byte(raw), &n); err != nil || n < 0 || n > MaxLegacyLogprobs {
		return false, 0, BadRequest("logprobs", "logprobs must be an integer between 0 and %d, got %s", MaxLegacyLogprobs, raw)
	}
	return true, n, nil
}

// ChatRequest is a POST /v1/chat/completions body.
type ChatRequest struct {
	common
	Messages          []Message       `json:"messages"`
	Tools             json.RawMessage `json:"tools,omitempty"`
	ToolChoice        json.RawMessage `json:"tool_choice,omitempty"`
	ParallelToolCalls *bool           `json:"parallel_tool_calls,omitempty"`
	// ToolSet is Tools and ToolChoice validated; nil without tools.
	ToolSet *ToolSet `json:"-"`
}

// CompletionRequest is a POST /v1/completions body.
type CompletionRequest struct {
	common
	Prompt StringList `json:"prompt"`
	Echo   bool       `json:"echo,omitempty"`
	Suffix *string    `json:"suffix,omitempty"`
}

// Params are the validated generation settings, defaults applied.
type Params struct {
	Model string
	// LoRA is the adapter the request names ("" = none).
	LoRA string
	// MaxTokens caps generated tokens; 0 means no cap but the context size.
	MaxTokens int
	// Temperature 0 means greedy decoding.
	Temperature float64
	TopP        float64
	// Seed is set when the client asked for reproducible sampling.
	Seed *int64
	Stop []string
	// IgnoreEOS keeps generating through end-of-generation tokens (until
	// max_tokens), as vLLM and llama-server do for benchmarks.
	IgnoreEOS bool
	// MinTokens: end-of-generation tokens and stop sequences do not end the
	// output before this many tokens (vLLM's semantics).
	MinTokens int
	// StopTokenIDs end the output like end-of-generation (vLLM's
	// stop_token_ids); the worker checks them against its vocabulary.
	StopTokenIDs []int
	// FrequencyPenalty and PresencePenalty are OpenAI's, in [-2, 2]; 0 is
	// off. The worker applies them with llama.cpp's penalty sampler.
	FrequencyPenalty float64
	PresencePenalty  float64
	Stream           bool
	IncludeUsage     bool
	// N is the number of choices (1..MaxChoices).
	N int
	// Logprobs asks for each output token's log-probability and the
	// TopLogprobs most likely alternatives.
	Logprobs    bool
	TopLogprobs int
	// JSONSchema, if set, is the schema the output must be JSON of
	// (response_format json_object or json_schema).
	JSONSchema []byte
}

// Defaults of the OpenAI API.
const (
	DefaultTemperature = 1.0
	DefaultTopP        = 1.0
)

// Params validates the shared fields and returns them with defaults applied.
func (c *common) params(chat bool) (Params, *Error) {
	p := Params{Model: c.Model, LoRA: c.LoRA, Temperature: DefaultTemperature, TopP: DefaultTopP,
		Seed: c.Seed, IgnoreEOS: c.IgnoreEOS, Stream: c.Stream, N: 1}
	if strings.TrimSpace(c.Model) == "" {
		return p, BadRequest("model", "model is required")
	}
	if c.N != nil {
		if *c.N < 1 || *c.N > MaxChoices {
			return p, BadRequest("n", "n must be between 1 and %d, got %d", MaxChoices, *c.N)
		}
		p.N = *c.N
	}
	if c.StreamOptions != nil {
		if !c.Stream {
			return p, BadRequest("stream_options", "stream_options is only allowed when stream is true")
		}
		p.IncludeUsage = c.StreamOptions.IncludeUsage
	}
	for _, f := range []struct {
		name string
		v    *int
	}{{"max_tokens", c.MaxTokens}, {"max_completion_tokens", c.MaxCompletionTokens}} {
		if f.v != nil && *f.v < 1 {
			return p, BadRequest(f.name, "%s must be at least 1, got %d", f.name, *f.v)
		}
	}
	switch {
	case c.MaxCompletionTokens != nil && c.MaxTokens != nil && *c.MaxCompletionTokens != *c.MaxTokens:
		return p, BadRequest("max_completion_tokens", "max_tokens (%d) and max_completion_tokens (%d) disagree: set only one", *c.MaxTokens, *c.MaxCompletionTokens)
	case c.MaxCompletionTokens != nil:
		p.MaxTokens = *c.MaxCompletionTokens
	case c.MaxTokens != nil:
		p.MaxTokens = *c.MaxTokens
	}
	if c.Temperature != nil {
		t := *c.Temperature
		if math.IsNaN(t) || t < 0 || t > MaxTemperature {
			return p, BadRequest("temperature", "temperature must be between 0 and %d, got %v", MaxTemperature, t)
		}
		p.Temperature = t
	}
	if c.TopP != nil {
		v := *c.TopP
		if math.IsNaN(v) || v <= 0 || v > 1 {
			return p, BadRequest("top_p", "top_p must be greater than 0 and at most 1, got %v", v)
		}
		p.TopP = v
	}
	for _, f := range []struct {
		name string
		v    *float64
		dst  *float64
	}{{"frequency_penalty", c.FrequencyPenalty, &p.FrequencyPenalty}, {"presence_penalty", c.PresencePenalty, &p.PresencePenalty}} {
		if f.v == nil {
			continue
		}
		if math.IsNaN(*f.v) || *f.v < -2 || *f.v > 2 {
			return p, BadRequest(f.name, "%s must be between -2 and 2, got %v", f.name, *f.v)
		}
		*f.dst = *f.v
	}
	var e *Error
	if p.Logprobs, p.TopLogprobs, e = c.logprobs(chat); e != nil {
		return p, e
	}
	if p.JSONSchema, e = c.responseFormat(); e != nil {
		return p, e
	}
	if c.BestOf != nil && *c.BestOf != 1 {
		return p, BadRequest("best_of", "best_of must be 1: this server samples no hidden choices to rank (use n for several choices; got %d)", *c.BestOf)
	}
	if c.MinTokens != nil {
		if *c.MinTokens < 0 {
			return p, BadRequest("min_tokens", "min_tokens must not be negative, got %d", *c.MinTokens)
		}
		if p.MaxTokens > 0 && *c.MinTokens > p.MaxTokens {
			return p, BadRequest("min_tokens", "min_tokens (%d) exceeds max_tokens (%d)", *c.MinTokens, p.MaxTokens)
		}
		p.MinTokens = *c.MinTokens
	}
	if len(c.StopTokenIDs) > MaxStopTokenIDs {
		return p, BadRequest("stop_token_ids", "at most %d stop token ids are allowed, got %d", MaxStopTokenIDs, len(c.StopTokenIDs))
	}
	for i, id := range c.StopTokenIDs {
		if id < 0 {
			return p, BadRequest("stop_token_ids", "stop_token_ids[%d] is negative (%d)", i, id)
		}
	}
	p.StopTokenIDs = c.StopTokenIDs
	if len(c.Stop.Values) > MaxStopSequences {
		return p, BadRequest("stop", "at most %d stop sequences are allowed, got %d", MaxStopSequences, len(c.Stop.Values))
	}
	for i, s := range c.Stop.Values {
		switch {
		case s == "":
			return p, BadRequest("stop", "stop[%d] is empty", i)
		case len(s) > MaxStopLength:
			return p, BadRequest("stop", "stop[%d] is longer than %d bytes", i, MaxStopLength)
		case !utf8.ValidString(s):
			return p, BadRequest("stop", "stop[%d] is not valid UTF-8", i)
		}
	}
	p.Stop = c.Stop.Values
	return p, nil
}

// field binds a JSON member name to the value it decodes into.
type field struct {
	name   string
	target any
}

// decodeObject decodes a JSON object member by member, so that every error
// names the member at fault (prefix is its path, e.g. "messages[2]").
// Unknown members are ignored, as OpenAI-compatible servers do.
func decodeObject(raw []byte, prefix string, fields []field) *Error {
	var members map[string]json.RawMessage
	if err := json.Unmarshal(raw, &members); err != nil || members == nil {
		what := "the request body"
		if prefix != "" {
			what = prefix
		}
		return BadRequest(prefix, "%s must be a JSON object", what)
	}
	for _, f := range fields {
		v, ok := members[f.name]
		if !ok {
			continue
		}
		path := f.name
		if prefix != "" {
			path = prefix + "." + f.name
		}
		if err := json.Unmarshal(v, f.target); err != nil {
			return BadRequest(path, "%s: %s", path, describe(err))
		}
	}
	return nil
}

// describe phrases a decoding error for a client.
func describe(err error) string {
	var typ *json.UnmarshalTypeError
	if errors.As(err, &typ) {
		want := jsonKind(typ.Type.Kind().String())
		if typ.Field != "" {
			return fmt.Sprintf("%s: expected %s, got %s", typ.Field, want, typ.Value)
		}
		return fmt.Sprintf("expected %s, got %s", want, typ.Value)
	}
	return strings.TrimPrefix(err.Error(), "json: ")
}

// checkJSON rejects bodies that are not exactly one well-formed JSON value,
// with the position of the first syntax error.
func checkJSON(body []byte) *Error {
	if len(bytes.TrimSpace(body)) == 0 {
		return BadRequest("", "request body is empty: expected a JSON object")
	}
	if !utf8.Valid(body) {
		return BadRequest("", "request body is not valid UTF-8")
	}
	if json.Valid(body) {
		if bytes.TrimSpace(body)[0] != '{' {
			return BadRequest("", "request body must be a JSON object")
		}
		return nil
	}
	// Invalid: decode again only to say where and why.
	dec := json.NewDecoder(bytes.NewReader(body))
	var v json.RawMessage
	if err := dec.Decode(&v); err != nil {
		var syn *json.SyntaxError
		if errors.As(err, &syn) {
			return BadRequest("", "invalid JSON at byte %d: %s", syn.Offset, strings.TrimPrefix(syn.Error(), "json: "))
		}
		return BadRequest("", "invalid JSON: unexpected end of input")
	}
	return BadRequest("", "invalid JSON: unexpected data after the top-level value at byte %d", dec.InputOffset())
}

func jsonKind(k string) string {
	switch k {
	case "int", "int64", "int32", "uint32", "uint64":
		return "an integer"
	case "float64", "float32":
		return "a number"
	case "bool":
		return "a boolean"
	case "string":
		return "a string"
	case "slice", "array":
		return "an array"
	case "struct", "map", "ptr":
		return "an object"
	}
	return k
}

func (c *common) fields() []field {
	return []field{
		{"model", &c.Model}, {"stream", &c.Stream}, {"stream_options", &c.StreamOptions},
		{"max_tokens", &c.MaxTokens}, {"max_completion_tokens", &c.MaxCompletionTokens},
		{"temperature", &c.Temperature}, {"top_p", &c.TopP}, {"seed", &c.Seed},
		{"stop", &c.Stop}, {"n", &c.N}, {"ignore_eos", &c.IgnoreEOS},
		{"min_tokens", &c.MinTokens}, {"user", &c.User}, {"stop_token_ids", &c.StopTokenIDs}, {"lora", &c.LoRA},
		{"frequency_penalty", &c.FrequencyPenalty}, {"presence_penalty", &c.PresencePenalty},
		{"logprobs", &c.Logprobs}, {"top_logprobs", &c.TopLogprobs},
		{"response_format", &c.ResponseFormat}, {"best_of", &c.BestOf},
	}
}

// ParseChat decodes and validates a chat completion request.
func ParseChat(body []byte) (*ChatRequest, Params, *Error) {
	var r ChatRequest
	if err := checkJSON(body); err != nil {
		return nil, Params{}, err
	}
	var rawMessages []json.RawMessage
	if err := decodeObject(body, "", append(r.fields(), field{"messages", &rawMessages}, field{"tools", &r.Tools},
		field{"tool_choice", &r.ToolChoice}, field{"parallel_tool_calls", &r.ParallelToolCalls})); err != nil {
		return nil, Params{}, err
	}
	var te *Error
	if r.ToolSet, te = parseTools(r.Tools, r.ToolChoice); te != nil {
		return nil, Params{}, te
	}
	p, err := r.params(true)
	if err != nil {
		return nil, p, err
	}
	if r.ToolSet.Constrained() {
		if p.JSONSchema != nil {
			return nil, p, BadRequest("response_format", "response_format cannot be combined with tool_choice %q: both constrain the output", r.ToolSet.Choice)
		}
		p.JSONSchema = r.ToolSet.CallSchema()
	}
	if len(rawMessages) == 0 {
		return nil, p, BadRequest("messages", "messages is required and must hold at least one message")
	}
	r.Messages = make([]Message, len(rawMessages))
	for i, raw := range rawMessages {
		m := &r.Messages[i]
		prefix := fmt.Sprintf("messages[%d]", i)
		err := decodeObject(raw, prefix, []field{
			{"role", &m.Role}, {"content", &m.Content}, {"name", &m.Name},
			{"tool_call_id", &m.ToolCallID}, {"tool_calls", &m.ToolCalls},
		})
		if err != nil {
			return nil, p, err
		}
		if err := validateMessage(i, m); err != nil {
			return nil, p, err
		}
	}
	return &r, p, nil
}

func validateMessage(i int, m *Message) *Error {
	param := fmt.Sprintf("messages[%d]", i)
	switch m.Role {
	case RoleSystem, RoleDeveloper, RoleUser, RoleAssistant, RoleTool:
	case "":
		return BadRequest(param+".role", "%s.role is required", param)
	default:
		return BadRequest(param+".role", "%s.role %q is not one of system, developer, user, assistant, tool", param, m.Role)
	}
	if !m.Content.Set {
		if m.Role == RoleAssistant {
			return nil // an assistant turn that only called tools
		}
		return BadRequest(param+".content", "%s.content is required for role %s", param, m.Role)
	}
	for j, part := range m.Content.Parts {
		pp := fmt.Sprintf("%s.content[%d]", param, j)
		switch part.Type {
		case "text":
		case "image_url":
			if part.ImageURL == nil || part.ImageURL.URL == "" {
				return BadRequest(pp+".image_url", "%s.image_url.url is required", pp)
			}
		case "":
			return BadRequest(pp+".type", "%s.type is required", pp)
		default:
			return BadRequest(pp+".type", "%s.type %q is not supported (text, image_url)", pp, part.Type)
		}
	}
	return nil
}

// ParseCompletion decodes and validates a text completion request. The
// prompt is one string, or an array holding exactly one string: several
// prompts would mean several choices, and this server returns one.
func ParseCompletion(body []byte) (*CompletionRequest, Params, *Error) {
	var r CompletionRequest
	if err := checkJSON(body); err != nil {
		return nil, Params{}, err
	}
	err := decodeObject(body, "", append(r.fields(),
		field{"prompt", &r.Prompt}, field{"echo", &r.Echo}, field{"suffix", &r.Suffix}))
	if err != nil {
		return nil, Params{}, err
	}
	p, err := r.params(false)
	if err != nil {
		return nil, p, err
	}
	switch n := len(r.Prompt.Values); {
	case n == 0:
		return nil, p, BadRequest("prompt", "prompt is required")
	case n > 1:
		return nil, p, BadRequest("prompt", "one prompt per request is supported, got %d", n)
	case r.Prompt.Values[0] == "":
		return nil, p, BadRequest("prompt", "prompt must not be empty")
	}
	if r.Echo {
		return nil, p, BadRequest("echo", "echo is not supported")
	}
	if r.Suffix != nil && *r.Suffix != "" {
		return nil, p, BadRequest("suffix", "suffix is not supported")
	}
	return &r, p, nil
}

// PromptText is the single prompt of a validated completion request.
func (r *CompletionRequest) PromptText() string { return r.Prompt.Values[0] }

// DefaultMaxBodyBytes bounds request bodies unless the server says otherwise.
const DefaultMaxBodyBytes = 8 << 20

// ReadBody reads a request body of at most limit bytes (413 beyond it).
func ReadBody(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, *Error) {
	if limit <= 0 {
		limit = DefaultMaxBodyBytes
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, TooLarge(limit)
		}
		return nil, BadRequest("", "reading request body: %v", err)
	}
	return body, nil
}
