package epp_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/routing/routingtest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	mcclient "github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// Two picker replicas, each behind its own Envoy, on one metadata center
// are active-active: a prompt one of them placed is sent to the same pod
// by the other, as three standalone gateways do.
func TestTwoReplicasSendAPrefixToOnePod(t *testing.T) {
	pods := startPods(t, 8) // a blind pick lands on the prefix's pod 1 time in 8
	mc := routingtest.Center(t)
	doc := fleetFile(mc.URL, addrs(pods))
	gws := []string{startEnvoy(t, startEPP(t, doc, false)), startEnvoy(t, startEPP(t, doc, false))}
	mcc, err := mcclient.New(mcclient.Options{Address: mc.URL})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 6 {
		sys := fmt.Sprintf("conversation %d:", i)
		for j := range 12 {
			sys += fmt.Sprintf(" shared system prompt part %d of conversation %d;", j, i)
		}
		a, b := gws[i%2], gws[(i+1)%2]
		first := post(t, a, chat(false, sys), nil)
		if first.status != 200 {
			t.Fatalf("%d %s", first.status, first.body)
		}
		hashes := prefix.Wire(prefix.Hasher{ChunkSize: 64}.Sum("qwen", prefix.CanonicalChat([]prefix.Message{
			prefix.ChatMessage("user", "", "", []prefix.Part{{Type: "text", Text: sys}}, nil)})))
		// The prompt held there, and the first turn done there in the
		// metadata center's count (its lease gone), as by the time a user
		// sends the next turn: until the done lands, every replica reads
		// the pod as still prefilling the first turn.
		wait.For(t, 10*time.Second, "the metadata center to hold the prompt on "+first.served+" and count its turn done", func() bool {
			ans, err := mcc.Route(context.Background(), "pool", hashes)
			if err != nil || ans.Load[first.served].TotalReqs != 0 {
				return false
			}
			for _, c := range ans.Cache {
				if c.Host == first.served && c.Length == len(hashes) {
					return true
				}
			}
			return false
		})
		next := post(t, b, chat(false, sys, "an answer", "and a follow-up question"), nil)
		if next.status != 200 || next.served != first.served {
			t.Fatalf("conversation %d: the first turn went to %s through one replica, the second to %s (%d) through the other",
				i, first.served, next.served, next.status)
		}
	}
}
