package scheduler

import (
	"slices"
	"testing"
)

func TestPlan(t *testing.T) {
	def := planConfig{NBatch: 512, MaxBatch: 8}
	dec := func(toGo int) candidate { return candidate{left: 1, generating: true, toGo: toGo} }
	pre := func(left int) candidate { return candidate{left: left, toGo: 100} }
	for _, tc := range []struct {
		name string
		cs   []candidate
		cfg  planConfig
		want []slot
	}{{
		// A cache hit's short tail goes before cold prompts admitted
		// earlier; decoding goes first of all; the rest of the budget to
		// the shorter cold prompt.
		name: "decode first, then shortest prefill",
		cs:   []candidate{pre(3000), pre(1488), dec(100), pre(90)},
		cfg:  def,
		want: []slot{{2, 1}, {3, 90}, {1, 421}},
	}, {
		name: "budget exhausted by decoders",
		cs:   []candidate{dec(9), dec(9), pre(10)},
		cfg:  planConfig{NBatch: 2, MaxBatch: 8},
		want: []slot{{0, 1}, {1, 1}},
	}, {
		name: "equal remainders keep admission order",
		cs:   []candidate{pre(300), pre(300)},
		cfg:  def,
		want: []slot{{0, 300}, {1, 212}},
	}, {
		// More ready than MaxBatch: those that waited longest go first.
		name: "max batch rotates by last step",
		cs:   []candidate{{left: 1, generating: true, lastStep: 5}, {left: 1, generating: true, lastStep: 4}, {left: 300, lastStep: 3}},
		cfg:  planConfig{NBatch: 512, MaxBatch: 2},
		want: []slot{{1, 1}, {2, 300}},
	}, {
		// A request 5 tokens from its end: the cold 2k prompt waits, the
		// 20-token cache hit runs beside it.
		name: "finish first holds long prefills",
		cs:   []candidate{dec(5), pre(2000), pre(20)},
		cfg:  planConfig{NBatch: 512, MaxBatch: 8, FinishFirst: 16},
		want: []slot{{0, 1}, {2, 20}},
	}, {
		name: "finish first: far from its end, nothing held",
		cs:   []candidate{dec(2045), pre(2000)},
		cfg:  planConfig{NBatch: 512, MaxBatch: 8, FinishFirst: 16},
		want: []slot{{0, 1}, {1, 511}},
	}, {
		name: "prefill chunk bounds a shared step",
		cs:   []candidate{dec(100), pre(3000), pre(20)},
		cfg:  planConfig{NBatch: 512, MaxBatch: 8, PrefillChunk: 128},
		want: []slot{{0, 1}, {2, 20}, {1, 108}},
	}, {
		name: "prefill chunk: two cold prompts share it",
		cs:   []candidate{pre(3000), pre(2000)},
		cfg:  planConfig{NBatch: 512, MaxBatch: 8, PrefillChunk: 128},
		want: []slot{{1, 128}},
	}, {
		name: "prefill chunk: alone, a whole n_batch",
		cs:   []candidate{pre(3000)},
		cfg:  planConfig{NBatch: 512, MaxBatch: 8, PrefillChunk: 128},
		want: []slot{{0, 512}},
	}, {
		name: "nothing ready",
		cfg:  def,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			if got := plan(tc.cs, tc.cfg); !slices.Equal(got, tc.want) {
				t.Fatalf("plan = %v, want %v", got, tc.want)
			}
		})
	}
}

// Over many steps of the same candidates, MaxBatch lets each take part in
// turn: the scheduler records lastStep as the loop does.
func TestPlanGivesEverySequenceATurn(t *testing.T) {
	cs := []candidate{{left: 1, generating: true, toGo: 50}, {left: 1, generating: true, toGo: 50},
		{left: 1, generating: true, toGo: 50}, {left: 300, toGo: 50}}
	served := make([]int, len(cs))
	for step := uint64(1); step <= 2; step++ {
		for _, s := range plan(cs, planConfig{NBatch: 512, MaxBatch: 2}) {
			served[s.i]++
			cs[s.i].lastStep = step
		}
	}
	if !slices.Equal(served, []int{1, 1, 1, 1}) {
		t.Fatalf("served %v in two steps of two; want every sequence once", served)
	}
}
