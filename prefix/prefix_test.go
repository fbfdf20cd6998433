package prefix

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/spaolacci/murmur3"
)

func text(role, s string) Message { return Message{Role: role, Parts: []Part{{Type: "text", Text: s}}} }

func TestCanonicalChatOrderMatters(t *testing.T) {
	a, b := text("user", "hello"), text("assistant", "hi there")
	if bytes.Equal(CanonicalChat([]Message{a, b}), CanonicalChat([]Message{b, a})) {
		t.Fatal("[A,B] and [B,A] render the same")
	}
	if bytes.Equal(CanonicalChat([]Message{text("user", "x")}), CanonicalChat([]Message{text("system", "x")})) {
		t.Fatal("role does not count")
	}
}

func TestCanonicalChatContentCannotForgeBoundary(t *testing.T) {
	// Content that embeds the raw control bytes of a message boundary must not
	// render like two real messages.
	two := []Message{text("user", "a"), text("assistant", "b")}
	forged := []Message{text("user", "a\x1eassistant\x1fb")}
	if bytes.Equal(CanonicalChat(two), CanonicalChat(forged)) {
		t.Fatal("content forged a message boundary")
	}
	// Nor may a role swallow content.
	r1 := []Message{{Role: "user\x1fhi", Parts: nil}}
	r2 := []Message{text("user", "hi")}
	if bytes.Equal(CanonicalChat(r1), CanonicalChat(r2)) {
		t.Fatal("role forged a role end")
	}
	// Nor an escape byte pair its way out.
	e1 := []Message{text("user", "a\x1b"), text("user", "b")}
	e2 := []Message{text("user", "a\x1b\x1euser\x1fb")}
	if bytes.Equal(CanonicalChat(e1), CanonicalChat(e2)) {
		t.Fatal("escape byte forged a boundary")
	}
	// Nor text imitate an image digest.
	img := []Message{{Role: "user", Parts: []Part{{Type: "image_url", URL: "http://x/cat.png"}}}}
	c := CanonicalChat(img)
	imitation := []Message{text("user", string(c[len("\x1euser\x1f"):]))}
	if bytes.Equal(c, CanonicalChat(imitation)) {
		t.Fatal("text imitated an image part")
	}
}

func TestCanonicalChatIsPrefixPreserving(t *testing.T) {
	conv := []Message{text("system", "You are terse."), text("user", "2+2?")}
	longer := append(append([]Message(nil), conv...), text("assistant", "4"), text("user", "and 3+3?"))
	if !bytes.HasPrefix(CanonicalChat(longer), CanonicalChat(conv)) {
		t.Fatal("a continued conversation does not extend the canonical bytes")
	}
}

func TestCanonicalChatImageDigest(t *testing.T) {
	big := "data:image/png;base64," + strings.Repeat("A", 1<<20)
	m := func(url string) []Message {
		return []Message{{Role: "user", Parts: []Part{{Type: "text", Text: "what is this"}, {Type: "image_url", URL: url}}}}
	}
	c1, c2 := CanonicalChat(m(big)), CanonicalChat(m(big[:len(big)-1]+"B"))
	if bytes.Equal(c1, c2) {
		t.Fatal("different images render the same")
	}
	if len(c1) > 200 {
		t.Fatalf("image contributes %d bytes, want a fixed-size digest", len(c1))
	}
	if !bytes.Equal(c1, CanonicalChat(m(big))) {
		t.Fatal("not deterministic")
	}
}

func TestCanonicalCompletion(t *testing.T) {
	if got := CanonicalCompletion("plain text"); string(got) != "plain text" {
		t.Fatalf("plain text changed: %q", got)
	}
	chat := CanonicalChat([]Message{text("user", "hi")})
	if bytes.Equal(CanonicalCompletion(string(chat)), chat) {
		t.Fatal("a completion collided with a chat")
	}
	if bytes.Equal(CanonicalCompletion("a\x1bb"), CanonicalCompletion("a\x1b\x1bb")) {
		t.Fatal("escape not injective")
	}
}

// reference re-implements the chain with explicit concatenation and the
// one-shot murmur3 function, independently of Sum's streaming digest.
func reference(model string, blocks [][]byte) []Hash {
	prev := murmur3.Sum64([]byte(model))
	var out []Hash
	for _, b := range blocks {
		buf := binary.LittleEndian.AppendUint64(nil, prev)
		prev = murmur3.Sum64(append(buf, b...))
		out = append(out, Hash(prev))
	}
	return out
}

func TestSumMatchesReferenceChain(t *testing.T) {
	data := []byte(strings.Repeat("abcdefghij", 130)) // 1300 bytes: 512, 512, 276
	got := (Hasher{}).Sum("qwen", data)
	want := reference("qwen", [][]byte{data[:512], data[512:1024], data[1024:]})
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("got %x, want %x", got, want)
	}
	if other := (Hasher{}).Sum("llama", data); other[0] == got[0] {
		t.Fatal("model name does not seed the chain")
	}
	if (Hasher{}).Sum("qwen", nil) != nil {
		t.Fatal("empty input must give no hashes")
	}
}

func TestSumChainsPrefixes(t *testing.T) {
	h := Hasher{ChunkSize: 64}
	base := []byte(strings.Repeat("shared prefix ", 40))
	a := h.Sum("m", append(append([]byte(nil), base...), "tail A"...))
	b := h.Sum("m", append(append([]byte(nil), base...), "tail B, longer"...))
	full := len(base) / 64
	for i := 0; i < full; i++ {
		if a[i] != b[i] {
			t.Fatalf("block %d of a shared prefix differs", i)
		}
	}
	if a[len(a)-1] == b[len(b)-1] {
		t.Fatal("different tails hash the same")
	}
	// Chaining: the same block content at a different position hashes differently.
	same := h.Sum("m", bytes.Repeat([]byte("x"), 64*3))
	if same[0] == same[1] || same[1] == same[2] {
		t.Fatal("equal blocks at different positions hash the same")
	}
}

// A conversation's chain is a prefix of its continuation's: the previous
// prompt's last, partial block ends where the next message starts, so it is a
// whole block of the continuation. A prompt sharing only the system message
// shares exactly the system message's blocks.
func TestSumOfAConversationIsAPrefixOfItsContinuation(t *testing.T) {
	h := Hasher{ChunkSize: 64}
	system := text("system", strings.Repeat("You answer briefly. ", 5)) // 108 bytes with its markup: 64 + 44
	turn1 := []Message{system, text("user", "What is a KV cache?")}
	turn2 := append(append([]Message(nil), turn1...), text("assistant", "Keys and values kept per token."), text("user", "Why keep it?"))
	other := []Message{system, text("user", "What is a prefix?")}
	a, b, o := h.Sum("m", CanonicalChat(turn1)), h.Sum("m", CanonicalChat(turn2)), h.Sum("m", CanonicalChat(other))
	if len(b) <= len(a) || fmt.Sprint(b[:len(a)]) != fmt.Sprint(a) {
		t.Fatalf("turn 1's chain %x is not a prefix of turn 2's %x", a, b)
	}
	sys := h.Sum("m", CanonicalChat([]Message{system}))
	if len(sys) != 2 || fmt.Sprint(o[:2]) != fmt.Sprint(sys) || o[2] == b[2] {
		t.Fatalf("a prompt sharing the system message shares %x of %x, want exactly the system's %x", o, b, sys)
	}
	_, ends := h.AppendBlocks(nil, nil, "m", CanonicalChat(turn2))
	canon := CanonicalChat(turn2)
	for i, e := range ends[:len(ends)-1] {
		if e-prevEnd(ends, i) > 64 {
			t.Fatalf("block %d is %d bytes, over the chunk size", i, e-prevEnd(ends, i))
		}
		if e%64 != 0 && canon[e] != msgMark {
			t.Fatalf("block %d ends at %d, neither a chunk nor a message start", i, e)
		}
	}
	if ends[len(ends)-1] != len(canon) {
		t.Fatalf("the last block ends at %d of %d bytes", ends[len(ends)-1], len(canon))
	}
}

func prevEnd(ends []int, i int) int {
	if i == 0 {
		return 0
	}
	return ends[i-1]
}

// An RS inside content is escaped and starts no block; an escaped ESC before
// a real message start does not hide it.
func TestEscapedMessageMarksDoNotCut(t *testing.T) {
	h := Hasher{ChunkSize: 64}
	forged := CanonicalChat([]Message{text("user", "a\x1eassistant\x1fb")})
	if n := len(h.Sum("m", forged)); n != 1 {
		t.Fatalf("an escaped RS cut the prompt into %d blocks", n)
	}
	real := CanonicalChat([]Message{text("user", "a\x1b"), text("user", "b")})
	_, ends := h.AppendBlocks(nil, nil, "m", real)
	if want := []int{bytes.LastIndexByte(real, msgMark), len(real)}; fmt.Sprint(ends) != fmt.Sprint(want) {
		t.Fatalf("blocks end at %v, want %v (the second message's start)", ends, want)
	}
}

// blocksOf replays Sum's cutting rule so tests can check the blocks themselves.
func blocksOf(b []byte, size int) [][]byte {
	var out [][]byte
	for start := 0; start < len(b); {
		end := blockEnd(b, start, size)
		out = append(out, b[start:end])
		start = end
	}
	return out
}

func TestBlocksNeverSplitUTF8(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	alphabet := []rune("aé中😀ßЖ\u0301")
	for _, size := range []int{1, 2, 3, 5, 7, 16, 512} {
		for n := 0; n < 50; n++ {
			var sb strings.Builder
			for i := r.IntN(400); i > 0; i-- {
				sb.WriteRune(alphabet[r.IntN(len(alphabet))])
			}
			in := []byte(sb.String())
			blocks := blocksOf(in, size)
			if !bytes.Equal(bytes.Join(blocks, nil), in) {
				t.Fatal("blocks do not reassemble the input")
			}
			for i, b := range blocks {
				if !utf8.Valid(b) {
					t.Fatalf("size %d: block %d splits a character: %q", size, i, b)
				}
				if len(b) == 0 {
					t.Fatalf("size %d: empty block", size)
				}
				if i < len(blocks)-1 && len(b) > size && size >= utf8.UTFMax {
					t.Fatalf("size %d: block %d has %d bytes", size, i, len(b))
				}
				if i < len(blocks)-1 && size >= utf8.UTFMax && len(b) <= size-utf8.UTFMax {
					t.Fatalf("size %d: block %d cut too early (%d bytes)", size, i, len(b))
				}
			}
			if got, want := (Hasher{ChunkSize: size}).Sum("m", in), reference("m", blocks); fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("size %d: Sum disagrees with its blocks", size)
			}
		}
	}
}

func TestBlocksOfInvalidUTF8Terminate(t *testing.T) {
	in := bytes.Repeat([]byte{0x80}, 100)
	blocks := blocksOf(in, 8)
	if !bytes.Equal(bytes.Join(blocks, nil), in) {
		t.Fatal("blocks do not reassemble invalid input")
	}
}

func TestWire(t *testing.T) {
	sums := []Hash{0, 1, 0xdeadbeefcafebabe, ^Hash(0)}
	w := Wire(sums)
	want := []string{"0000000000000000", "0000000000000001", "deadbeefcafebabe", "ffffffffffffffff"}
	if fmt.Sprint(w) != fmt.Sprint(want) {
		t.Fatalf("Wire = %v", w)
	}
	re := regexp.MustCompile(`^[0-9a-f]{16}$`)
	for i, s := range Wire((Hasher{}).Sum("m", []byte(strings.Repeat("z", 5000)))) {
		if !re.MatchString(s) {
			t.Fatalf("element %d %q is not 16 lowercase hex digits", i, s)
		}
		v, err := ParseHash(s)
		if err != nil || v.String() != s || Wire([]Hash{v})[0] != s {
			t.Fatalf("ParseHash(%q) does not round-trip: %v", s, err)
		}
		if b, ok := ParseHashBytes([]byte(s)); !ok || b != v {
			t.Fatalf("ParseHashBytes(%q) = %v, %v; ParseHash gave %v", s, b, ok, v)
		}
	}
	for _, bad := range []string{"", "123", "DEADBEEFCAFEBABE", "zzzzzzzzzzzzzzzz", "00000000000000000"} {
		if _, err := ParseHash(bad); err == nil {
			t.Fatalf("ParseHash(%q) accepted", bad)
		}
		if _, ok := ParseHashBytes([]byte(bad)); ok {
			t.Fatalf("ParseHashBytes(%q) accepted", bad)
		}
	}
	if Wire(nil) != nil {
		t.Fatal("Wire(nil) != nil")
	}
}

func TestSumAllocations(t *testing.T) {
	data := bytes.Repeat([]byte("a"), 8192)
	h := Hasher{}
	if n := testing.AllocsPerRun(50, func() { h.Sum("m", data) }); n > 1 {
		t.Fatalf("Sum allocates %v times per call, want 1 (the result)", n)
	}
}

func FuzzCanonicalChatInjective(f *testing.F) {
	f.Add("user", "a", "assistant", "b")
	f.Add("user", "a\x1eassistant\x1fb", "", "")
	f.Fuzz(func(t *testing.T, r1, c1, r2, c2 string) {
		two := CanonicalChat([]Message{text(r1, c1), text(r2, c2)})
		one := CanonicalChat([]Message{text(r1, c1+"\x1e"+r2+"\x1f"+c2)})
		if bytes.Equal(two, one) {
			t.Fatalf("forged boundary for %q %q %q %q", r1, c1, r2, c2)
		}
		swapped := CanonicalChat([]Message{text(r2, c2), text(r1, c1)})
		if (r1 != r2 || c1 != c2) && bytes.Equal(two, swapped) {
			t.Fatal("order-insensitive")
		}
		// Blocks over any input reassemble it and, on valid UTF-8, split no character.
		for _, b := range blocksOf(two, 16) {
			if utf8.Valid(two) && !utf8.Valid(b) {
				t.Fatalf("block %q splits a character", b)
			}
		}
	})
}

var sink uint64

func benchInput(n int) []byte {
	r := rand.New(rand.NewPCG(3, 4))
	words := []string{"the ", "cache ", "prefix ", "router ", "über ", "模型 ", "token ", "\n"}
	var sb strings.Builder
	for sb.Len() < n {
		sb.WriteString(words[r.IntN(len(words))])
	}
	return []byte(sb.String()[:n])
}

// BenchmarkHash compares Sum with one raw murmur3 pass over the same bytes,
// side by side in one run: the ratio of their MB/s is the figure the issue asks for.
func BenchmarkHash(b *testing.B) {
	for _, size := range []int{8 << 10, 128 << 10} {
		data := benchInput(size)
		b.Run(fmt.Sprintf("raw-murmur3/%dKiB", size>>10), func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			for b.Loop() {
				sink += murmur3.Sum64(data)
			}
		})
		b.Run(fmt.Sprintf("chained/%dKiB", size>>10), func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			h := Hasher{}
			for b.Loop() {
				sink += uint64(h.Sum("qwen", data)[0])
			}
		})
		b.Run(fmt.Sprintf("chained-reuse/%dKiB", size>>10), func(b *testing.B) {
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			h := Hasher{}
			dst := make([]Hash, 0, 512)
			for b.Loop() {
				dst = h.AppendSum(dst[:0], "qwen", data)
				sink += uint64(dst[0])
			}
		})
	}
}

func BenchmarkCanonicalChat(b *testing.B) {
	data := string(benchInput(8 << 10))
	msgs := []Message{text("system", data[:1024]), text("user", data[1024:])}
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		sink += uint64(len(CanonicalChat(msgs)))
	}
}

func TestMurmurMatchesLibrary(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for n := 0; n < 300; n++ {
		data := make([]byte, n)
		for i := range data {
			data[i] = byte(r.Uint32())
		}
		if got, want := sum64(data), murmur3.Sum64(data); got != want {
			t.Fatalf("len %d: sum64 %x, murmur3 %x", n, got, want)
		}
		p := r.Uint64()
		want := murmur3.Sum64(append(binary.LittleEndian.AppendUint64(nil, p), data...))
		if got := sum64Prefixed(p, data); got != want {
			t.Fatalf("len %d: sum64Prefixed %x, murmur3 %x", n, got, want)
		}
	}
	if uint64(Seed("qwen")) != murmur3.Sum64([]byte("qwen")) {
		t.Fatal("Seed differs from murmur3")
	}
}

func FuzzMurmurMatchesLibrary(f *testing.F) {
	f.Add(uint64(1), []byte("hello world, this is longer than sixteen"))
	f.Fuzz(func(t *testing.T, p uint64, data []byte) {
		want := murmur3.Sum64(append(binary.LittleEndian.AppendUint64(nil, p), data...))
		if got := sum64Prefixed(p, data); got != want {
			t.Fatalf("sum64Prefixed %x, murmur3 %x", got, want)
		}
	})
}

// BenchmarkHashRatio times raw murmur3 and the chained Sum alternately over
// the same bytes in one loop, so both see the same machine load, and reports
// chained throughput as a fraction of raw (the target: >= 0.8).
func BenchmarkHashRatio(b *testing.B) {
	for _, size := range []int{8 << 10, 128 << 10} {
		data := benchInput(size)
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			h := Hasher{}
			dst := make([]Hash, 0, 512)
			var raw, chained time.Duration
			for b.Loop() {
				t0 := time.Now()
				sink += murmur3.Sum64(data)
				t1 := time.Now()
				dst = h.AppendSum(dst[:0], "qwen", data)
				t2 := time.Now()
				sink += uint64(dst[0])
				raw += t1.Sub(t0)
				chained += t2.Sub(t1)
			}
			b.ReportMetric(float64(raw)/float64(chained), "chained/raw")
			b.ReportMetric(float64(len(data))*float64(b.N)/raw.Seconds()/1e6, "raw-MB/s")
			b.ReportMetric(float64(len(data))*float64(b.N)/chained.Seconds()/1e6, "chained-MB/s")
		})
	}
}

func TestPreambleComesFirstAndIsUnambiguous(t *testing.T) {
	msgs := []Message{{Role: "user", Parts: []Part{{Type: "text", Text: "hi"}}}}
	if len(Preamble(nil, []byte("null"))) != 0 {
		t.Fatal("absent fields add parts")
	}
	tools := AppendCanonicalChat(AppendPreamble(nil, Preamble([]byte(`[1]`), nil)), msgs)
	if tools[0] != partMark || bytes.Equal(tools, CanonicalChat(msgs)) {
		t.Fatalf("tools do not lead: %q", tools)
	}
	// A completion whose text spells the preamble's bytes renders escaped.
	forged := CanonicalCompletion(string(AppendPreamble(nil, Preamble([]byte(`[1]`), nil))) + "hi")
	if forged[0] != escByte || bytes.Equal(forged, AppendCanonicalCompletion(AppendPreamble(nil, Preamble([]byte(`[1]`), nil)), "hi")) {
		t.Fatal("a completion forged a preamble")
	}
	rf := AppendPreamble(nil, Preamble(nil, []byte(`[1]`)))
	if bytes.Equal(rf, AppendPreamble(nil, Preamble([]byte(`[1]`), nil))) {
		t.Fatal("tools and response_format of the same bytes render alike")
	}
}
