package openai

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/worker/ggufgen"
)

// Templates as published in the families' tokenizer_config.json files (the
// text GGUF converters copy into tokenizer.chat_template); long ones are cut
// to the parts that matter for detection.
const (
	jinjaQwen2   = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
	jinjaQwen25  = "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}"
	jinjaLlama3  = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
	jinjaLlama31 = "{{- bos_token }}\n{%- if not date_string is defined %}\n    {%- set date_string = \"26 Jul 2024\" %}\n{%- endif %}\n{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n{{- system_message }}\n{{- \"<|eot_id|>\" }}"
	jinjaLlama2  = "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
	jinjaMistral = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
	jinjaGemma   = "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
	jinjaGemma3  = "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n{%- endif -%}\n{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}"
	jinjaPhi3    = "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
	jinjaVicuna  = "{% for message in messages %}{% if message['role'] == 'user' %}{{ 'USER: ' + message['content'] + '\\n' }}{% else %}{{ 'ASSISTANT: ' + message['content'] + '</s>\\n' }}{% endif %}{% endfor %}"
)

func msg(role, content string) Message {
	return Message{Role: role, Content: Content{Text: content, Set: true}}
}

func conversation(system bool) []Message {
	var ms []Message
	if system {
		ms = append(ms, msg(RoleSystem, "You are terse."))
	}
	return append(ms, msg(RoleUser, "Hi there"), msg(RoleAssistant, "Hello!"), msg(RoleUser, "Tell me a joke."))
}

func TestDetectTemplate(t *testing.T) {
	cases := []struct {
		name, jinja string
		want        Template
		known       bool
	}{
		{"chatml", ggufgen.ChatMLTemplate, Template{Family: FamilyChatML}, true},
		{"qwen2", jinjaQwen2, Template{Family: FamilyChatML, DefaultSystem: "You are a helpful assistant."}, true},
		{"qwen2.5", jinjaQwen25, Template{Family: FamilyChatML, DefaultSystem: "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."}, true},
		{"llama3", jinjaLlama3, Template{Family: FamilyLlama3, BOS: "<|begin_of_text|>"}, true},
		{"llama3.1", jinjaLlama31, Template{Family: FamilyLlama3, BOS: "<|begin_of_text|>", Llama31: true}, true},
		{"llama2", jinjaLlama2, Template{Family: FamilyLlama2, BOS: "<s>", EOS: "</s>"}, true},
		{"mistral", jinjaMistral, Template{Family: FamilyMistral, BOS: "<s>", EOS: "</s>"}, true},
		{"gemma", jinjaGemma, Template{Family: FamilyGemma, BOS: "<bos>"}, true},
		{"gemma3", jinjaGemma3, Template{Family: FamilyGemma, BOS: "<bos>", SystemInFirstUser: true}, true},
		{"phi3", jinjaPhi3, Template{Family: FamilyPhi3, EOS: "<|endoftext|>"}, true},
		{"unknown", jinjaVicuna, ChatML(), false},
		{"empty", "", ChatML(), false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, known := DetectTemplate(c.jinja, "", "")
			if got != c.want || known != c.known {
				t.Errorf("got %+v known=%v, want %+v known=%v", got, known, c.want, c.known)
			}
		})
	}
	// The model's own token texts win over the family defaults.
	if got, _ := DetectTemplate(jinjaLlama2, "<BOS>", "<EOS>"); got.BOS != "<BOS>" || got.EOS != "<EOS>" {
		t.Errorf("model token texts ignored: %+v", got)
	}
}

// Golden renderings, checked by hand against each family's template above.
func TestRenderGolden(t *testing.T) {
	detect := func(j string) Template { tpl, _ := DetectTemplate(j, "", ""); return tpl }
	cases := []struct {
		name   string
		tpl    Template
		msgs   []Message
		gen    bool
		golden string
	}{
		{"chatml", ChatML(), conversation(true), true,
			"<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nTell me a joke.<|im_end|>\n<|im_start|>assistant\n"},
		{"chatml no generation prompt", ChatML(), conversation(false)[:2], false,
			"<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"},
		{"chatml developer is system", ChatML(), []Message{msg(RoleDeveloper, "rules"), msg(RoleUser, "q")}, true,
			"<|im_start|>system\nrules<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"},
		{"chatml tool turn", ChatML(), []Message{msg(RoleUser, "q"), {Role: RoleAssistant}, msg(RoleTool, "42")}, true,
			"<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"},
		{"qwen2 default system", detect(jinjaQwen2), conversation(false)[:1], true,
			"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"},
		{"qwen2 own system", detect(jinjaQwen2), conversation(true)[:2], true,
			"<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"},
		{"llama3", detect(jinjaLlama3), conversation(true), true,
			"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nTell me a joke.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
		{"llama3 trims", detect(jinjaLlama3), []Message{msg(RoleUser, "  padded \n")}, false,
			"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\npadded<|eot_id|>"},
		{"llama3.1", detect(jinjaLlama31), conversation(true)[:2], true,
			"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
		{"llama3.1 no system, tool as ipython", detect(jinjaLlama31), []Message{msg(RoleUser, "q"), msg(RoleTool, `{"t": "<20°C>"}`)}, false,
			"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nq<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n\"{\\\"t\\\": \\\"<20°C>\\\"}\"<|eot_id|>"},
		{"llama2", detect(jinjaLlama2), conversation(true), true,
			"<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi there [/INST] Hello! </s><s>[INST] Tell me a joke. [/INST]"},
		{"llama2 no system", detect(jinjaLlama2), conversation(false), true,
			"<s>[INST] Hi there [/INST] Hello! </s><s>[INST] Tell me a joke. [/INST]"},
		{"mistral", detect(jinjaMistral), conversation(false), true,
			"<s>[INST] Hi there [/INST]Hello!</s>[INST] Tell me a joke. [/INST]"},
		{"gemma", detect(jinjaGemma), []Message{msg(RoleUser, "Hi there"), msg(RoleAssistant, " Hello! "), msg(RoleUser, "Tell me a joke.")}, true,
			"<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nTell me a joke.<end_of_turn>\n<start_of_turn>model\n"},
		{"gemma3 system", detect(jinjaGemma3), conversation(true), true,
			"<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nTell me a joke.<end_of_turn>\n<start_of_turn>model\n"},
		{"phi3", detect(jinjaPhi3), conversation(true), true,
			"<|system|>\nYou are terse.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\nTell me a joke.<|end|>\n<|assistant|>\n"},
		{"phi3 no generation prompt", detect(jinjaPhi3), conversation(false)[:2], false,
			"<|user|>\nHi there<|end|>\n<|assistant|>\nHello!<|end|>\n<|endoftext|>"},
		{"text parts joined", ChatML(), []Message{{Role: RoleUser, Content: Content{Set: true, Parts: []ContentPart{{Type: "text", Text: "a"}, {Type: "text", Text: "b"}}}}}, true,
			"<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := c.tpl.Render(c.msgs, c.gen)
			if err != nil {
				t.Fatal(err)
			}
			if got != c.golden {
				t.Errorf("rendered\n%q\nwant\n%q", got, c.golden)
			}
		})
	}
}

func TestRenderRefusesWhatTemplatesRefuse(t *testing.T) {
	detect := func(j string) Template { tpl, _ := DetectTemplate(j, "", ""); return tpl }
	cases := []struct {
		name string
		tpl  Template
		msgs []Message
		want string
	}{
		{"mistral system", detect(jinjaMistral), conversation(true), `does not support role "system"`},
		{"llama2 two users", detect(jinjaLlama2), []Message{msg(RoleUser, "a"), msg(RoleUser, "b")}, "alternate"},
		{"llama2 starts with assistant", detect(jinjaLlama2), []Message{msg(RoleAssistant, "a")}, "alternate"},
		{"gemma system", detect(jinjaGemma), conversation(true), "does not support a system message"},
		{"gemma tool", detect(jinjaGemma), []Message{msg(RoleUser, "a"), msg(RoleTool, "b")}, `role "tool"`},
		{"phi3 tool", detect(jinjaPhi3), []Message{msg(RoleUser, "a"), msg(RoleTool, "b")}, `role "tool"`},
		{"image part", ChatML(), []Message{{Role: RoleUser, Content: Content{Set: true, Parts: []ContentPart{{Type: "image_url", ImageURL: &ImageURL{URL: "u"}}}}}}, "image_url parts are not supported"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out, err := c.tpl.Render(c.msgs, true)
			if err == nil {
				t.Fatalf("rendered %q", out)
			}
			e := AsError(err)
			if e.Status != 400 || !strings.Contains(e.Message, c.want) {
				t.Errorf("got %v, want a 400 mentioning %q", err, c.want)
			}
		})
	}
}

func TestLoadTemplateFromGeneratedModel(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tiny.gguf")
	if err := ggufgen.WriteFile(path, ggufgen.Options{Preset: ggufgen.Tiny(), Seed: 1}); err != nil {
		t.Fatal(err)
	}
	tpl, known, err := LoadTemplate(path)
	if err != nil || !known {
		t.Fatalf("known=%v err=%v", known, err)
	}
	if tpl.Family != FamilyJinja || tpl.BOS != "<s>" || tpl.EOS != "<|im_end|>" {
		t.Errorf("template %+v", tpl)
	}
	// The generated model's template is ChatML's.
	got, err := tpl.Render(conversation(true), true)
	want, _ := ChatML().Render(conversation(true), true)
	if err != nil || got != want {
		t.Errorf("rendered %q (%v), ChatML %q", got, err, want)
	}
	// A template written into the model is the one loaded.
	path = filepath.Join(t.TempDir(), "tiny-mistral.gguf")
	src, _ := os.ReadFile(filepath.Join("testdata", "mistral-7b-instruct-v0.2.jinja"))
	if err := ggufgen.WriteFile(path, ggufgen.Options{Preset: ggufgen.Tiny(), Seed: 1, ChatTemplate: string(src)}); err != nil {
		t.Fatal(err)
	}
	if tpl, _, err = LoadTemplate(path); err != nil {
		t.Fatal(err)
	}
	if got, _ := tpl.Render([]Message{msg(RoleUser, "hi")}, true); got != "<s>[INST] hi [/INST]" {
		t.Errorf("the written Mistral template rendered %q", got)
	}
	if _, _, err := LoadTemplate(filepath.Join(t.TempDir(), "missing.gguf")); err == nil {
		t.Error("no error for a missing file")
	}
}
