package openai

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// feedBytes sends s one byte per piece, as a byte-level model emits it.
func feedBytes(d *TextDecoder, s string) (outs []string) {
	for i := 0; i < len(s); i++ {
		outs = append(outs, d.Add(s[i:i+1]))
	}
	return append(outs, d.Flush())
}

func TestTextDecoderNeverSplitsCharacters(t *testing.T) {
	text := "aé你好👍🏽z\u2581"
	var d TextDecoder
	outs := feedBytes(&d, text)
	if got := strings.Join(outs, ""); got != text {
		t.Fatalf("joined %q, want %q", got, text)
	}
	for i, o := range outs {
		if !utf8.ValidString(o) {
			t.Fatalf("piece %d emitted partial UTF-8 %q", i, o)
		}
	}
	// Every split point of every multi-byte character, in two pieces.
	for cut := 0; cut <= len(text); cut++ {
		var d TextDecoder
		a, b := d.Add(text[:cut]), d.Add(text[cut:])
		if !utf8.ValidString(a) || a+b+d.Flush() != text {
			t.Fatalf("cut %d: %q + %q", cut, a, b)
		}
	}
	// Held bytes are reported, and released once the character completes.
	var h TextDecoder
	if out := h.Add("\xf0\x9f"); out != "" || h.Pending() != 2 {
		t.Errorf("partial emoji: out %q pending %d", out, h.Pending())
	}
	if out := h.Add("\x91\x8d!"); out != "👍!" || h.Pending() != 0 {
		t.Errorf("completed emoji: out %q pending %d", out, h.Pending())
	}
}

func TestTextDecoderInvalidBytes(t *testing.T) {
	const r = "\uFFFD"
	cases := []struct{ name, in, want string }{
		{"lone continuation", "a\x80b", "a" + r + "b"},
		{"invalid lead", "\xff\xfe", r + r},
		{"overlong", "\xc0\xaf", r + r},
		{"truncated then ascii", "\xe4\xbdx", r + "x"},
		{"truncated at end", "ok\xe4\xbd", "ok" + r},
		{"truncated emoji at end", "\xf0\x9f\x91", r},
		{"surrogate", "\xed\xa0\x80", r + r + r},
		{"above U+10FFFF", "\xf4\x90\x80\x80", r + r + r + r},
		{"E0 overlong", "\xe0\x80\x80", r + r + r},
		{"valid 4-byte max", "\xf4\x8f\xbf\xbf", "\U0010FFFF"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for _, pieces := range [][]string{{c.in}, splitBytes(c.in)} {
				var d TextDecoder
				var got strings.Builder
				for _, p := range pieces {
					got.WriteString(d.Add(p))
				}
				got.WriteString(d.Flush())
				if got.String() != c.want {
					t.Errorf("pieces %q: got %q, want %q", pieces, got.String(), c.want)
				}
			}
		})
	}
}

func splitBytes(s string) []string {
	out := make([]string, len(s))
	for i := 0; i < len(s); i++ {
		out[i] = s[i : i+1]
	}
	return out
}

// FuzzTextDecoder: how a byte string is cut into pieces never changes the
// text, and every emitted piece is valid UTF-8.
func FuzzTextDecoder(f *testing.F) {
	f.Add([]byte("h\xe4\xbd\xa0\xe5\xa5\xbd\xff\xf0\x9f"), uint8(3))
	f.Add([]byte("plain"), uint8(1))
	f.Fuzz(func(t *testing.T, data []byte, step uint8) {
		whole := new(TextDecoder)
		want := whole.Add(string(data)) + whole.Flush()
		if !utf8.ValidString(want) {
			t.Fatalf("invalid output %q", want)
		}
		n := int(step%7) + 1
		var d TextDecoder
		var got strings.Builder
		for i := 0; i < len(data); i += n {
			out := d.Add(string(data[i:min(i+n, len(data))]))
			if !utf8.ValidString(out) {
				t.Fatalf("piece emitted invalid UTF-8 %q", out)
			}
			got.WriteString(out)
		}
		got.WriteString(d.Flush())
		if got.String() != want {
			t.Fatalf("step %d: %q, whole: %q", n, got.String(), want)
		}
		if utf8.Valid(data) && want != string(data) {
			t.Fatalf("valid input changed: %q -> %q", data, want)
		}
	})
}

// stopAll pushes pieces through a matcher and returns everything emitted.
func stopAll(stops []string, pieces []string) (string, bool) {
	m := NewStopMatcher(stops)
	var b strings.Builder
	for _, p := range pieces {
		out, stopped := m.Push(p)
		b.WriteString(out)
		if stopped {
			return b.String(), true
		}
	}
	return b.String() + m.Flush(), false
}

// stopReference is the byte-by-byte answer: grow the text one byte at a
// time and cut at the first moment a stop sequence ends there.
func stopReference(stops []string, text string) (string, bool) {
	for end := 1; end <= len(text); end++ {
		best := -1
		for _, s := range stops {
			if s != "" && strings.HasSuffix(text[:end], s) && (best < 0 || end-len(s) < best) {
				best = end - len(s)
			}
		}
		if best >= 0 {
			return text[:best], true
		}
	}
	return text, false
}

func TestStopMatcherAcrossChunks(t *testing.T) {
	cases := []struct {
		name   string
		stops  []string
		pieces []string
		want   string
		stop   bool
	}{
		{"split stop", []string{"###"}, []string{"answer #", "#", "# tail"}, "answer ", true},
		{"false start released", []string{"###"}, []string{"a #", "# b", " c"}, "a ## b c", false},
		{"earliest wins", []string{"world", "lo w"}, []string{"hel", "lo wor", "ld"}, "hel", true},
		{"shorter completes first", []string{"abcd", "bc"}, []string{"a", "b", "c", "d"}, "a", true},
		{"shorter completes first in one piece", []string{"abcd", "bc"}, []string{"abcd"}, "a", true},
		{"same end, longer wins", []string{"cd", "abcd"}, []string{"xab", "cd"}, "x", true},
		{"multi-byte stop", []string{"你好"}, []string{"说你", "好吗"}, "说", true},
		{"newline stop", []string{"\n\n"}, []string{"line\n", "\nnext"}, "line", true},
		{"no stops", nil, []string{"a", "b"}, "ab", false},
		{"stop at very start", []string{"<"}, []string{"<x"}, "", true},
		{"partial at end flushed", []string{"END"}, []string{"the E", "N"}, "the EN", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, stopped := stopAll(c.stops, c.pieces)
			if got != c.want || stopped != c.stop {
				t.Errorf("got %q stopped=%v, want %q stopped=%v", got, stopped, c.want, c.stop)
			}
			ref, refStopped := stopReference(c.stops, strings.Join(c.pieces, ""))
			if got != ref || stopped != refStopped {
				t.Errorf("disagrees with the one-shot reference %q %v", ref, refStopped)
			}
		})
	}
}

func TestStopMatcherHoldsOnlyPossiblePrefixes(t *testing.T) {
	m := NewStopMatcher([]string{"STOP"})
	if out, _ := m.Push("ab ST"); out != "ab " {
		t.Errorf("emitted %q, want the text before the possible stop", out)
	}
	if out, _ := m.Push("x"); out != "STx" {
		t.Errorf("released %q", out)
	}
	if out, stopped := m.Push("STOP and more"); out != "" || !stopped || !m.Stopped() {
		t.Errorf("got %q %v", out, stopped)
	}
	if out, stopped := m.Push("later"); out != "" || !stopped || m.Flush() != "" {
		t.Errorf("after stop: %q %v", out, stopped)
	}
}

// FuzzStopMatcher: streamed matching equals the one-shot reference however
// the text is chunked.
func FuzzStopMatcher(f *testing.F) {
	f.Add("hello ### world", "###", "wor", uint8(2))
	f.Add("aaab", "aab", "b", uint8(1))
	f.Fuzz(func(t *testing.T, text, s1, s2 string, step uint8) {
		stops := []string{s1, s2}
		n := int(step%9) + 1
		var pieces []string
		for i := 0; i < len(text); i += n {
			pieces = append(pieces, text[i:min(i+n, len(text))])
		}
		got, stopped := stopAll(stops, pieces)
		want, wantStopped := stopReference(stops, text)
		if got != want || stopped != wantStopped {
			t.Fatalf("pieces %q stops %q: got %q %v, want %q %v", pieces, stops, got, stopped, want, wantStopped)
		}
	})
}
