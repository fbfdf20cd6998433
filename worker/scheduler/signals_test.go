package scheduler

import (
	"context"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/worker/engine/sim"
)

// Stats carries what the worker reports to the router about itself: queued
// requests and their prompt tokens before the loop runs, then, once they
// finished, no prefill left and the cells their cache entries keep.
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
	if st := r.s.Stats(); st.Queued != 2 || st.Running != 0 || st.PrefillTokens != len(p1)+len(p2) || st.KVCells != 4096 || st.KVCellsUsed != 0 {
		t.Fatalf("before the loop: %+v (prompts %d + %d)", st, len(p1), len(p2))
	}
	r.start()
	for _, h := range hs {
		if res, _ := h.Wait(context.Background()); res.State != Completed {
			t.Fatalf("%s: %+v", h.ID(), res)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		st := r.s.Stats()
		var used int
		r.inspect(t, func(View) { used = r.eng.UsedCells() })
		if st.Queued == 0 && st.Running == 0 && st.PrefillTokens == 0 && st.KVCellsUsed == used && used >= len(p1)+len(p2) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after both finished: %+v, engine uses %d cells", st, used)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
