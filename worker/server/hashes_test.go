package server

import (
	"slices"
	"testing"

	filteropenai "github.com/istio-llm-filter/istio-llm-filter/filter/transcode/openai"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
)

// The worker's eviction reports only keep the router's index true if the
// worker hashes a request exactly as the gateway does. This pins the two
// parsers together on the shapes a chat request can take.
func TestWorkerHashesEqualTheGatewayHashes(t *testing.T) {
	chats := []string{
		`{"model":"tiny","messages":[{"role":"user","content":"hello"}]}`,
		`{"model":"qwen","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"héllo wörld \u0000 \u001e"},{"role":"assistant","content":"hi"},{"role":"user","content":"again"}]}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"look at "},{"type":"text","text":"this"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}`,
		`{"model":"m","messages":[{"role":"developer","content":"rules"},{"role":"user","content":"` + longText(3000, "long") + `"}]}`,
	}
	h := prefix.Hasher{}
	for i, body := range chats {
		req, params, e := openai.ParseChat([]byte(body))
		if e != nil {
			t.Fatalf("chat %d: worker parser: %v", i, e)
		}
		model, canon, err := filteropenai.Canonical("/v1/chat/completions", []byte(body))
		if err != nil {
			t.Fatalf("chat %d: gateway parser: %v", i, err)
		}
		got, want := h.Sum(params.Model, req.Canonical()), h.Sum(model, canon)
		if len(want) == 0 || !slices.Equal(got, want) {
			t.Errorf("chat %d: worker hashes %v, gateway hashes %v", i, prefix.Wire(got), prefix.Wire(want))
		}
	}
	completions := []string{
		`{"model":"tiny","prompt":"Once upon a time"}`,
		`{"model":"tiny","prompt":["only one prompt"]}`,
	}
	for i, body := range completions {
		req, params, e := openai.ParseCompletion([]byte(body))
		if e != nil {
			t.Fatalf("completion %d: worker parser: %v", i, e)
		}
		model, canon, err := filteropenai.Canonical("/v1/completions", []byte(body))
		if err != nil {
			t.Fatalf("completion %d: gateway parser: %v", i, err)
		}
		if got, want := h.Sum(params.Model, req.Canonical()), h.Sum(model, canon); !slices.Equal(got, want) {
			t.Errorf("completion %d: worker hashes %v, gateway hashes %v", i, prefix.Wire(got), prefix.Wire(want))
		}
	}
}
