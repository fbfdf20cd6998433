package scheduler

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

// Two parked conversations come back in one step: their cells fit the KV
// cache together, their new turns do not. The newer one's cells go back
// to host memory and it waits for the older one to finish, instead of
// being preempted and computing its whole history again; both get the
// greedy output of a cold run.
func TestLlamaKVFullSwapsTheNewestOutInsteadOfRecomputing(t *testing.T) {
	path := testmodel.Path(t)
	eng := openLlamaParking(t, path, 1024, 4, 1<<30)
	m := NewMetrics(nil)
	s := startSched(t, eng, Config{Metrics: m})
	const maxTokens = 8
	var next [2][]int
	var parked [2]int
	for i := range next {
		first := tokenize(t, eng, history(400, fmt.Sprint("swap", i)))
		out, res := collect(t, s, &Request{ID: fmt.Sprint("first", i), Prompt: first, MaxTokens: maxTokens, IgnoreEOS: true})
		if res.State != Completed {
			t.Fatalf("first turn %d: %+v", i, res)
		}
		turn := tokenize(t, eng, fmt.Sprintf("<|im_end|>\n<|im_start|>user\nQuestion %d: and what follows from all of that for topic %d, step by step, with examples?<|im_end|>\n<|im_start|>assistant\n", i, i))[1:]
		next[i] = append(append(first, out...), turn...)
		parked[i] = len(first) + len(out) - 1
	}
	// The histories' cells fit in 1024 together (the step restores both),
	// the new turns' do not (its decode finds the cache full).
	if parked[0]+parked[1] > 1024 || len(next[0])+len(next[1]) <= 1024 {
		t.Fatalf("histories of %d cells, next turns of %d tokens: the test wants ≤ 1024 and > 1024", parked[0]+parked[1], len(next[0])+len(next[1]))
	}
	cold := coldRuns(t, path, next[:], maxTokens)

	// Both submitted while the loop waits for us: they bind and step together.
	var hs []*Handle
	if err := s.Inspect(context.Background(), func(View) {
		for i, p := range next {
			h, err := s.Submit(context.Background(), &Request{ID: fmt.Sprint("next", i), Prompt: p, MaxTokens: maxTokens, IgnoreEOS: true})
			if err != nil {
				t.Errorf("submit %d: %v", i, err)
				return
			}
			hs = append(hs, h)
		}
	}); err != nil || len(hs) != 2 {
		t.Fatalf("inspect: %v", err)
	}
	outs, results := drain(hs)
	for i, res := range results {
		if res.State != Completed || !slices.Equal(outs[i], cold[i]) {
			t.Fatalf("next turn %d: %+v, the output of a cold run: %v", i, res, slices.Equal(outs[i], cold[i]))
		}
	}
	if n := counterValue(m.preemptions); n != 0 {
		t.Fatalf("%v preemptions; the newer turn should have been swapped out", n)
	}
	if n := counterValue(m.swaps); n != 1 {
		t.Fatalf("%v swaps, want 1 (the newer turn)", n)
	}
}
