package openai

import (
	"crypto/rand"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Finish reasons.
const (
	FinishStop   = "stop"   // EOS or a stop sequence
	FinishLength = "length" // max_tokens or the context size
)

// Object names.
const (
	ObjectChatCompletion      = "chat.completion"
	ObjectChatCompletionChunk = "chat.completion.chunk"
	ObjectTextCompletion      = "text_completion"
)

// NewChatID returns a fresh "chatcmpl-..." id.
func NewChatID() string { return "chatcmpl-" + randomID() }

// NewCompletionID returns a fresh "cmpl-..." id.
func NewCompletionID() string { return "cmpl-" + randomID() }

func randomID() string {
	const alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
	var b [24]byte
	rand.Read(b[:]) // never fails (crypto/rand)
	for i := range b {
		b[i] = alphabet[int(b[i])%len(alphabet)]
	}
	return string(b[:])
}

// Usage is the token accounting of a response.
type Usage struct {
	PromptTokens        int                  `json:"prompt_tokens"`
	CompletionTokens    int                  `json:"completion_tokens"`
	TotalTokens         int                  `json:"total_tokens"`
	PromptTokensDetails *PromptTokensDetails `json:"prompt_tokens_details,omitempty"`
}

// PromptTokensDetails reports how many prompt tokens came from the KV cache.
type PromptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

// NewUsage fills in the total and the cached-token details.
func NewUsage(prompt, completion, cached int) *Usage {
	return &Usage{PromptTokens: prompt, CompletionTokens: completion, TotalTokens: prompt + completion,
		PromptTokensDetails: &PromptTokensDetails{CachedTokens: cached}}
}

// ChatMessage is an assistant message in a response. Content is null in an
// answer that only calls tools.
type ChatMessage struct {
	Role      string     `json:"role"`
	Content   *string    `json:"content"`
	ToolCalls []ToolCall `json:"tool_calls,omitempty"`
}

// ChatChoice is a choice of a chat.completion.
type ChatChoice struct {
	Index        int           `json:"index"`
	Message      ChatMessage   `json:"message"`
	Logprobs     *ChatLogprobs `json:"logprobs"`
	FinishReason string        `json:"finish_reason"`
}

// ChatLogprobs is a chat choice's logprobs: one entry per output token.
type ChatLogprobs struct {
	Content []TokenLogprob `json:"content"`
	Refusal []TokenLogprob `json:"refusal"`
}

// TokenLogprob is one output token of chat logprobs. Token is its text;
// a token that is not whole UTF-8 (a byte of a multi-byte character) is
// written "bytes:\xNN..." as OpenAI does, and Bytes always holds the raw
// bytes.
type TokenLogprob struct {
	Token       string       `json:"token"`
	Logprob     float64      `json:"logprob"`
	Bytes       []int        `json:"bytes"`
	TopLogprobs []TopLogprob `json:"top_logprobs"`
}

// TopLogprob is one alternative of a TokenLogprob.
type TopLogprob struct {
	Token   string  `json:"token"`
	Logprob float64 `json:"logprob"`
	Bytes   []int   `json:"bytes"`
}

// NewTopLogprob describes a token by its text (piece) and log-probability.
func NewTopLogprob(piece string, logprob float32) TopLogprob {
	b := make([]int, len(piece))
	for i := range len(piece) {
		b[i] = int(piece[i])
	}
	tok := piece
	if !utf8.ValidString(piece) {
		var sb strings.Builder
		sb.WriteString("bytes:")
		for i := range len(piece) {
			fmt.Fprintf(&sb, "\\x%02x", piece[i])
		}
		tok = sb.String()
	}
	return TopLogprob{Token: tok, Logprob: float64(logprob), Bytes: b}
}

// CompletionLogprobs is a text completion's legacy logprobs object.
type CompletionLogprobs struct {
	Tokens        []string             `json:"tokens"`
	TokenLogprobs []float64            `json:"token_logprobs"`
	TopLogprobs   []map[string]float64 `json:"top_logprobs"`
	TextOffset    []int                `json:"text_offset"`
}

// Add appends a token (and its alternatives, nil for none) whose text
// starts at offset in the choice's text.
func (l *CompletionLogprobs) Add(t TokenLogprob, offset int) {
	l.Tokens = append(l.Tokens, t.Token)
	l.TokenLogprobs = append(l.TokenLogprobs, t.Logprob)
	var top map[string]float64
	if t.TopLogprobs != nil {
		top = make(map[string]float64, len(t.TopLogprobs))
		for _, a := range t.TopLogprobs {
			if _, ok := top[a.Token]; !ok {
				top[a.Token] = a.Logprob
			}
		}
	}
	l.TopLogprobs = append(l.TopLogprobs, top)
	l.TextOffset = append(l.TextOffset, offset)
}

// ChatCompletion is the non-streamed chat answer.
type ChatCompletion struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []ChatChoice `json:"choices"`
	Usage   *Usage       `json:"usage"`
}

// NewChatCompletion builds a chat.completion.
func NewChatCompletion(id, model string, created time.Time, choices []ChatChoice, usage *Usage) *ChatCompletion {
	return &ChatCompletion{ID: id, Object: ObjectChatCompletion, Created: created.Unix(), Model: model,
		Choices: choices, Usage: usage}
}

// Delta is the incremental message of a chunk.
type Delta struct {
	Role      string     `json:"role,omitempty"`
	Content   *string    `json:"content,omitempty"`
	ToolCalls []ToolCall `json:"tool_calls,omitempty"`
}

// ChunkChoice is a choice of a chat.completion.chunk. FinishReason is null
// until the last content chunk.
type ChunkChoice struct {
	Index        int           `json:"index"`
	Delta        Delta         `json:"delta"`
	Logprobs     *ChatLogprobs `json:"logprobs"`
	FinishReason *string       `json:"finish_reason"`
}

// ChatCompletionChunk is one streamed chat event.
type ChatCompletionChunk struct {
	ID      string        `json:"id"`
	Object  string        `json:"object"`
	Created int64         `json:"created"`
	Model   string        `json:"model"`
	Choices []ChunkChoice `json:"choices"`
	// Usage is null on every chunk but the extra last one, and only present
	// at all when the client asked for stream_options.include_usage.
	Usage *Usage `json:"usage,omitempty"`
}

// CompletionChoice is a choice of a text_completion (streamed or not;
// FinishReason is null on intermediate stream events).
type CompletionChoice struct {
	Index        int                 `json:"index"`
	Text         string              `json:"text"`
	Logprobs     *CompletionLogprobs `json:"logprobs"`
	FinishReason *string             `json:"finish_reason"`
}

// Completion is a text_completion, the whole answer or one stream event.
type Completion struct {
	ID      string             `json:"id"`
	Object  string             `json:"object"`
	Created int64              `json:"created"`
	Model   string             `json:"model"`
	Choices []CompletionChoice `json:"choices"`
	Usage   *Usage             `json:"usage,omitempty"`
}

// NewCompletion builds a text_completion.
func NewCompletion(id, model string, created time.Time, choices []CompletionChoice, usage *Usage) *Completion {
	return &Completion{ID: id, Object: ObjectTextCompletion, Created: created.Unix(), Model: model,
		Choices: choices, Usage: usage}
}

// Model is an entry of GET /v1/models.
type Model struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
}

// ModelList is the GET /v1/models answer.
type ModelList struct {
	Object string  `json:"object"`
	Data   []Model `json:"data"`
}

// NewModelList lists models created at the given time.
func NewModelList(created time.Time, ownedBy string, ids ...string) *ModelList {
	l := &ModelList{Object: "list", Data: []Model{}}
	for _, id := range ids {
		l.Data = append(l.Data, Model{ID: id, Object: "model", Created: created.Unix(), OwnedBy: ownedBy})
	}
	return l
}

// WriteJSON writes v as a JSON response with the given status.
func WriteJSON(w http.ResponseWriter, status int, v any) error {
	body, err := json.Marshal(v)
	if err != nil {
		WriteError(w, Internal("encoding response: %v", err))
		return err
	}
	body = append(body, '\n')
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, err = w.Write(body)
	return err
}
