package openai

import (
	"bytes"
	"strings"
	"testing"

	gateway "github.com/istio-llm-filter/istio-llm-filter/filter/transcode/openai"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// gatewayCanonical is what the gateway's transcoder hashes for a body.
func gatewayCanonical(t testing.TB, path string, body []byte) ([]byte, bool) {
	t.Helper()
	req, err := gateway.New().Parse(path, body)
	if err != nil {
		return nil, false
	}
	return req.Canonical, true
}

var canonicalBodies = []string{
	`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
	`{"model":"m","messages":[{"role":"system","content":"sys"},{"role":"user","content":"` + strings.Repeat("long history ", 300) + `"}]}`,
	`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"look "},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},{"type":"text","text":"here"}]}]}`,
	`{"model":"m","messages":[{"role":"user","name":"ann","content":"q"},{"role":"assistant","content":null,"tool_calls": [ {"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}} ]},{"role":"tool","tool_call_id":"c1","content":"42"}]}`,
	`{"model":"m","messages":[{"role":"assistant","tool_calls":null},{"role":"developer","content":"d"},{"role":"user","content":"\u001e\u001f\u001b escapes"}]}`,
	`{"model":"m","messages":[{"role":"user","content":[]}],"stream":true}`,
	`{"model":"m","tools": [ {"type":"function","function":{"name":"f","parameters":{"type":"object"}}} ],"messages":[{"role":"user","content":"hi"}]}`,
	`{"model":"m","messages":[{"role":"user","content":"hi"}],"response_format": {"type":"json_schema", "json_schema":{"name":"x","schema":{"type":"object"}}},"tools":null}`,
	`{"model":"m","messages":[{"role":"user","content":"hi"}],"response_format":null}`,
}

func TestCanonicalMatchesGateway(t *testing.T) {
	for i, body := range canonicalBodies {
		req, _, err := ParseChat([]byte(body))
		if err != nil {
			t.Fatalf("body %d: %v", i, err)
		}
		want, ok := gatewayCanonical(t, "/v1/chat/completions", []byte(body))
		if !ok {
			t.Fatalf("body %d: the gateway refuses it", i)
		}
		if got := req.Canonical(); !bytes.Equal(got, want) {
			t.Errorf("body %d: canonical\n got %q\nwant %q (gateway)", i, got, want)
		}
		// Same bytes, same chained hashes: what an eviction report names.
		h := prefix.Hasher{}
		if a, b := prefix.Wire(h.Sum("m", req.Canonical())), prefix.Wire(h.Sum("m", want)); strings.Join(a, ",") != strings.Join(b, ",") {
			t.Errorf("body %d: hashes differ", i)
		}
	}
	for _, body := range []string{`{"model":"m","prompt":"Once"}`, `{"model":"m","prompt":["Once upon"]}`,
		`{"model":"m","prompt":"Once","response_format":{"type":"json_object"}}`} {
		req, _, err := ParseCompletion([]byte(body))
		if err != nil {
			t.Fatal(err)
		}
		want, ok := gatewayCanonical(t, "/v1/completions", []byte(body))
		if !ok || !bytes.Equal(req.Canonical(), want) {
			t.Errorf("%s: canonical %q, gateway %q (ok=%v)", body, req.Canonical(), want, ok)
		}
	}
}

// FuzzCanonicalMatchesGateway: whenever both the worker and the gateway
// accept a chat body, they hash the same canonical prompt.
func FuzzCanonicalMatchesGateway(f *testing.F) {
	for _, b := range canonicalBodies {
		f.Add([]byte(b))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, _, err := ParseChat(body)
		if err != nil {
			return
		}
		want, ok := gatewayCanonical(t, "/v1/chat/completions", body)
		if !ok {
			return
		}
		if got := req.Canonical(); !bytes.Equal(got, want) {
			t.Fatalf("body %q: worker %q, gateway %q", body, got, want)
		}
	})
}
