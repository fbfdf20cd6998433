package openai

import (
	"bytes"
	"fmt"
	"reflect"
	"strings"
	"testing"
)

// textSeeds are bodies whose prompt texts exercise every branch of
// decodeString: escapes, surrogate pairs (good, lone, followed by a
// malformed \u), invalid UTF-8, and each syntax error inside a text.
var textSeeds = []string{
	`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
	`{"model":"m","messages":[{"role":"system","content":"a\n\"b\"\\c\/d\b\f\r\t é中😀"},{"role":"user","content":[{"type":"text","text":"x\u00e9\ud83d\ude00y"}]}]}`,
	`{"model":"m","messages":[{"role":"user","content":"lone \ud83d x \ude00 \ud83d\u0041 end\ud83d"}]}`,
	`{"model":"m","messages":[{"role":"user","content":"pair broken \ud83d\u12zz"}]}`,
	`{"model":"m","messages":[{"role":"user","content":"bad \q escape"}]}`,
	`{"model":"m","messages":[{"role":"user","content":"short \u12"}]}`,
	`{"model":"m","messages":[{"role":"user","content":"ctrl ` + "\x01" + `"}]}`,
	`{"model":"m","messages":[{"role":"user","content":"unterminated`,
	`{"model":"m","messages":[{"role":"user","content":"ends in escape \`,
	"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"raw \xff\xfe bytes \xe4\xb8\"}]}",
	"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"valid \xc3\xbc then long enough to copy words: \xe4\xb8\xad\xe6\x96\x87 ok \\n \xe4\xb8 cut \xe4\\u00e9 \xff end\"}]}",
	"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xc3\xbc\xe4\xb8\xad all valid, words after words \\\"q\\\" \xf0\x9f\x98\x80\"},{\"role\":\"user\",\"content\":\"\xed\xa0\x80 surrogate bytes\"}]}",
	`{"model":"m","prompt":"completion \"text\"\n"}`,
	`{"model":"m","prompt":["first \n","second \q"]}`,
	`{"model":"m","prompt":["first \n","second"]}`,
	`{"model":"m","messages":[{"role":"user","content":""},{"role":"user","content":[{"type":"text","text":""}]}]}`,
	`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":5}]}]}`,
}

// FuzzTextsMatchStrings holds the pooled, one-pass text decoding to the
// plain one: the same body or the same error (message and offset).
func FuzzTextsMatchStrings(f *testing.F) {
	for _, s := range textSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		want, werr := decodeBody(raw)
		buf := []byte("keep") // decoding appends: what was there stays
		got, gerr := decodeBodyTexts(raw, &buf)
		if fmt.Sprint(gerr) != fmt.Sprint(werr) {
			t.Fatalf("%q: pooled err %v, plain err %v", raw, gerr, werr)
		}
		if !bytes.HasPrefix(buf, []byte("keep")) {
			t.Fatalf("%q: the buffer's earlier contents changed", raw)
		}
		if werr == nil && !reflect.DeepEqual(got, want) {
			t.Fatalf("%q:\n pooled %s\n plain  %s", raw, dump(got), dump(want))
		}
	})
}

func TestParseBuffered(t *testing.T) {
	tr := Transcoder{LazyCanonical: true}
	for _, s := range textSeeds {
		for _, path := range []string{"", "/v1/chat/completions", "/v1/completions"} {
			want, werr := tr.Parse(path, []byte(s))
			buf := []byte("keep")
			got, gerr := tr.ParseBuffered(path, []byte(s), &buf)
			if fmt.Sprint(gerr) != fmt.Sprint(werr) {
				t.Fatalf("%s %q: buffered err %v, plain err %v", path, s, gerr, werr)
			}
			if !bytes.HasPrefix(buf, []byte("keep")) {
				t.Fatalf("%q: the buffer's earlier contents changed", s)
			}
			if werr != nil {
				continue
			}
			if !bytes.Equal(got.AppendCanonical(nil), want.AppendCanonical(nil)) ||
				!reflect.DeepEqual(got.Messages, want.Messages) || got.Prompt != want.Prompt || got.Model != want.Model {
				t.Fatalf("%q: buffered request differs", s)
			}
		}
	}
}

// TestParseBufferedReuse parses different bodies through one reused
// buffer, as the engine does: each request reads its own texts while it is
// in use.
func TestParseBufferedReuse(t *testing.T) {
	var buf []byte
	bodies := make([]string, 8)
	for i := range bodies {
		bodies[i] = fmt.Sprintf(`{"model":"m","messages":[{"role":"system","content":"%s\n%d"},{"role":"user","content":"%s"}]}`,
			strings.Repeat("sys ", 100+i*37), i, strings.Repeat(fmt.Sprintf("u%d\\t é", i), 50+i*11))
	}
	for round := 0; round < 3; round++ {
		for i, body := range bodies {
			want, err := Transcoder{}.Parse("", []byte(body))
			if err != nil {
				t.Fatal(err)
			}
			req, err := Transcoder{LazyCanonical: true}.ParseBuffered("", []byte(body), &buf)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(req.AppendCanonical(nil), want.Canonical) {
				t.Fatalf("round %d body %d: canonical differs from an unbuffered parse", round, i)
			}
			buf = buf[:0]
		}
	}
}

// TestParseBufferedAllocations: with a warm buffer, a long prompt costs no
// allocation of its own.
func TestParseBufferedAllocations(t *testing.T) {
	mk := func(s string) []byte {
		return []byte(`{"model":"m","messages":[{"role":"user","content":"` + s + `"},{"role":"user","content":"` + s + `"}]}`)
	}
	short, long := mk("hi"), mk(strings.Repeat(`prompt \"text\" with escapes\n and é `, 200))
	tr := Transcoder{LazyCanonical: true}
	buf := make([]byte, 0, 2*len(long))
	allocs := func(body []byte) float64 {
		return testing.AllocsPerRun(50, func() {
			if _, err := tr.ParseBuffered("", body, &buf); err != nil {
				t.Fatal(err)
			}
			buf = buf[:0]
		})
	}
	if a, b := allocs(short), allocs(long); a != b {
		t.Fatalf("buffered parse: %v allocations for short texts, %v for long ones: the texts allocate", a, b)
	}
	plain := testing.AllocsPerRun(50, func() {
		if _, err := tr.Parse("", long); err != nil {
			t.Fatal(err)
		}
	})
	if buffered := allocs(long); buffered >= plain {
		t.Fatalf("buffered parse allocates %v times, plain %v", buffered, plain)
	}
}
