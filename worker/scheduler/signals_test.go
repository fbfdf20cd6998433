package scheduler

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/sim"
)

// Stats carries what the worker reports to the router about itself: queued
// requests and their prompt tokens before the loop runs (with one place in
// the running set, one of the two is blocked: the other joins it at the
// next step; the second counts only what it does not share with the first,
// its start of text), then, once they finished, no prefill left and the cells
// their cache entries keep, which the KV usage counts as free (as vLLM
// does), of a running set of one.
func TestStatsReportPrefillAndKVCells(t *testing.T) {
	r := newRig(t, sim.Config{}, Config{MaxRunning: 1}, false)
	p1, p2 := prompt(r.eng, "the first prompt, of some length"), prompt(r.eng, "a second one")
	var hs []*Handle
	for i, p := range [][]int{p1, p2} {
		h, err := r.s.Submit(context.Background(), &Request{ID: string(rune('a' + i)), Prompt: p, MaxTokens: 3})
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	common := 0
	for common < min(len(p1), len(p2)) && p1[common] == p2[common] {
		common++
	}
	if st := r.s.Stats(); st.Queued != 2 || st.Blocked != 1 || st.Running != 0 || st.PrefillTokens != len(p1)+len(p2)-common || st.KVCells != 4096 || st.KVCellsUsed != 0 || st.MaxRunning != 1 {
		t.Fatalf("before the loop: %+v (prompts %d + %d, %d shared)", st, len(p1), len(p2), common)
	}
	r.start()
	for _, h := range hs {
		if res, _ := h.Wait(context.Background()); res.State != Completed {
			t.Fatalf("%s: %+v", h.ID(), res)
		}
	}
	var st Stats
	var used int
	if !wait.Until(5*time.Second, func() bool {
		st = r.s.Stats()
		r.inspect(t, func(View) { used = r.eng.UsedCells() })
		return st.Queued == 0 && st.Blocked == 0 && st.Running == 0 && st.PrefillTokens == 0 && st.KVCellsUsed == used && used >= len(p1)+len(p2) &&
			st.KVUsage() == 0 // the idle cached cells count as free
	}) {
		t.Fatalf("after both finished: %+v, engine uses %d cells", st, used)
	}
}

// A follower waits for its leader to write the prefix they share: the
// pod's report counts that prefix once, with the leader, and the follower
// only by its own tail, so that a prefix in flight does not make the pod
// look twice as busy to the router.
func TestStatsCountASharedPrefixInFlightOnce(t *testing.T) {
	const nBatch = 32
	r := newRig(t, sim.Config{NBatch: nBatch, Cost: sim.Cost{StepOverhead: 5 * time.Millisecond}}, Config{}, true)
	shared := strings.Repeat("a document both users ask about. ", 20)
	leader, follower := prompt(r.eng, shared+"first question?"), prompt(r.eng, shared+"another one, longer?")
	common := commonPrefix(leader, follower)
	hl, err := r.s.Submit(context.Background(), &Request{ID: "leader", Prompt: leader, MaxTokens: 1})
	if err != nil {
		t.Fatal(err)
	}
	// Once the leader has written a few chunks, the follower arrives.
	waitFor(t, "the leader writing two batches", func() (written bool) {
		r.inspect(t, func(v View) {
			e, ok := v.KV.Get("leader")
			written = ok && len(e.Tokens) >= 2*nBatch
		})
		return written
	})
	hf, err := r.s.Submit(context.Background(), &Request{ID: "follower", Prompt: follower, MaxTokens: 1})
	if err != nil {
		t.Fatal(err)
	}
	checked := false
	waitFor(t, "the follower seen following before the leader wrote the shared prefix", func() bool {
		r.inspect(t, func(v View) {
			l, lok := v.KV.Get("leader")
			f, fok := v.KV.Get("follower")
			if !lok || !fok || len(f.Tokens) >= common || len(l.Tokens) >= common {
				return
			}
			// The report was published before the step just taken, which
			// wrote at most one batch of the leader.
			want := len(leader) - len(l.Tokens) + len(follower) - common
			if got := r.s.Stats().PrefillTokens; got < want || got > want+nBatch {
				t.Errorf("prefill tokens %d with the follower holding %d of %d shared; want %d..%d (the leader's %d left and the follower's own %d)",
					got, len(f.Tokens), common, want, want+nBatch, len(leader)-len(l.Tokens), len(follower)-common)
			}
			checked = true
		})
		return checked
	})
	for _, h := range []*Handle{hl, hf} {
		if res, _ := h.Wait(context.Background()); res.State != Completed {
			t.Fatalf("%s: %+v", h.ID(), res)
		}
	}
}

// waitFor polls cond until it holds, for at most 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	wait.For(t, 10*time.Second, what, cond)
}

// Questions queued behind a busy pod are reported by what they will
// compute: the part of a cached document they share is not prefill, and
// of two queued questions sharing more than the document the second
// counts only its own tail, which the first will have written.
func TestStatsCountQueuedRequestsByWhatTheyDoNotShare(t *testing.T) {
	r := newRig(t, sim.Config{Cost: sim.Cost{StepOverhead: 2 * time.Millisecond}}, Config{MaxRunning: 1}, true)
	doc := strings.Repeat("a document many users ask about. ", 20)
	first := prompt(r.eng, doc+"first question?")
	second := prompt(r.eng, doc+"what does the second part say?")
	third := prompt(r.eng, doc+"what does the second part say, and the third?")
	if _, res := run(t, r, context.Background(), &Request{ID: "first", Prompt: first, MaxTokens: 1}); res.State != Completed {
		t.Fatalf("first: %+v", res)
	}
	// A long answer to something else holds the only running slot.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	blocker, err := r.s.Submit(ctx, &Request{ID: "blocker", Prompt: prompt(r.eng, "unrelated"), MaxTokens: 2000})
	if err != nil {
		t.Fatal(err)
	}
	var hs []*Handle
	for _, q := range []struct {
		id   string
		toks []int
	}{{"second", second}, {"third", third}} {
		h, err := r.s.Submit(context.Background(), &Request{ID: q.id, Prompt: q.toks, MaxTokens: 1})
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	var cached []int
	r.inspect(t, func(v View) {
		e, _ := v.KV.Get("first")
		cached = slices.Clone(e.Tokens)
	})
	fromCache := func(p []int) int { return len(p) - commonPrefix(cached, p) }
	want := fromCache(second) + len(third) - commonPrefix(second, third)
	waitFor(t, "the queued questions counted by what they do not share", func() bool {
		st := r.s.Stats()
		return st.Queued == 2 && st.PrefillTokens == want
	})
	if full := len(second) + len(third); want >= full/2 {
		t.Fatalf("the questions share too little to tell: %d of %d", want, full)
	}
	cancel()
	if res, _ := blocker.Wait(context.Background()); res.State != Cancelled {
		t.Fatalf("blocker: %+v", res)
	}
	for _, h := range hs {
		if res, _ := h.Wait(context.Background()); res.State != Completed || res.CachedTokens == 0 {
			t.Fatalf("%s: %+v", h.ID(), res)
		}
	}
}

func commonPrefix(a, b []int) int {
	n := 0
	for n < min(len(a), len(b)) && a[n] == b[n] {
		n++
	}
	return n
}
