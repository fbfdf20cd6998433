package openai

import (
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// CanonicalMessages converts chat messages to the prefix contract's canonical
// messages exactly as the gateway's transcoder (filter/transcode/openai) does
// for the same request body (both go through prefix.ChatMessage), so the
// hashes the worker reports to /v1/cache/evict are the ones the gateway
// queries. Non-text content parts count by their image URL.
func CanonicalMessages(msgs []Message) []prefix.Message {
	out := make([]prefix.Message, len(msgs))
	var content []prefix.Part // reused: ChatMessage copies it
	for i, m := range msgs {
		content = content[:0]
		switch {
		case !m.Content.Set:
		case m.Content.Parts == nil:
			content = append(content, prefix.Part{Type: "text", Text: m.Content.Text})
		default:
			for _, p := range m.Content.Parts {
				part := prefix.Part{Type: p.Type}
				if p.Type == "text" {
					part.Text = p.Text
				} else if p.ImageURL != nil {
					part.URL = p.ImageURL.URL
				}
				content = append(content, part)
			}
		}
		out[i] = prefix.ChatMessage(m.Role, m.Name, m.ToolCallID, content, m.ToolCalls)
	}
	return out
}

// Canonical is the canonical prompt bytes of a chat request.
func (r *ChatRequest) Canonical() []byte {
	return prefix.CanonicalChat(CanonicalMessages(r.Messages))
}

// Canonical is the canonical prompt bytes of a completion request.
func (r *CompletionRequest) Canonical() []byte {
	return prefix.CanonicalCompletion(r.PromptText())
}
