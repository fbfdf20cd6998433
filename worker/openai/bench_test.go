package openai

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestOutputPipeline(t *testing.T) {
	o := NewOutput([]string{"##"})
	var got strings.Builder
	for _, p := range []string{"ab#", "\xe4"} {
		text, stopped := o.Push(p)
		if stopped {
			t.Fatalf("stopped at %q", p)
		}
		got.WriteString(text)
	}
	if got.String() != "ab" {
		t.Errorf("emitted %q before the end, want the possible stop and the partial character held", got.String())
	}
	got.WriteString(o.Flush())
	if got.String() != "ab#\uFFFD" {
		t.Errorf("after flush %q", got.String())
	}

	o = NewOutput([]string{"你好"})
	a, _ := o.Push("x\xe4\xbd")
	b, stopped := o.Push("\xa0\xe5\xa5\xbdy")
	if a+b != "x" || !stopped {
		t.Errorf("stop made of split characters: %q %q %v", a, b, stopped)
	}
}

// chatBody is a multi-turn conversation of about 8 KiB.
func chatBody(b *testing.B) []byte {
	var msgs []map[string]string
	msgs = append(msgs, map[string]string{"role": "system", "content": "You are a helpful assistant."})
	for i := range 16 {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		msgs = append(msgs, map[string]string{"role": role, "content": strings.Repeat("The quick brown fox jumps. ", 18)})
	}
	body, err := json.Marshal(map[string]any{"model": "tiny", "messages": msgs, "max_tokens": 64, "stream": true, "stop": []string{"\n\n"}})
	if err != nil {
		b.Fatal(err)
	}
	return body
}

func BenchmarkParseChat(b *testing.B) {
	body := chatBody(b)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, _, err := ParseChat(body); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkRenderChatML(b *testing.B) {
	req, _, err := ParseChat(chatBody(b))
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := ChatML().Render(req.Messages, true); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkOutputPush is the per-token text cost: one byte-level piece
// through the UTF-8 decoder and a two-sequence stop matcher.
func BenchmarkOutputPush(b *testing.B) {
	text := []byte(strings.Repeat("Hello 你好 world, no stop here. ", 64))
	o := NewOutput([]string{"<|im_end|>", "\n\n"})
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		o.Push(string(text[i : i+1]))
		if i++; i == len(text) {
			i = 0
		}
	}
}
