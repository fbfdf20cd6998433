package openai

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/worker/ggufgen"
)

func jinjaFile(t *testing.T, name, bos, eos string) Template {
	t.Helper()
	src, err := os.ReadFile(filepath.Join("testdata", name))
	if name == "qwen2.5.jinja" {
		src, err = []byte(ggufgen.QwenToolsTemplate), nil
	}
	if err != nil {
		t.Fatal(err)
	}
	tpl, err := NewJinjaTemplate(string(src), bos, eos)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return tpl
}

// The models' own templates, evaluated, give what the hand-written
// fallbacks give for the same conversations (those were written to match
// the same templates byte for byte).
func TestJinjaTemplatesMatchTheFallbacks(t *testing.T) {
	qwenSystem := "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
	cases := []struct {
		name     string
		tpl      Template
		fallback Template
		msgs     []Message
	}{
		{"llama-3.1", jinjaFile(t, "llama-3.1.jinja", "<|begin_of_text|>", "<|eot_id|>"),
			Template{Family: FamilyLlama3, BOS: "<|begin_of_text|>", Llama31: true}, conversation(true)},
		{"llama-3.1 no system", jinjaFile(t, "llama-3.1.jinja", "<|begin_of_text|>", "<|eot_id|>"),
			Template{Family: FamilyLlama3, BOS: "<|begin_of_text|>", Llama31: true}, conversation(false)},
		{"qwen2.5", jinjaFile(t, "qwen2.5.jinja", "", "<|im_end|>"),
			Template{Family: FamilyChatML, DefaultSystem: qwenSystem}, conversation(true)},
		{"qwen2.5 default system", jinjaFile(t, "qwen2.5.jinja", "", "<|im_end|>"),
			Template{Family: FamilyChatML, DefaultSystem: qwenSystem}, conversation(false)},
		{"mistral", jinjaFile(t, "mistral-7b-instruct-v0.2.jinja", "<s>", "</s>"),
			Template{Family: FamilyMistral, BOS: "<s>", EOS: "</s>"}, conversation(false)},
		{"gemma-3", jinjaFile(t, "gemma-3.jinja", "<bos>", "<eos>"),
			Template{Family: FamilyGemma, BOS: "<bos>", SystemInFirstUser: true}, conversation(true)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := c.tpl.Render(c.msgs, true)
			if err != nil {
				t.Fatal(err)
			}
			want, err := c.fallback.Render(c.msgs, true)
			if err != nil {
				t.Fatal(err)
			}
			if got != want {
				t.Errorf("jinja\n%q\nfallback\n%q", got, want)
			}
		})
	}
}

func TestJinjaRaiseExceptionIs400(t *testing.T) {
	tpl := jinjaFile(t, "mistral-7b-instruct-v0.2.jinja", "<s>", "</s>")
	_, err := tpl.Render(conversation(true), true)
	if e := AsError(err); err == nil || e.Status != 400 || !strings.Contains(e.Message, "Conversation roles must alternate") {
		t.Fatalf("a system message for Mistral: %v", err)
	}
}

const weatherTool = `{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}`

func TestJinjaRendersToolsAndToolCalls(t *testing.T) {
	tpl := jinjaFile(t, "qwen2.5.jinja", "", "<|im_end|>")
	if !tpl.RendersTools() {
		t.Fatal("the Qwen2.5 template reads tools")
	}
	msgs := []Message{msg(RoleUser, "Weather in Paris?"),
		{Role: RoleAssistant, ToolCalls: json.RawMessage(`[{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]`)},
		{Role: RoleTool, ToolCallID: "call_1", Content: Content{Text: "sunny", Set: true}}}
	got, err := tpl.RenderTools(msgs, []json.RawMessage{json.RawMessage(weatherTool)}, true)
	if err != nil {
		t.Fatal(err)
	}
	// What transformers' apply_chat_template writes for this conversation:
	// the tool as the client wrote it (key order kept, Python's
	// separators), the call's arguments as an object.
	want := "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n" +
		"You may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" +
		weatherTool + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n" +
		"<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" +
		"<|im_start|>user\nWeather in Paris?<|im_end|>\n" +
		"<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n" +
		"<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
	if got != want {
		t.Errorf("rendered\n%s\nwant\n%s", got, want)
	}

	llama := jinjaFile(t, "llama-3.1.jinja", "<|begin_of_text|>", "<|eot_id|>")
	got, err = llama.RenderTools([]Message{msg(RoleUser, "Weather in Paris?")}, []json.RawMessage{json.RawMessage(weatherTool)}, true)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Environment: ipython", `"name": "get_weather"`, "Given the following functions",
		"Weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"} {
		if !strings.Contains(got, want) {
			t.Errorf("llama 3.1 with tools lacks %q:\n%s", want, got)
		}
	}
	if jinjaFile(t, "mistral-7b-instruct-v0.2.jinja", "<s>", "</s>").RendersTools() || ChatML().RendersTools() {
		t.Error("templates that never read tools claim to render them")
	}
}

// A model whose Jinja template does not compile falls back to its family,
// and Describe says why.
func TestLoadTemplateFallsBackWhenJinjaDoesNotCompile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "broken.gguf")
	broken := "{% for message in messages %}<|im_start|>{{ message['role'] }"
	if err := ggufgen.WriteFile(path, ggufgen.Options{Preset: ggufgen.Tiny(), Seed: 1, ChatTemplate: broken}); err != nil {
		t.Fatal(err)
	}
	tpl, known, err := LoadTemplate(path)
	if err != nil || !known || tpl.Family != FamilyChatML || !strings.Contains(tpl.Describe(), "does not compile") {
		t.Fatalf("known=%v err=%v family %s: %s", known, err, tpl.Family, tpl.Describe())
	}
}
