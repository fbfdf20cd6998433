package openai

import (
	"bytes"

	"github.com/istio-llm-filter/istio-llm-filter/filter/prompthash"
)

// CanonicalMessages converts chat messages to the filter's prompt-hashing
// types exactly as the gateway's transcoder (filter/transcode/openai) does
// for the same request body, so the hashes the worker reports to
// /v1/cache/evict are the ones the gateway queries. Per message, in order:
// the name and tool_call_id as parts, the content (a string as one text part;
// array parts in order, non-text ones by URL), then the raw tool_calls JSON.
func CanonicalMessages(msgs []Message) []prompthash.Message {
	out := make([]prompthash.Message, len(msgs))
	for i, m := range msgs {
		parts := make([]prompthash.Part, 0, len(m.Content.Parts)+1)
		if m.Name != "" {
			parts = append(parts, prompthash.Part{Type: "name", URL: m.Name})
		}
		if m.ToolCallID != "" {
			parts = append(parts, prompthash.Part{Type: "tool_call_id", URL: m.ToolCallID})
		}
		switch {
		case !m.Content.Set:
		case m.Content.Parts == nil:
			parts = append(parts, prompthash.Part{Type: "text", Text: m.Content.Text})
		default:
			for _, p := range m.Content.Parts {
				part := prompthash.Part{Type: p.Type, Text: p.Text}
				if p.ImageURL != nil {
					part.URL = p.ImageURL.URL
				}
				if p.Type != "text" {
					part.Text = ""
				}
				parts = append(parts, part)
			}
		}
		if len(m.ToolCalls) > 0 && !bytes.Equal(m.ToolCalls, []byte("null")) {
			parts = append(parts, prompthash.Part{Type: "tool_calls", URL: string(m.ToolCalls)})
		}
		out[i] = prompthash.Message{Role: m.Role, Parts: parts}
	}
	return out
}

// Canonical is the canonical prompt bytes of a chat request.
func (r *ChatRequest) Canonical() []byte {
	return prompthash.CanonicalChat(CanonicalMessages(r.Messages))
}

// Canonical is the canonical prompt bytes of a completion request.
func (r *CompletionRequest) Canonical() []byte {
	return prompthash.CanonicalCompletion(r.PromptText())
}
