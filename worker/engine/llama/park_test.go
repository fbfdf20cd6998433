package llama

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine"
	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

// Parked cells come back bit for bit: every way a cached entry is used
// again (taken over, its prefix copied into a fresh sequence, cut, copied
// from the middle) gives the greedy output of a cold run.
func TestParkedSequenceGivesTheSameGreedyOutput(t *testing.T) {
	e := open(t, 4096, 4)
	prompt, _ := e.Tokenize(strings.Repeat("the quick brown fox jumps over the lazy dog. ", 30), true)
	full := greedy(t, e, 0, prompt, 0, 16)
	e.Remove(0, 0)

	greedy(t, e, 0, prompt, 0, 16)
	e.Remove(0, len(prompt)) // an entry holding exactly the prompt
	e.Park(0)
	if !e.Parked(0) || e.ParkedBytes() == 0 || parkedTokens(e) != len(prompt) {
		t.Fatalf("seq 0 not parked (parked %v, %d bytes, %d tokens)", e.Parked(0), e.ParkedBytes(), parkedTokens(e))
	}

	// Adopted by copy: seq 1 starts from seq 0's state cut to len-1 cells.
	e.Copy(0, 1, 0, len(prompt)-1)
	if got := greedy(t, e, 1, prompt, len(prompt)-1, 16); !slices.Equal(full, got) {
		t.Fatalf("copied from a parked sequence:\ncold %v\ngot  %v", full, got)
	}
	if !e.Parked(0) {
		t.Fatal("the copy's source left host memory")
	}
	// In two ranges from a parked source: the second one restores it.
	e.Copy(0, 2, 0, 7)
	e.Copy(0, 2, 7, len(prompt)-1)
	if got := greedy(t, e, 2, prompt, len(prompt)-1, 16); !slices.Equal(full, got) {
		t.Fatalf("copied in two ranges from a parked sequence:\ncold %v\ngot  %v", full, got)
	}
	// Taken over: the same seq id, its tail cut while parked.
	e.Remove(0, len(prompt)-1)
	if got := greedy(t, e, 0, prompt, len(prompt)-1, 16); !slices.Equal(full, got) {
		t.Fatalf("a parked sequence taken over:\ncold %v\ngot  %v", full, got)
	}
	if e.Parked(0) {
		t.Fatal("seq 0 computed but still parked")
	}
	e.Remove(0, 0)
	e.Remove(1, 0)
	e.Remove(2, 0)
	if e.ParkedBytes() != 0 {
		t.Fatalf("%d bytes still parked after every sequence was removed", e.ParkedBytes())
	}
}

// A parked sequence frees its cells; bringing it back into a full cache is
// ErrKVFull (it stays parked), and works once there is room again.
func TestParkingFreesCellsAndRestoringNeedsRoom(t *testing.T) {
	e := open(t, 256, 2)
	toks := make([]int, 200)
	for i := range toks {
		toks[i] = 3 + 'a' + i%26
	}
	want := greedy(t, e, 0, toks, 0, 4)
	e.Remove(0, len(toks))
	e.Park(0)
	if _, err := e.Step([]engine.Span{{Seq: 1, Pos: 0, Tokens: toks}}); err != nil {
		t.Fatalf("200 cells after parking the other 200 of 256: %v", err)
	}
	s, _ := e.NewSampler(engine.SamplingParams{})
	_, err := e.Step([]engine.Span{{Seq: 0, Pos: len(toks) - 1, Tokens: toks[len(toks)-1:], Sampler: s}})
	if !errors.Is(err, engine.ErrKVFull) || !e.Parked(0) {
		t.Fatalf("restoring 200 cells into 56 free ones: err %v, parked %v; want ErrKVFull and still parked", err, e.Parked(0))
	}
	e.Remove(1, 0)
	e.Remove(0, len(toks)-1)
	if got := greedy(t, e, 0, toks, len(toks)-1, 4); !slices.Equal(want, got) {
		t.Fatalf("after making room: %v, want %v", got, want)
	}
}

// parkedTokens is how many cells the parked sequences would take in the
// KV cache, each counted whole.
func parkedTokens(e *Engine) int {
	n := 0
	for _, p := range e.parked {
		n += p.n
	}
	return n
}

// document is n tokens of lower-case letters (the test model's vocabulary
// is bytes, offset by 3).
func document(n int) []int {
	doc := make([]int, n)
	for i := range doc {
		doc[i] = 3 + 'a' + (i*7+i/26)%26
	}
	return doc
}

// Three questions about one parked document restore it once: the first
// request's restore writes its cells, the others share them. In a 512-cell
// cache that holds one 200-token copy and a second one at most, all three
// are served side by side with the cold run's greedy output, and the cache
// holds the document once.
func TestOneParkedPrefixIsRestoredOnceForEveryCopy(t *testing.T) {
	e := open(t, 512, 4)
	doc := document(200)
	question := func(q int) []int { return append(slices.Clone(doc), 3+'0'+q, 3+'?', 3+'0'+q) }
	var cold [][]int
	for q := range 3 {
		cold = append(cold, greedy(t, e, 0, question(q), 0, 4))
		e.Remove(0, 0)
	}
	greedy(t, e, 0, doc, 0, 1)
	e.Remove(0, len(doc))
	e.Park(0)
	for q := 1; q <= 3; q++ {
		e.Copy(0, q, 0, len(doc))
	}
	// The three prefills in one batch: the first restores, the others share.
	samplers := make([]engine.Sampler, 3)
	spans := make([]engine.Span, 3)
	for q := range 3 {
		s, err := e.NewSampler(engine.SamplingParams{})
		if err != nil {
			t.Fatal(err)
		}
		samplers[q] = s
		spans[q] = engine.Span{Seq: q + 1, Pos: len(doc), Tokens: question(q)[len(doc):], Sampler: s}
	}
	got := make([][]int, 3)
	for step := 0; step < 4; step++ {
		toks, err := e.Step(spans)
		if err != nil {
			t.Fatalf("step %d of three copies of one parked 200-token prefix in 512 cells: %v", step, err)
		}
		for q, tok := range toks {
			got[q] = append(got[q], tok)
			spans[q] = engine.Span{Seq: q + 1, Pos: spans[q].Pos + len(spans[q].Tokens), Tokens: []int{tok}, Sampler: samplers[q]}
		}
		if step == 0 {
			if used, _ := e.cellExtent(); used != len(doc)+3*3 || e.UsedCells() != used {
				t.Fatalf("%d cells used after the prefill (%d reported), want the document once and three 3-token questions: %d", used, e.UsedCells(), len(doc)+9)
			}
		}
	}
	for q := range 3 {
		if !slices.Equal(got[q], cold[q]) {
			t.Fatalf("question %d from the shared restore:\ncold %v\ngot  %v", q, cold[q], got[q])
		}
	}
	if !e.Parked(0) {
		t.Fatal("the document's own entry left host memory")
	}

	// A sequence cut below what a copy needs lends nothing: the copy is
	// restored from the bytes, with the same output.
	e.Remove(1, 100)
	e.Remove(2, 0)
	e.Remove(3, 0)
	e.Copy(0, 2, 0, len(doc))
	if got := greedy(t, e, 2, question(1), len(doc), 4); !slices.Equal(got, cold[1]) {
		t.Fatalf("restored beside a shorter twin:\ncold %v\ngot  %v", cold[1], got)
	}
}

// A sequence that copied a parked document is parked with only its own
// cells in new bytes, on the document's; the document's bytes stay while
// any record needs them, and every way back (the root restored into the
// scratch sequence for a moment, or shared from a sequence that holds it)
// gives the cold run's greedy output with the document once in the cache.
func TestAParkedCopyKeepsOnlyItsOwnCells(t *testing.T) {
	e := open(t, 1024, 4)
	doc := document(200)
	q := append(slices.Clone(doc), 3+'1', 3+'?', 3+'1')
	cold := greedy(t, e, 0, q, 0, 4)
	e.Remove(0, 0)

	greedy(t, e, 0, doc, 0, 1)
	e.Park(0)
	docBytes := e.ParkedBytes()
	e.Copy(0, 1, 0, len(doc))
	if got := greedy(t, e, 1, q, len(doc), 4); !slices.Equal(got, cold) {
		t.Fatalf("copied from the parked document:\ncold %v\ngot  %v", cold, got)
	}
	e.Park(1)
	if own := e.ParkedBytes() - docBytes; own <= 0 || own > docBytes/10 {
		t.Fatalf("the copy parked in %d new bytes; the 200-token document takes %d, its own 6 cells a few percent of that", own, docBytes)
	}
	both := e.ParkedBytes()
	e.Remove(0, 0)
	if e.ParkedBytes() != both || e.ParkedBytes() == 0 {
		t.Fatalf("dropping the document's own record: %d bytes parked, want %d (the copy still needs them)", e.ParkedBytes(), both)
	}

	// Back from the copy's record: nothing holds the document in the cache,
	// so it is restored into the scratch sequence and shared from there.
	e.Copy(1, 2, 0, len(q)-1)
	if got := greedy(t, e, 2, q, len(q)-1, 4); !slices.Equal(got, cold) {
		t.Fatalf("restored through the scratch sequence:\ncold %v\ngot  %v", cold, got)
	}
	// And again while seq 2 holds the document: shared from it.
	e.Copy(1, 3, 0, len(q)-1)
	if got := greedy(t, e, 3, q, len(q)-1, 4); !slices.Equal(got, cold) {
		t.Fatalf("restored beside a sequence holding the document:\ncold %v\ngot  %v", cold, got)
	}
	if used, _ := e.cellExtent(); used >= 2*len(doc) {
		t.Fatalf("%d cells used by two copies of a question about a 200-token document: the document is in the cache twice", used)
	}

	// Parked on the document again, from a sequence restored off the copy.
	e.Park(2)
	e.Remove(1, 0)
	e.Remove(3, 0)
	e.Copy(2, 1, 0, len(q)-1)
	if got := greedy(t, e, 1, q, len(q)-1, 4); !slices.Equal(got, cold) {
		t.Fatalf("restored from a record parked on the document's bytes:\ncold %v\ngot  %v", cold, got)
	}
	e.Remove(1, 0)
	e.Remove(2, 0)
	if e.ParkedBytes() != 0 || parkedTokens(e) != 0 {
		t.Fatalf("%d bytes, %d tokens parked after every sequence was removed", e.ParkedBytes(), parkedTokens(e))
	}
	// With the document's bytes gone, a sequence that was restored from
	// them parks whole.
	greedy(t, e, 0, doc, 0, 1)
	e.Park(0)
	e.Copy(0, 1, 0, len(doc))
	greedy(t, e, 1, q, len(doc), 4)
	e.Remove(0, 0)
	e.Park(1)
	if e.ParkedBytes() < docBytes {
		t.Fatalf("%d bytes parked for a sequence of %d tokens whose root is gone: less than the 200-token document's %d", e.ParkedBytes(), len(q), docBytes)
	}
	e.Copy(1, 2, 0, len(q)-1)
	if got := greedy(t, e, 2, q, len(q)-1, 4); !slices.Equal(got, cold) {
		t.Fatalf("parked whole after its root was dropped:\ncold %v\ngot  %v", cold, got)
	}
}

// Two questions about a document computed in the cache, not restored: the
// second copied the first's document cells (in two pieces). Whichever is parked first
// becomes the other's root, so the other parks in a few percent of the
// document's bytes, and the two restored hold the document in the cache
// once; the outputs are the cold runs'.
func TestCopiesOfComputedCellsParkOnEachOther(t *testing.T) {
	doc := document(200)
	q1 := append(slices.Clone(doc), 3+'1', 3+'?', 3+'1')
	q2 := append(slices.Clone(doc), 3+'2', 3+'?', 3+'2')
	for _, first := range []int{0, 1} {
		e := open(t, 1024, 4)
		cold1 := greedy(t, e, 0, q1, 0, 4)
		e.Remove(0, 0)
		cold2 := greedy(t, e, 0, q2, 0, 4)
		e.Remove(0, 0)

		greedy(t, e, 0, q1, 0, 4)
		// In two pieces, as a follower takes its leader's cells.
		e.Copy(0, 1, 0, 120)
		e.Copy(0, 1, 120, len(doc))
		if got := greedy(t, e, 1, q2, len(doc), 4); !slices.Equal(got, cold2) {
			t.Fatalf("q2 on q1's document cells:\ncold %v\ngot  %v", cold2, got)
		}
		e.Park(first)
		whole := e.ParkedBytes()
		e.Park(1 - first)
		if own := e.ParkedBytes() - whole; own <= 0 || own > whole/10 {
			t.Fatalf("parked %d first: the other took %d new bytes; the first took %d, the 200-token document most of it", first, own, whole)
		}
		e.Copy(0, 2, 0, len(q1)-1)
		e.Copy(1, 3, 0, len(q2)-1)
		if got := greedy(t, e, 2, q1, len(q1)-1, 4); !slices.Equal(got, cold1) {
			t.Fatalf("parked %d first: q1 restored:\ncold %v\ngot  %v", first, cold1, got)
		}
		if got := greedy(t, e, 3, q2, len(q2)-1, 4); !slices.Equal(got, cold2) {
			t.Fatalf("parked %d first: q2 restored:\ncold %v\ngot  %v", first, cold2, got)
		}
		if used, _ := e.cellExtent(); used >= 2*len(doc) {
			t.Fatalf("parked %d first: %d cells used by the two questions restored: the document is in the cache twice", first, used)
		}
	}
}

func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkPrefill is one cold 2,600-token prompt prefilled in 512-token
// steps into a 16k-cell, 16-sequence context (the worker's defaults on the
// bench preset), per kernel, with the cache empty or holding two other
// 2,600-token sequences — in the cache or parked. It is the profile behind
// the worker's defaults (docs/worker.md "A crowded KV cache"). Point
// LLMF_BENCH_MODEL at the bench preset; LLMF_THREADS sets the threads.
func BenchmarkPrefill(b *testing.B) {
	path := os.Getenv("LLMF_BENCH_MODEL")
	if path == "" {
		path = testmodel.Path(b)
	}
	threads, _ := strconv.Atoi(os.Getenv("LLMF_THREADS"))
	const n, others = 2600, 2
	toks := func(salt int) []int {
		out := make([]int, n)
		for i := range out {
			out[i] = 3 + 'a' + (i*7+salt*13+i/26)%26
		}
		return out
	}
	prefill := func(b *testing.B, e *Engine, seq int, t []int, chunk int) {
		for p := 0; p < len(t); p += chunk {
			if _, err := e.Step([]engine.Span{{Seq: seq, Pos: p, Tokens: t[p:min(p+chunk, len(t))]}}); err != nil {
				b.Fatal(err)
			}
		}
	}
	// Steps of 512 tokens (n_batch), and of 128 (--prefill-chunk) on the
	// plain kernel: what a shorter step costs the prompt itself.
	type variant struct {
		fa    bool
		chunk int
		crowd string
	}
	var variants []variant
	for _, fa := range []bool{false, true} {
		for _, crowd := range []string{"empty", "crowded", "parked"} {
			if !fa || crowd != "parked" {
				variants = append(variants, variant{fa, 512, crowd})
			}
		}
	}
	variants = append(variants, variant{false, 128, "empty"}, variant{false, 128, "crowded"})
	for _, v := range variants {
		fa, crowd := v.fa, v.crowd
		name := fmt.Sprintf("flash=%v/%s", fa, crowd)
		if v.chunk != 512 {
			name = fmt.Sprintf("flash=%v/chunk=%d/%s", fa, v.chunk, crowd)
		}
		b.Run(name, func(b *testing.B) {
			e, err := Open(Config{ModelPath: path, NCtx: 16384, NSeqMax: 16, Threads: threads, FlashAttention: fa})
			if err != nil {
				b.Fatal(err)
			}
			defer e.Close()
			if crowd != "empty" {
				for s := 1; s <= others; s++ {
					prefill(b, e, s, toks(s), 512)
					if crowd == "parked" {
						e.Park(s)
					}
				}
			}
			b.ResetTimer()
			var cpu time.Duration
			for i := range b.N {
				c0 := processCPU()
				prefill(b, e, 0, toks(100+i), v.chunk)
				cpu += processCPU() - c0
				b.StopTimer()
				e.Remove(0, 0)
				b.StartTimer()
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/1000/float64(b.N), "ms/prefill")
			// With one thread ggml computes on the calling thread and
			// the process's CPU time is the work, whatever else loads
			// the machine (with more, it includes spinning at barriers).
			b.ReportMetric(float64(cpu.Microseconds())/1000/float64(b.N), "cpu-ms/prefill")
		})
	}
}

// The default park bound is the KV cache's own size, n_ctx × bytes per
// token: a parked sequence takes its tokens' K and V plus a few bytes of
// cell metadata each, so the bound parks about n_ctx tokens. ParkBytes
// tells the Owner an entry's size before and after parking.
func TestDefaultParkBoundIsTheKVCacheSize(t *testing.T) {
	e := open(t, 1024, 2)
	per := e.Info().BytesPerToken
	if e.ParkLimit() != 1024*per {
		t.Fatalf("default park limit %d, want n_ctx × %d = %d", e.ParkLimit(), per, 1024*per)
	}
	if b := e.ParkBytes(0); b <= 0 || b >= per {
		t.Fatalf("an empty sequence would park %d bytes, want its header alone", b)
	}
	prompt, _ := e.Tokenize(strings.Repeat("the quick brown fox jumps over the lazy dog. ", 8), true)
	greedy(t, e, 0, prompt, 0, 1)
	n := int64(len(prompt))
	before := e.ParkBytes(0)
	e.Park(0)
	if !e.Parked(0) || e.ParkBytes(0) != before || e.ParkedBytes() != before {
		t.Fatalf("parked %v: %d bytes predicted, %d parked (%d in all)", e.Parked(0), before, e.ParkBytes(0), e.ParkedBytes())
	}
	t.Logf("%d tokens parked in %d bytes: %d of K and V (%d per token), %d of metadata", n, before, n*per, per, before-n*per)
	if before < n*per || before > n*per+n*64+4096 {
		t.Fatalf("%d tokens parked in %d bytes, want their K and V (%d) plus metadata", n, before, n*per)
	}
	if b, err := Open(Config{ModelPath: testmodel.Path(t), NCtx: 1024, NSeqMax: 2, Threads: 1, ParkMaxBytes: 12345}); err != nil || b.ParkLimit() != 12345 {
		t.Fatalf("configured park limit: %v", err)
	} else {
		b.Close()
	}
}

// BenchmarkParkBytes prices the park bound's check: sizing an entry of
// 2,600 tokens (ParkBytes, which the Owner asks before every park) beside
// parking it and restoring it. $LLMF_BENCH_MODEL as BenchmarkPrefill.
func BenchmarkParkBytes(b *testing.B) {
	path := os.Getenv("LLMF_BENCH_MODEL")
	if path == "" {
		path = testmodel.Path(b)
	}
	e, err := Open(Config{ModelPath: path, NCtx: 4096, NSeqMax: 2, Threads: 1})
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	const n = 2600
	toks := document(n)
	for p := 0; p < n; p += 512 {
		if _, err := e.Step([]engine.Span{{Seq: 0, Pos: p, Tokens: toks[p:min(p+512, n)]}}); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("size", func(b *testing.B) {
		for range b.N {
			if e.ParkBytes(0) == 0 {
				b.Fatal("no size")
			}
		}
	})
	b.Run("park+restore", func(b *testing.B) {
		for range b.N {
			e.Park(0)
			if err := e.restore(0); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// A parked sequence below a running one leaves a hole the running one's
// attention would pay for; the engine compacts before the next step, and
// the running sequence's greedy output is the cold run's either way.
func TestRemovedCellsAreCompactedBeforeTheNextStep(t *testing.T) {
	below := make([]int, 600)
	for i := range below {
		below[i] = 3 + 'a' + i%26
	}
	prompt := make([]int, 300)
	for i := range prompt {
		prompt[i] = 3 + 'a' + (i*7)%26
	}
	cold := open(t, 4096, 4)
	want := greedy(t, cold, 0, prompt, 0, 16)

	for _, compact := range []bool{true, false} {
		t.Run(fmt.Sprintf("compact=%v", compact), func(t *testing.T) {
			e := openWith(t, Config{NCtx: 4096, NSeqMax: 4, NoCompact: !compact})
			greedy(t, e, 0, below, 0, 1)
			if _, err := e.Step([]engine.Span{{Seq: 1, Pos: 0, Tokens: prompt[:len(prompt)-1]}}); err != nil {
				t.Fatal(err)
			}
			e.Park(0)
			used, top := e.cellExtent()
			if used != len(prompt)-1 || top <= len(below) {
				t.Fatalf("after parking seq 0: %d cells used up to %d, want %d used above its %d", used, top, len(prompt)-1, len(below))
			}
			got := greedy(t, e, 1, prompt, len(prompt)-1, 16)
			if !slices.Equal(want, got) {
				t.Fatalf("greedy output next to a parked hole:\ncold %v\ngot  %v", want, got)
			}
			used, top = e.cellExtent()
			if compact && top != used {
				t.Fatalf("compacted: %d cells used up to %d, want packed", used, top)
			}
			if !compact && top <= len(below) {
				t.Fatalf("not compacted: %d cells used up to %d, want the hole kept", used, top)
			}
		})
	}
}
