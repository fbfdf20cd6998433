package ggufgen

import "fmt"

// Token ids of the byte-level vocabulary. The first three follow the
// SentencePiece llama layout (unk, bos, eos at 0, 1, 2; bytes from 3) so
// tools that assume it keep working.
const (
	TokenUnk     = 0
	TokenBOS     = 1 // "<s>"
	TokenEOSText = 2 // "</s>": a control token, not end-of-generation here
	TokenByte0   = 3 // "<0x00>"; byte b is TokenByte0+b
	// TokenSpace is SentencePiece's escaped space "▁" (U+2581). The SPM
	// tokenizer replaces every ' ' with it before lookup; without it in the
	// vocab a space would fall back to the three UTF-8 bytes of "▁" and
	// detokenize as "▁", not " ".
	TokenSpace   = 259
	TokenIMStart = 260 // "<|im_start|>"
	TokenIMEnd   = 261 // "<|im_end|>": the eos token and the end of every ChatML turn
	VocabSize    = 262
)

// llama.cpp's LLAMA_TOKEN_TYPE_* values as stored in tokenizer.ggml.token_type.
const (
	tokenTypeNormal  int32 = 1
	tokenTypeUnknown int32 = 2
	tokenTypeControl int32 = 3
	tokenTypeByte    int32 = 6
)

// ChatMLTemplate is the Jinja chat template stored in tokenizer.chat_template:
// the ChatML template as Hugging Face documents it (Qwen, OpenHermes).
const ChatMLTemplate = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"

// Vocab returns the token texts and llama.cpp token types, indexed by id.
func Vocab() (tokens []string, types []int32) {
	tokens = make([]string, VocabSize)
	types = make([]int32, VocabSize)
	tokens[TokenUnk], types[TokenUnk] = "<unk>", tokenTypeUnknown
	tokens[TokenBOS], types[TokenBOS] = "<s>", tokenTypeControl
	tokens[TokenEOSText], types[TokenEOSText] = "</s>", tokenTypeControl
	for b := range 256 {
		tokens[TokenByte0+b] = fmt.Sprintf("<0x%02X>", b)
		types[TokenByte0+b] = tokenTypeByte
	}
	tokens[TokenSpace], types[TokenSpace] = "\u2581", tokenTypeNormal
	tokens[TokenIMStart], types[TokenIMStart] = "<|im_start|>", tokenTypeControl
	tokens[TokenIMEnd], types[TokenIMEnd] = "<|im_end|>", tokenTypeControl
	return tokens, types
}

// QwenToolsTemplate is Qwen2.5's chat template (Qwen/Qwen2.5-7B-Instruct,
// tokenizer_config.json): ChatML with a default system turn, tool
// definitions in the system turn and calls as <tool_call> blocks. Written
// into the tiny model (Options.ChatTemplate) it lets tests exercise tool
// calling on the byte-level vocabulary.
const QwenToolsTemplate = `{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}`
