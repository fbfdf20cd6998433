package e2e

import (
	"context"
	"fmt"
	"net/http"
	"testing"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"

	"github.com/istio-llm-filter/istio-llm-filter/bench/fleet"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	mcclient "github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// One engine: the standalone gateway, the .so in the Envoy-faithful host
// and our endpoint picker in the real Envoy make the same decision for
// the same inputs. Each scenario fixes what the decision depends on (the
// request, and the metadata center's view of the fleet) and every host
// must come to the same outcome: the same pod, or the same refusal.
func TestThreeHostsDecideAlike(t *testing.T) {
	f := startFleet(t)
	gws := gateways(t, f)
	mc, err := mcclient.New(mcclient.Options{Address: f.MC})
	if err != nil {
		t.Fatal(err)
	}
	type outcome struct {
		worker string // "" when refused
		status int
		errTyp string
	}
	// placed saves a fresh conversation's prompt on worker w at the
	// metadata center, so cache_aware has one pod to prefer, and asks it.
	placed := func(w int) func(t *testing.T, cl openai.Client, seed uint64) outcome {
		return func(t *testing.T, cl openai.Client, seed uint64) outcome {
			c := newConversation(false, seed)
			q := fmt.Sprintf("Which pod holds this? (%d)", seed)
			hashes := prefix.Hasher{}.Sum("tiny", prefix.CanonicalChat(append(c.canon, text("user", q))))
			if err := mc.SaveCache(context.Background(), api.CacheSave{Cluster: fleet.Cluster, Host: f.Workers[w],
				Hashes: prefix.Wire(hashes), SaveID: fmt.Sprintf("e2e-%d", seed)}); err != nil {
				t.Fatal(err)
			}
			tr, err := c.ask(t, cl, q)
			if err != nil {
				t.Fatal(err)
			}
			return outcome{worker: tr.worker, status: tr.status}
		}
	}
	refused := func(model string, raw string) func(t *testing.T, cl openai.Client, seed uint64) outcome {
		return func(t *testing.T, cl openai.Client, _ uint64) outcome {
			params := openai.ChatCompletionNewParams{Model: model, Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")}}
			var opts []option.RequestOption
			if raw != "" {
				opts = append(opts, option.WithRequestBody("application/json", []byte(raw)))
			}
			_, err := cl.Chat.Completions.New(context.Background(), params, opts...)
			var apiErr *openai.Error
			if !asAPIError(err, &apiErr) {
				t.Fatalf("want a refusal, got %v", err)
			}
			return outcome{status: apiErr.StatusCode, errTyp: apiErr.Type}
		}
	}
	scenarios := []struct {
		name string
		run  func(t *testing.T, cl openai.Client, seed uint64) outcome
		want outcome
	}{
		{"prefix on worker 0", placed(0), outcome{worker: f.Workers[0], status: http.StatusOK}},
		{"prefix on worker 1", placed(1), outcome{worker: f.Workers[1], status: http.StatusOK}},
		{"prefix on worker 2", placed(2), outcome{worker: f.Workers[2], status: http.StatusOK}},
		{"unknown model", refused("no-such-model", ""), outcome{status: http.StatusNotFound, errTyp: "not_found"}},
		{"bad JSON", refused("tiny", `{"model": "tiny", "messages": [`), outcome{status: http.StatusBadRequest, errTyp: "bad_request"}},
		{"no messages", refused("tiny", `{"model": "tiny", "messages": []}`), outcome{status: http.StatusBadRequest, errTyp: "bad_request"}},
	}
	for si, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			for gi, gw := range gws {
				// Each host gets its own conversation (a prompt placed
				// once), on the same worker.
				got := sc.run(t, clientAt(gw.url, 0), uint64(1000+10*si+gi))
				if got != sc.want {
					t.Errorf("%s: %+v, want %+v", gw.name, got, sc.want)
				}
			}
		})
	}
}
