package openai

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"strings"

	"github.com/ardanlabs/jinja"
	"github.com/ollama/ollama/fs/ggml"
)

// Family is a chat-template family this package renders in Go: the
// fallbacks for models whose GGUF carries no Jinja template (or one the
// Jinja engine cannot compile), recognised by their markers.
type Family string

const (
	// FamilyChatML: <|im_start|>role\ncontent<|im_end|>\n (Qwen, Yi, OpenHermes, the generated model).
	FamilyChatML Family = "chatml"
	// FamilyLlama3: <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> (Llama 3 / 3.1).
	FamilyLlama3 Family = "llama3"
	// FamilyLlama2: <s>[INST] <<SYS>>\nsystem\n<</SYS>>\n\nuser [/INST] assistant </s> (Llama 2 chat).
	FamilyLlama2 Family = "llama2"
	// FamilyMistral: <s>[INST] user [/INST]assistant</s> (Mistral 7B Instruct v0.1/v0.2).
	FamilyMistral Family = "mistral"
	// FamilyGemma: <start_of_turn>user\ncontent<end_of_turn>\n, assistant as "model" (Gemma 1/2/3).
	FamilyGemma Family = "gemma"
	// FamilyPhi3: <|user|>\ncontent<|end|>\n (Phi-3 / Phi-3.5).
	FamilyPhi3 Family = "phi3"
)

// Template renders chat messages into a prompt string that is tokenized with
// special tokens parsed and without adding BOS: templates that want a BOS
// write its text themselves, as the Jinja originals do with {{ bos_token }}.
type Template struct {
	Family Family
	// BOS and EOS are the model's bos_token and eos_token texts.
	BOS, EOS string
	// DefaultSystem is inserted as the first message when the conversation
	// has no system message (Qwen's ChatML templates do this).
	DefaultSystem string
	// Llama31 adds Llama 3.1's system header ("Cutting Knowledge Date ...").
	Llama31 bool
	// SystemInFirstUser folds the system message into the first user turn
	// followed by "\n\n" (Gemma 3); otherwise Gemma refuses a system message.
	SystemInFirstUser bool

	// jinja is the compiled Jinja source (FamilyJinja, NewJinjaTemplate).
	jinja  *jinja.Template
	source string
	// why a family renders though the model has a Jinja template.
	why string
}

// ChatML is the default template: used when a model has none or has one of
// a family this package does not know.
func ChatML() Template { return Template{Family: FamilyChatML} }

// Qwen's templates insert a default system turn, e.g.
// '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n'.
var chatMLDefaultSystem = regexp.MustCompile(`'<\|im_start\|>system\\n([^'<]+)<\|im_end\|>\\n'`)

// DetectTemplate recognises the family of a GGUF tokenizer.chat_template.
// ok is false when it is not one this package knows; the ChatML template is
// returned then, which is what llama-server falls back to as well.
func DetectTemplate(jinja, bos, eos string) (t Template, ok bool) {
	t = Template{BOS: bos, EOS: eos}
	switch {
	case strings.Contains(jinja, "<|im_start|>"):
		t.Family = FamilyChatML
		if m := chatMLDefaultSystem.FindStringSubmatch(jinja); m != nil {
			t.DefaultSystem = strings.ReplaceAll(m[1], `\n`, "\n")
		}
	case strings.Contains(jinja, "<|start_header_id|>"):
		t.Family = FamilyLlama3
		t.Llama31 = strings.Contains(jinja, "Cutting Knowledge Date")
		if t.BOS == "" {
			t.BOS = "<|begin_of_text|>"
		}
	case strings.Contains(jinja, "<start_of_turn>"):
		t.Family = FamilyGemma
		t.SystemInFirstUser = strings.Contains(jinja, "first_user_prefix")
		if t.BOS == "" {
			t.BOS = "<bos>"
		}
	case strings.Contains(jinja, "<|user|>") && strings.Contains(jinja, "<|end|>"):
		t.Family = FamilyPhi3
		if t.EOS == "" {
			t.EOS = "<|endoftext|>"
		}
	case strings.Contains(jinja, "[INST]") && strings.Contains(jinja, "<<SYS>>"):
		t.Family = FamilyLlama2
	case strings.Contains(jinja, "[INST]"):
		t.Family = FamilyMistral
	default:
		return ChatML(), false
	}
	if t.Family == FamilyLlama2 || t.Family == FamilyMistral {
		if t.BOS == "" {
			t.BOS = "<s>"
		}
		if t.EOS == "" {
			t.EOS = "</s>"
		}
	}
	return t, true
}

// LoadTemplate reads tokenizer.chat_template and the BOS/EOS token texts
// from a GGUF file. The Jinja template itself renders prompts when it
// compiles; else its family is detected (ChatML when absent or unknown).
// known is false when neither the template nor a family was usable;
// Describe says which is used.
func LoadTemplate(path string) (t Template, known bool, err error) {
	f, err := os.Open(path)
	if err != nil {
		return ChatML(), false, err
	}
	defer f.Close()
	g, err := ggml.Decode(f, -1)
	if err != nil {
		return ChatML(), false, fmt.Errorf("reading %s: %w", path, err)
	}
	kv := g.KV()
	tokens := kv.Strings("tokenizer.ggml.tokens")
	text := func(key string) string {
		id, ok := kv["tokenizer.ggml."+key].(uint32)
		if ok && int(id) < len(tokens) {
			return tokens[id]
		}
		return ""
	}
	src := kv.ChatTemplate()
	if src == "" {
		return ChatML(), false, nil
	}
	t, jerr := NewJinjaTemplate(src, text("bos_token_id"), text("eos_token_id"))
	if jerr == nil {
		return t, true, nil
	}
	t, known = DetectTemplate(src, text("bos_token_id"), text("eos_token_id"))
	t.why = "the model's Jinja template does not compile: " + jerr.Error()
	return t, known, nil
}

// turn is a message reduced to what templates use.
type turn struct {
	role, content string
}

func turns(msgs []Message) []turn {
	out := make([]turn, len(msgs))
	for i, m := range msgs {
		role := m.Role
		if role == RoleDeveloper {
			role = RoleSystem
		}
		out[i] = turn{role: role, content: m.Content.String()}
	}
	return out
}

// Render renders messages as the template does. With addGenerationPrompt
// the prompt ends with the header of an assistant turn, ready for the model
// to write it. Conversations the original template rejects
// (raise_exception) are rejected here too, with a 400.
func (t Template) Render(msgs []Message, addGenerationPrompt bool) (string, error) {
	return t.RenderTools(msgs, nil, addGenerationPrompt)
}

// RenderTools is Render with the request's tool definitions (each a
// "tools" element as the client sent it), which only a Jinja template
// places in the prompt (RendersTools).
func (t Template) RenderTools(msgs []Message, tools []json.RawMessage, addGenerationPrompt bool) (string, error) {
	for i, m := range msgs {
		for j, p := range m.Content.Parts {
			if p.Type != "text" {
				return "", BadRequest(fmt.Sprintf("messages[%d].content[%d]", i, j),
					"messages[%d].content[%d]: %s parts are not supported: this model reads text only", i, j, p.Type)
			}
		}
	}
	if t.jinja != nil {
		return t.renderJinja(msgs, tools, addGenerationPrompt)
	}
	ts := turns(msgs)
	var b strings.Builder
	var err error
	switch t.Family {
	case FamilyChatML, "":
		t.renderChatML(&b, ts, addGenerationPrompt)
	case FamilyLlama3:
		t.renderLlama3(&b, ts, addGenerationPrompt)
	case FamilyLlama2:
		err = t.renderLlama2(&b, ts)
	case FamilyMistral:
		err = t.renderMistral(&b, ts)
	case FamilyGemma:
		err = t.renderGemma(&b, ts, addGenerationPrompt)
	case FamilyPhi3:
		err = t.renderPhi3(&b, ts, addGenerationPrompt)
	default:
		return "", fmt.Errorf("openai: unknown template family %q", t.Family)
	}
	if err != nil {
		return "", err
	}
	return b.String(), nil
}

func (t Template) renderChatML(b *strings.Builder, ts []turn, gen bool) {
	if t.DefaultSystem != "" && (len(ts) == 0 || ts[0].role != RoleSystem) {
		fmt.Fprintf(b, "<|im_start|>system\n%s<|im_end|>\n", t.DefaultSystem)
	}
	for _, m := range ts {
		fmt.Fprintf(b, "<|im_start|>%s\n%s<|im_end|>\n", m.role, m.content)
	}
	if gen {
		b.WriteString("<|im_start|>assistant\n")
	}
}

// renderLlama3 follows Meta's Llama 3 template (content trimmed, BOS first)
// and, for 3.1, its system header with the template's default date and no
// tools ("tool" messages become "ipython" turns as 3.1 names them).
func (t Template) renderLlama3(b *strings.Builder, ts []turn, gen bool) {
	b.WriteString(t.BOS)
	if t.Llama31 {
		system := ""
		if len(ts) > 0 && ts[0].role == RoleSystem {
			system = strings.TrimSpace(ts[0].content)
			ts = ts[1:]
		}
		b.WriteString("<|start_header_id|>system<|end_header_id|>\n\n")
		b.WriteString("Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n")
		b.WriteString(system)
		b.WriteString("<|eot_id|>")
	}
	for _, m := range ts {
		if t.Llama31 && m.role == RoleTool {
			// 3.1 renders tool output with `| tojson` (a Jinja string is
			// iterable), untrimmed: a JSON string literal, non-ASCII kept.
			fmt.Fprintf(b, "<|start_header_id|>ipython<|end_header_id|>\n\n%s<|eot_id|>", jinjaToJSON(m.content))
			continue
		}
		fmt.Fprintf(b, "<|start_header_id|>%s<|end_header_id|>\n\n%s<|eot_id|>", m.role, strings.TrimSpace(m.content))
	}
	if gen {
		b.WriteString("<|start_header_id|>assistant<|end_header_id|>\n\n")
	}
}

// jinjaToJSON encodes a string as Hugging Face's tojson filter does
// (json.dumps with ensure_ascii=False): no HTML escaping.
func jinjaToJSON(s string) string {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.Encode(s) // a string always encodes
	return strings.TrimSuffix(buf.String(), "\n")
}

// alternate checks the user/assistant alternation the [INST] and Gemma
// templates enforce, after their optional leading system message.
func alternate(family Family, ts []turn) error {
	for i, m := range ts {
		if m.role != RoleUser && m.role != RoleAssistant {
			return BadRequest("messages", "the model's %s chat template does not support role %q here", family, m.role)
		}
		if (m.role == RoleUser) != (i%2 == 0) {
			return BadRequest("messages", "the model's %s chat template needs roles to alternate user/assistant/user/... starting with user", family)
		}
	}
	return nil
}

// renderLlama2 follows Meta's Llama 2 chat template: every user turn opens
// with BOS, the system prompt goes inside the first [INST] in <<SYS>> tags,
// contents are trimmed, and an assistant turn ends with EOS. The template
// has no generation prompt: a prompt ending in [/INST] is one already.
func (t Template) renderLlama2(b *strings.Builder, ts []turn) error {
	system, hasSystem := "", false
	if len(ts) > 0 && ts[0].role == RoleSystem {
		system, hasSystem = ts[0].content, true
		ts = ts[1:]
	}
	if err := alternate(FamilyLlama2, ts); err != nil {
		return err
	}
	for i, m := range ts {
		content := m.content
		if i == 0 && hasSystem {
			content = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + content
		}
		if m.role == RoleUser {
			fmt.Fprintf(b, "%s[INST] %s [/INST]", t.BOS, strings.TrimSpace(content))
		} else {
			fmt.Fprintf(b, " %s %s", strings.TrimSpace(content), t.EOS)
		}
	}
	return nil
}

// renderMistral follows Mistral 7B Instruct v0.1/v0.2: one BOS, [INST] user
// [/INST], the assistant's answer then EOS; no system role (the original
// template raises on one).
func (t Template) renderMistral(b *strings.Builder, ts []turn) error {
	if err := alternate(FamilyMistral, ts); err != nil {
		return err
	}
	b.WriteString(t.BOS)
	for _, m := range ts {
		if m.role == RoleUser {
			fmt.Fprintf(b, "[INST] %s [/INST]", m.content)
		} else {
			fmt.Fprintf(b, "%s%s", m.content, t.EOS)
		}
	}
	return nil
}

// renderGemma follows Gemma's template: "assistant" is "model", contents are
// trimmed. Gemma 1/2 refuse a system message; Gemma 3 prepends it (and
// "\n\n") to the first user turn.
func (t Template) renderGemma(b *strings.Builder, ts []turn, gen bool) error {
	prefix := ""
	if len(ts) > 0 && ts[0].role == RoleSystem {
		if !t.SystemInFirstUser {
			return BadRequest("messages", "the model's gemma chat template does not support a system message")
		}
		prefix = ts[0].content + "\n\n"
		ts = ts[1:]
	}
	if err := alternate(FamilyGemma, ts); err != nil {
		return err
	}
	b.WriteString(t.BOS)
	for i, m := range ts {
		role := m.role
		if role == RoleAssistant {
			role = "model"
		}
		b.WriteString("<start_of_turn>" + role + "\n")
		if i == 0 {
			b.WriteString(prefix)
		}
		b.WriteString(strings.TrimSpace(m.content))
		b.WriteString("<end_of_turn>\n")
	}
	if gen {
		b.WriteString("<start_of_turn>model\n")
	}
	return nil
}

// renderPhi3 follows Phi-3's template: <|role|>\ncontent<|end|>\n for
// system, user and assistant; without a generation prompt it ends with EOS.
func (t Template) renderPhi3(b *strings.Builder, ts []turn, gen bool) error {
	for _, m := range ts {
		switch m.role {
		case RoleSystem, RoleUser, RoleAssistant:
			fmt.Fprintf(b, "<|%s|>\n%s<|end|>\n", m.role, m.content)
		default:
			// The original template drops such messages silently; losing
			// input silently is worse than refusing it.
			return BadRequest("messages", "the model's phi3 chat template does not support role %q", m.role)
		}
	}
	if gen {
		b.WriteString("<|assistant|>\n")
	} else {
		b.WriteString(t.EOS)
	}
	return nil
}
