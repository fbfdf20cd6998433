package prefix

import (
	"crypto/sha256"
	"encoding/hex"
	"slices"
	"strings"
)

// Control bytes of the canonical form. They are ASCII control characters
// that real prompt text practically never contains; when it does, they are
// escaped, which is what makes the encoding injective.
const (
	escByte  = 0x1b // ESC: the next byte is literal content
	partMark = 0x1d // GS: opens and closes a non-text part digest
	msgMark  = 0x1e // RS: starts a message (followed by the role)
	roleEnd  = 0x1f // US: ends the role, content follows
)

// Part is one piece of a message's content.
// Type is "text" for text (Text is used); any other type ("image_url",
// "input_audio", ...) contributes a SHA-256 digest of its URL or inline data
// (URL), so a 5 MB data: URL costs 64 canonical bytes, not 5 MB.
type Part struct{ Type, Text, URL string }

// Message is one chat message: a role and its content parts in order.
// A plain string content is a single Part{Type: "text"}.
type Message struct {
	Role  string
	Parts []Part
}

// CanonicalChat renders messages as
//
//	for each message:  RS role US content
//	content:           escaped text of text parts, in order;
//	                   GS type ':' hex(sha256(url)) GS for other parts
//
// where RS, US, GS and ESC inside role, text and type are escaped with ESC.
// Hence [A,B] and [B,A] differ, and no content can forge a message or role
// boundary. The end of a message is not marked, so a conversation's bytes are
// a prefix of the bytes of any conversation that continues it. Adjacent text
// parts concatenate, as chat templates render them.
func CanonicalChat(msgs []Message) []byte {
	return AppendCanonicalChat(nil, msgs)
}

// AppendCanonicalChat appends CanonicalChat(msgs) to dst, for callers that
// reuse buffers on the hot path.
func AppendCanonicalChat(dst []byte, msgs []Message) []byte {
	n := 0
	for i := range msgs {
		n += 2 + len(msgs[i].Role)
		for _, p := range msgs[i].Parts {
			if p.Type == "text" {
				n += len(p.Text)
			} else {
				n += 3 + len(p.Type) + 2*sha256.Size
			}
		}
	}
	// A little headroom for escapes so the common case allocates once.
	out := slices.Grow(dst, n+n/64+8)
	for i := range msgs {
		out = append(out, msgMark)
		out = appendEscaped(out, msgs[i].Role)
		out = append(out, roleEnd)
		for _, p := range msgs[i].Parts {
			if p.Type == "text" {
				out = appendEscaped(out, p.Text)
				continue
			}
			out = append(out, partMark)
			out = appendEscaped(out, p.Type)
			out = append(out, ':')
			sum := sha256.Sum256([]byte(p.URL))
			out = hex.AppendEncode(out, sum[:])
			out = append(out, partMark)
		}
	}
	return out
}

// CanonicalCompletion renders a completion prompt: its text, with the control
// bytes escaped as in CanonicalChat. An unescaped RS never appears in it, so
// a completion can never collide with a chat conversation.
func CanonicalCompletion(prompt string) []byte {
	return AppendCanonicalCompletion(nil, prompt)
}

// AppendCanonicalCompletion appends CanonicalCompletion(prompt) to dst.
func AppendCanonicalCompletion(dst []byte, prompt string) []byte {
	return appendEscaped(slices.Grow(dst, len(prompt)+len(prompt)/64+8), prompt)
}

func isControl(c byte) bool {
	return c == escByte || c == partMark || c == msgMark || c == roleEnd
}

// appendEscaped copies s, escaping the control bytes. Real text almost never
// holds them, and four vectorised byte searches prove it faster than one
// byte-by-byte scan, so the common case is those searches and one copy.
func appendEscaped(out []byte, s string) []byte {
	if strings.IndexByte(s, msgMark) < 0 && strings.IndexByte(s, roleEnd) < 0 &&
		strings.IndexByte(s, partMark) < 0 && strings.IndexByte(s, escByte) < 0 {
		return append(out, s...)
	}
	start := 0
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 && isControl(c) {
			out = append(out, s[start:i]...)
			out = append(out, escByte, c)
			start = i + 1
		}
	}
	return append(out, s[start:]...)
}

// ChatMessage is the canonical message of an OpenAI chat message, the one
// place its identifying fields are ordered: the name and tool_call_id (as
// digest parts), the content parts in order, then the raw tool_calls JSON.
// Gateway and worker parse requests with different decoders; both call this
// so that a request hashes the same on either side.
func ChatMessage(role, name, toolCallID string, content []Part, toolCalls []byte) Message {
	parts := make([]Part, 0, len(content)+3)
	if name != "" {
		parts = append(parts, Part{Type: "name", URL: name})
	}
	if toolCallID != "" {
		parts = append(parts, Part{Type: "tool_call_id", URL: toolCallID})
	}
	parts = append(parts, content...)
	if len(toolCalls) > 0 && string(toolCalls) != "null" {
		parts = append(parts, Part{Type: "tool_calls", URL: string(toolCalls)})
	}
	return Message{Role: role, Parts: parts}
}

// Preamble is what a request renders before its messages: the raw JSON of
// its top-level "tools" and "response_format" (or their equivalents in
// other APIs), as digest parts in that order. Chat templates render tool
// definitions into the system part, ahead of every message, so requests
// with different tool sets share no prefix. Absent or null fields add
// nothing, so a request without them renders as it always did. Gateway and
// worker both build it here.
func Preamble(tools, responseFormat []byte) []Part {
	var parts []Part
	if len(tools) > 0 && string(tools) != "null" {
		parts = append(parts, Part{Type: "tools", URL: string(tools)})
	}
	if len(responseFormat) > 0 && string(responseFormat) != "null" {
		parts = append(parts, Part{Type: "response_format", URL: string(responseFormat)})
	}
	return parts
}

// AppendPreamble appends the canonical preamble: each part as
//
//	GS type ':' hex(sha256(url)) GS
//
// (text parts too are digested). A canonical prompt without a preamble
// begins with RS (chat) or with escaped text (completion), where an
// unescaped GS never occurs, so a leading GS can only open a preamble and
// the preamble ends at the first byte after a closing GS that is not GS:
// one canonical form, still injective. Callers append the messages (or
// completion text) right after it.
func AppendPreamble(dst []byte, parts []Part) []byte {
	for _, p := range parts {
		dst = append(dst, partMark)
		dst = appendEscaped(dst, p.Type)
		dst = append(dst, ':')
		src := p.URL
		if p.Type == "text" {
			src = p.Text
		}
		sum := sha256.Sum256([]byte(src))
		dst = hex.AppendEncode(dst, sum[:])
		dst = append(dst, partMark)
	}
	return dst
}
