package main

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/worker/ggufgen"
	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

func postJSON(t *testing.T, url, body string) (int, map[string]any) {
	t.Helper()
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", bytes.NewReader([]byte(body)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, out
}

func content(t *testing.T, out map[string]any) string {
	t.Helper()
	choices, _ := out["choices"].([]any)
	if len(choices) != 1 {
		t.Fatalf("answer: %v", out)
	}
	return choices[0].(map[string]any)["message"].(map[string]any)["content"].(string)
}

// A worker started with --lora serves the adapter (by "lora" or as the
// model), lists it in /v1/models, answers differently from the base model,
// and refuses requests for other adapters or for the bare base model with
// 404 in the error format.
func TestLoRAAdapterIsLoadedAdvertisedAndServed(t *testing.T) {
	adapter := filepath.Join(t.TempDir(), "support.gguf")
	if err := ggufgen.WriteLoRAFile(adapter, ggufgen.LoRAOptions{Preset: ggufgen.Tiny(), Seed: 7}); err != nil {
		t.Fatal(err)
	}
	common := []string{"--model", testmodel.Path(t), "--n-ctx", "2048", "--n-seq-max", "4", "--threads", "1", "--model-name", "tiny"}
	base := start(t, common...)
	adapted := start(t, append(common, "--lora", "support="+adapter)...)

	const msgs = `"messages":[{"role":"user","content":"Tell me about KV caches."}],"max_tokens":24,"ignore_eos":true,"temperature":0`
	code, out := postJSON(t, base, `{"model":"tiny",`+msgs+`}`)
	if code != 200 {
		t.Fatalf("base: %d %v", code, out)
	}
	baseText := content(t, out)

	code, out = postJSON(t, adapted, `{"model":"tiny","lora":"support",`+msgs+`}`)
	if code != 200 {
		t.Fatalf("lora by field: %d %v", code, out)
	}
	loraText := content(t, out)
	if loraText == baseText {
		t.Fatalf("the adapter did not change the output: %q", loraText)
	}
	code, out = postJSON(t, adapted, `{"model":"support",`+msgs+`}`)
	if code != 200 || content(t, out) != loraText {
		t.Fatalf("lora as model: %d %v (want the same text as by field)", code, out)
	}

	for _, tc := range []struct{ url, body, want string }{
		{adapted, `{"model":"tiny","lora":"legal",` + msgs + `}`, `lora adapter \"legal\" is not loaded`},
		{adapted, `{"model":"tiny",` + msgs + `}`, "serves only its LoRA adapters"},
		{base, `{"model":"tiny","lora":"support",` + msgs + `}`, `lora adapter \"support\" is not loaded`},
	} {
		code, out := postJSON(t, tc.url, tc.body)
		e, _ := out["error"].(map[string]any)
		raw, _ := json.Marshal(out)
		if code != 404 || e["type"] == nil || e["param"] != "lora" || !strings.Contains(string(raw), tc.want) {
			t.Errorf("%s: %d %s, want 404 mentioning %q", tc.body[:40], code, raw, tc.want)
		}
	}

	resp, err := http.Get(adapted + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), `"id":"tiny"`) || !strings.Contains(string(b), `"id":"support"`) {
		t.Fatalf("models of the adapter pod: %s", b)
	}
}

func TestLoRAFlag(t *testing.T) {
	adapter := filepath.Join(t.TempDir(), "a.gguf")
	if err := ggufgen.WriteLoRAFile(adapter, ggufgen.LoRAOptions{Preset: ggufgen.Tiny()}); err != nil {
		t.Fatal(err)
	}
	o, err := parse([]string{"--engine", "sim", "--lora", "a=" + adapter + ":0.5", "--lora", "b=" + adapter}, io.Discard)
	if err != nil || len(o.lora) != 2 || o.lora[0].Scale != 0.5 || o.lora[0].Path != adapter || o.lora[1].Scale != 0 {
		t.Fatalf("parse: %+v %v", o, err)
	}
	for _, bad := range []string{"noequals", "=path", "a=", "a=/does/not/exist", "a=" + adapter + ":-1"} {
		if _, err := parse([]string{"--engine", "sim", "--lora", bad}, io.Discard); err == nil {
			t.Errorf("--lora %q accepted", bad)
		}
	}
	if _, err := parse([]string{"--engine", "sim", "--lora", "a=" + adapter, "--lora", "a=" + adapter}, io.Discard); err == nil {
		t.Error("duplicate adapter name accepted")
	}
}
