package balancer

import (
	"fmt"
	"reflect"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// TestChooseManyHostsPooledScratch: past 64 hosts the seed profile scores into
// pooled scratch; choices through one Balancer at varying sizes (growing,
// shrinking, reusing it) must equal the seed's score and pick computed
// afresh for each.
func TestChooseManyHostsPooledScratch(t *testing.T) {
	rule := config.LBRule{Policy: ProfileSeed, CacheRatioWeight: 2, RequestLoadWeight: 1, PrefillLoadWeight: 3, CandidatePercent: 10}
	for _, draw := range []int{0, 3, 7} {
		intn := func(n int) int { return min(draw, n-1) }
		b := New(Options{IntN: intn})
		for _, n := range []int{300, 65, 500, 100, 8, 257} {
			cands := make([]endpoints.Endpoint, n)
			view := View{Load: api.LoadStats{}, Cache: map[string]int{}}
			want := make([]Host, n)
			for i := range cands {
				addr := fmt.Sprintf("10.1.%d.%d:8000", i/250, i%250+1)
				cands[i] = endpoints.Endpoint{Address: addr}
				st := api.EndpointStats{TotalReqs: int64((i * 7) % 13), PromptLength: int64((i*5)%11) * 1000}
				view.Load[addr] = st
				if i%3 == 0 {
					view.Cache[addr] = i % 20
				}
				want[i] = Host{Address: addr, Reqs: st.TotalReqs, Prompt: st.PromptLength, CacheRatio: min(1, float64(view.Cache[addr])/20)}
			}
			ch, err := b.Choose("c", rule, cands, view, Request{Blocks: 20})
			if err != nil {
				t.Fatal(err)
			}
			wantIdx := pickTop(Scores(want, rule, nil), rule.CandidatePercent, intn)
			if ch.Index != wantIdx || !reflect.DeepEqual(ch.Host, want[wantIdx]) {
				t.Fatalf("n=%d draw=%d: chose %d %+v, want %d %+v", n, draw, ch.Index, ch.Host, wantIdx, want[wantIdx])
			}
			b.Tracker().Begin("c", ch.Host.Address, 0, Request{}).End() // over before the next one
		}
	}
}
