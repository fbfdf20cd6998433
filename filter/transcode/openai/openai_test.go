package openai

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"math/bits"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

func parse(t *testing.T, path, body string) *transcode.Request {
	t.Helper()
	req, err := New().Parse(path, []byte(body))
	if err != nil {
		t.Fatalf("Parse(%s): %v", body, err)
	}
	return req
}

func TestParseChat(t *testing.T) {
	req := parse(t, "/v1/chat/completions", `{"model":"qwen","stream":true,"messages":[
		{"role":"system","content":"be brief"},
		{"role":"user","content":[{"type":"text","text":"what is "},{"type":"text","text":"this?"},
		                           {"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}`)
	if req.Kind != transcode.Chat || req.Model != "qwen" || !req.Stream || len(req.Messages) != 2 {
		t.Fatalf("req = %+v", req)
	}
	if got := req.Messages[1].Parts; len(got) != 3 || got[2].Type != "image_url" || got[2].URL != "data:image/png;base64,AAAA" {
		t.Fatalf("parts = %+v", got)
	}
	if !bytes.Equal(req.Canonical, prefix.CanonicalChat(req.Messages)) {
		t.Fatal("canonical prompt is not prefix.CanonicalChat of the messages")
	}
}

func TestStringAndArrayContentHashAlike(t *testing.T) {
	a := parse(t, "", `{"model":"m","messages":[{"role":"user","content":"hello world"}]}`)
	b := parse(t, "", `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hello "},{"type":"text","text":"world"}]}]}`)
	if !bytes.Equal(a.Canonical, b.Canonical) {
		t.Fatal("string content and the same text as parts hash differently")
	}
}

func TestToolTurnsCountTowardsPrefix(t *testing.T) {
	a := parse(t, "", `{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"1","content":"42"}]}`)
	b := parse(t, "", `{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"2","type":"function","function":{"name":"g","arguments":"{}"}}]},{"role":"tool","tool_call_id":"2","content":"42"}]}`)
	if bytes.Equal(a.Canonical, b.Canonical) {
		t.Fatal("different tool calls hash alike")
	}
}

func TestParseCompletion(t *testing.T) {
	for body, want := range map[string]string{
		`{"model":"m","prompt":"once upon"}`:               "once upon",
		`{"model":"m","prompt":["first","second"]}`:        "first",
		`{"model":"m","prompt":[1,2,30]}`:                  "1 2 30 ",
		`{"model":"m","prompt":[[7,8],[9]]}`:               "7 8 ",
		`{"model":"m","prompt":"a\u001eb","stream":false}`: "a\x1eb",
	} {
		req := parse(t, "/v1/completions", body)
		if req.Kind != transcode.Completion || req.Prompt != want {
			t.Errorf("%s: kind %v prompt %q, want %q", body, req.Kind, req.Prompt, want)
		}
		if !bytes.Equal(req.Canonical, prefix.CanonicalCompletion(want)) {
			t.Errorf("%s: canonical mismatch", body)
		}
	}
	// Without a path the body decides.
	if req := parse(t, "", `{"model":"m","prompt":"x"}`); req.Kind != transcode.Completion {
		t.Fatal("completion not inferred")
	}
}

func TestSelectorAndLoRA(t *testing.T) {
	req := parse(t, "", `{"model":"m","prompt":"x","label_selector":{"pool":"a"},"lora":"sql-adapter"}`)
	if req.LoRA != "sql-adapter" || req.Selector["pool"] != "a" || req.Selector[LoRALabel] != "sql-adapter" {
		t.Fatalf("selector = %v lora = %q", req.Selector, req.LoRA)
	}
	if req := parse(t, "", `{"model":"m","prompt":"x"}`); req.Selector != nil {
		t.Fatalf("selector without asking: %v", req.Selector)
	}
}

func TestParseErrors(t *testing.T) {
	cases := []struct {
		path, body string
		status     int
		want       string
	}{
		{"", ``, 400, "empty request body"},
		{"", `[1]`, 400, "must be an object"},
		{"", `{"model":"m",`, 400, "invalid JSON: unexpected end of JSON input"},
		{"", `{"messages":[{"role":"user","content":"x"}]}`, 400, `missing required field "model"`},
		{"", `{"model":"","prompt":"x"}`, 400, `"model" must not be empty`},
		{"", `{"model":7,"prompt":"x"}`, 400, `field "model" must be a string`},
		{"", `{"model":"m"}`, 400, `missing required field "messages" or "prompt"`},
		{"", `{"model":"m","prompt":"x","messages":[]}`, 400, `both "messages" and "prompt"`},
		{"/v1/chat/completions", `{"model":"m","prompt":"x"}`, 400, `missing required field "messages"`},
		{"/v1/completions", `{"model":"m","messages":[{"role":"user","content":"x"}]}`, 400, `missing required field "prompt"`},
		{"/v1/chat/completions", `{"model":"m","messages":[]}`, 400, `"messages" must not be empty`},
		{"", `{"model":"m","messages":[{"content":"x"}]}`, 400, "messages[0].role is required"},
		{"", `{"model":"m","messages":[{"role":"user","content":5}]}`, 400, `field "messages[0].content" must be a string, an array of parts or null`},
		{"", `{"model":"m","messages":[{"role":"user","content":[{"text":"x"}]}]}`, 400, "messages[0].content[0]: missing part type"},
		{"", `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]}`, 400, "image_url part without"},
		{"", `{"model":"m","messages":[{"role":"user","content":[{"type":"text"}]}]}`, 400, "text part without"},
		{"", `{"model":"m","stream":"yes","prompt":"x"}`, 400, `field "stream" must be a boolean`},
		{"", `{"model":"m","prompt":{}}`, 400, `field "prompt" must be a string, an array of strings or token ids`},
		{"", `{"model":"m","prompt":[]}`, 400, `"prompt" must not be empty`},
		{"", `{"model":"m","prompt":[true]}`, 400, `field "prompt" must be a string`},
		{"", `{"model":"m","prompt":[1,"a"]}`, 400, `field "prompt" must be a string`},
		{"", `{"model":"m","prompt":[1.5]}`, 400, `field "prompt" must be a string`},
		{"", `{"model":"m","prompt":[[]]}`, 400, `field "prompt" must be a string`},
		{"", `{"model":"m","prompt":"x"} x`, 400, "invalid JSON: invalid character 'x' after top-level value"},
		{"", `{"model":"m","prompt":"x",}`, 400, "invalid JSON"},
		{"", `{"model":"m","prompt":""}`, 400, "invalid JSON: control character"},
		{"", `{"model":"m","prompt":"\q"}`, 400, "invalid JSON: invalid escape"},
		{"", `{"model":"m","prompt":"x","n":01}`, 400, "invalid JSON"},
		{"", `{"model":"m","stream":"yes","prompt":"x"`, 400, "invalid JSON: unexpected end"},
		{"", strings.Repeat("[", 2000), 400, "invalid JSON: exceeded max depth"},
		{"", `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":"u"}]}]}`, 400, `field "messages[0].content[0].image_url" must be an object`},
		{"", `{"model":"m","prompt":"x","label_selector":{"a":null}}`, 400, `field "label_selector.a" must be a string`},
		{"", `{"model":"m","prompt":"x","label_selector":["a"]}`, 400, "label_selector"},
		{"", `{"model":"m","prompt":"x","label_selector":{"lora":"a"},"lora":"b"}`, 400, "contradicts"},
		{"/v1/files", `{"purpose":"batch"}`, 404, "unsupported path"},
		{"/v1/models/x", `not json`, 404, "unsupported path"},
		{"/v1/embeddings", `{"input":"x"}`, 400, `missing required field "model"`},
		{"/v1/responses", `{"model":7,"input":"x"}`, 400, `field "model" must be a string`},
		{"/v1/messages", `{"model":"m","messages":[}`, 400, "invalid JSON"},
		{"/v1/messages", ``, 400, "empty request body"},
		{"/v1/rerank", `["m"]`, 400, "must be an object"},
		{"/v1/score", `{"model":"m","text_1":"a","label_selector":["x"]}`, 400, "label_selector"},
		{"/v1/audio/transcriptions", `{"model":"m"}`, 400, "multipart/form-data"},
	}
	for _, c := range cases {
		_, err := New().Parse(c.path, []byte(c.body))
		var te *transcode.Error
		if !errors.As(err, &te) {
			t.Errorf("%s %s: err = %v, want *transcode.Error", c.path, c.body, err)
			continue
		}
		if te.Status != c.status || !strings.Contains(te.Message, c.want) {
			t.Errorf("%s %s: got %d %q, want %d containing %q", c.path, c.body, te.Status, te.Message, c.status, c.want)
		}
		if (te.Status == 400) != (te.Type == transcode.TypeBadRequest) {
			t.Errorf("%s: status %d with type %q", c.body, te.Status, te.Type)
		}
	}
}

func TestUpstreamPassThroughAndTriton(t *testing.T) {
	req := parse(t, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	for _, backend := range []string{"vllm", "sglang", "llamacpp"} {
		up, err := New().Upstream(req, backend)
		if err != nil || up.Body != nil || up.Path != "" || up.Response != nil {
			t.Fatalf("%s: not a pass-through: %+v %v", backend, up, err)
		}
	}
	up, err := New().Upstream(req, "triton")
	if err != nil || up.Path != "/v2/models/m/generate" || up.Response == nil {
		t.Fatalf("triton: %+v %v", up, err)
	}
}

// FuzzParse checks the parser never panics, refuses only with a
// *transcode.Error of status 400/404, and that what it accepts is consistent.
func FuzzParse(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"u"}}]}],"stream":true}`,
		`{"model":"m","prompt":[1,2]}`,
		`{"model":"m","prompt":["a","b"],"lora":"x","label_selector":{"k":"v"}}`,
		`{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[]}]}`,
	} {
		f.Add("", []byte(s))
		f.Add("/v1/chat/completions", []byte(s))
	}
	f.Fuzz(func(t *testing.T, path string, body []byte) {
		req, err := New().Parse(path, body)
		if err != nil {
			var te *transcode.Error
			if !errors.As(err, &te) || (te.Status != 400 && te.Status != 404) || te.Message == "" {
				t.Fatalf("bad error %#v", err)
			}
			return
		}
		if req.Model == "" || !json.Valid(body) {
			t.Fatalf("accepted without model or invalid JSON: %q", body)
		}
		pre := prefix.AppendPreamble(nil, req.Preamble)
		switch {
		case req.Kind == transcode.Chat:
			if len(req.Messages) == 0 || !bytes.Equal(req.Canonical, prefix.AppendCanonicalChat(pre, req.Messages)) {
				t.Fatal("chat without messages or with a stray canonical form")
			}
		case req.Kind == transcode.Completion:
			if !bytes.Equal(req.Canonical, prefix.AppendCanonicalCompletion(pre, req.Prompt)) {
				t.Fatal("completion canonical mismatch")
			}
		case req.Kind == transcode.Other || req.Kind == transcode.Audio:
			// Routed by their model and load: nothing to hash.
			if req.HasPrompt() || len(req.Canonical) > 0 {
				t.Fatalf("%v request with a prompt: %q", req.Kind, req.Canonical)
			}
		case req.Kind.Conversational() || req.Kind == transcode.Embeddings:
			if req.HasPrompt() != (len(req.Canonical) > 0) {
				t.Fatalf("%v: prompt %v, canonical %q", req.Kind, req.HasPrompt(), req.Canonical)
			}
		default:
			t.Fatalf("kind %v", req.Kind)
		}
		// The lazy mode renders the same bytes on demand.
		lazy, err := Transcoder{LazyCanonical: true}.Parse(path, body)
		if err != nil || lazy.Canonical != nil || !bytes.Equal(lazy.AppendCanonical([]byte("x"))[1:], req.Canonical) {
			t.Fatalf("lazy canonical differs: %v", err)
		}
	})
}

func BenchmarkParseChat8KiB(b *testing.B) {
	body := []byte(`{"model":"qwen","stream":true,"messages":[{"role":"system","content":"` + strings.Repeat("You are a helpful assistant. ", 40) +
		`"},{"role":"user","content":"` + strings.Repeat("Explain prefix caching in detail. ", 210) + `"}]}`)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := New().Parse("/v1/chat/completions", body); err != nil {
			b.Fatal(err)
		}
	}
}

func FuzzUnquoteMatchesJSON(f *testing.F) {
	for _, s := range []string{"plain", "tab\tnew\nline", `q"uote\`, "é中😀", "\xff\xfe", "a\u0000b"} {
		b, _ := json.Marshal(s)
		f.Add(b)
	}
	f.Add([]byte(`"\ud83d\ude00 \ud83d x \ude00 \u00e9"`))
	f.Add([]byte("\"raw \xff bytes\""))
	f.Fuzz(func(t *testing.T, lit []byte) {
		lit = bytes.TrimSpace(lit) // the decoder hands UnmarshalJSON the bare token
		var want string
		if json.Unmarshal(lit, &want) != nil || len(lit) == 0 || lit[0] != '"' {
			return
		}
		if got := unquote(lit); got != want {
			t.Fatalf("unquote(%q) = %q, json says %q", lit, got, want)
		}
	})
}

func TestCanonicalHelper(t *testing.T) {
	body := []byte(`{"model":"tiny","messages":[{"role":"user","content":"hi"}]}`)
	model, canon, err := Canonical("/v1/chat/completions", body)
	req := parse(t, "/v1/chat/completions", string(body))
	if err != nil || model != "tiny" || !bytes.Equal(canon, req.Canonical) {
		t.Fatalf("%q %q %v", model, canon, err)
	}
	if _, _, err := Canonical("", []byte(`{}`)); err == nil {
		t.Fatal("bad body accepted")
	}
}

func BenchmarkUnquote8KiB(b *testing.B) {
	s := strings.Repeat("Explain \"prefix caching\" in detail.\n Über 模型 ", 160)
	lit, _ := json.Marshal(s)
	b.SetBytes(int64(len(lit)))
	b.ReportAllocs()
	for b.Loop() {
		if unquote(lit) != s {
			b.Fatal("mismatch")
		}
	}
}

func TestSWAR(t *testing.T) {
	for v := 0; v < 256; v++ {
		for pos := 0; pos < 8; pos++ {
			var w [8]byte
			for i := range w {
				w[i] = 'a'
			}
			w[pos] = byte(v)
			x := uint64(0)
			for i := 7; i >= 0; i-- {
				x = x<<8 | uint64(w[i])
			}
			if got, want := strWordSpecial(x), strByteSpecial(byte(v)); got != want {
				t.Fatalf("strWordSpecial byte %#x at %d = %v", v, pos, got)
			}
			if got, want := unqWordSpecial(x), unqByteSpecial(byte(v)); got != want {
				t.Fatalf("unqWordSpecial byte %#x at %d = %v", v, pos, got)
			}
		}
	}
	// strSpecialMask must name the first special byte whatever follows it
	// (the bits above it may be wrong): words of plain and special bytes.
	pick := []byte{'a', 'z', ' ', '~', 0x20, 0x21, 0x5b, 0x5d, '"', '\\', 0x00, 0x1f, 0x7f, 0x80, 0xc3, 0xff}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200000 {
		var w [8]byte
		for i := range w {
			w[i] = pick[rng.IntN(len(pick))]
		}
		first := -1
		for i, c := range w {
			if strByteSpecial(c) {
				first = i
				break
			}
		}
		m := strSpecialMask(binary.LittleEndian.Uint64(w[:]))
		if got := bits.TrailingZeros64(m) >> 3; first < 0 && m != 0 || first >= 0 && got != first {
			t.Fatalf("strSpecialMask(%q) = %#x, first special byte at %d", w, m, first)
		}
	}
	for _, s := range []string{"", "abc", "abcdefgh", "abcdefghijklmnop\"x", "0123456789abcdef0123\\", "é", strings.Repeat("x", 37) + "\x01"} {
		want := strings.IndexFunc(s, func(r rune) bool { return r == '"' || r == '\\' || r < 0x20 || r >= 0x80 })
		if want < 0 {
			want = len(s)
		}
		if got := strPlainRun([]byte(s)); got != want {
			t.Fatalf("strPlainRun(%q) = %d, want %d", s, got, want)
		}
		wantU := strings.IndexFunc(s, func(r rune) bool { return r == '\\' || r >= 0x80 })
		if wantU < 0 {
			wantU = len(s)
		}
		if got := unqPlainRun([]byte(s)); got != wantU {
			t.Fatalf("unqPlainRun(%q) = %d, want %d", s, got, wantU)
		}
	}
}
