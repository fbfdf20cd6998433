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

// Canonical is the canonical prompt bytes of a chat request: its tools and
// response_format first (prefix.Preamble), then its messages.
func (r *ChatRequest) Canonical() []byte {
	pre := prefix.AppendPreamble(nil, prefix.Preamble(r.Tools, r.rawResponseFormat()))
	return prefix.AppendCanonicalChat(pre, CanonicalMessages(r.Messages))
}

// Canonical is the canonical prompt bytes of a completion request: its
// response_format first (prefix.Preamble), then its prompt.
func (r *CompletionRequest) Canonical() []byte {
	pre := prefix.AppendPreamble(nil, prefix.Preamble(nil, r.rawResponseFormat()))
	return prefix.AppendCanonicalCompletion(pre, r.PromptText())
}

func (c *common) rawResponseFormat() []byte {
	if c.ResponseFormat == nil {
		return nil
	}
	return c.ResponseFormat.Raw
}
