package lifecycle

import "testing"

func TestUsageScanFindsPromptAndCachedTokensWhereverThePiecesSplit(t *testing.T) {
	answers := []struct {
		text           string
		prompt, cached int64
	}{
		{`{"choices":[{"message":{"content":"say \"prompt_tokens\": 7, \"cached_tokens\": 9"}}],"usage":{"prompt_tokens_details":{"cached_tokens":3},"prompt_tokens":1234,"completion_tokens":5}}`, 1234, 3},
		{"data: {\"choices\":[]}\n\ndata: {\"usage\": {\"prompt_tokens\" :\n 1234, \"completion_tokens\": 5, \"prompt_tokens_details\": {\"cached_tokens\": 1024}}}\n\ndata: [DONE]\n\n", 1234, 1024},
		{`{"usage":{"prompt_tokens":1234,"completion_tokens":5,"prompt_tokens_details":null}}`, 1234, -1}, // no cached count
	}
	for _, a := range answers {
		for cut := 0; cut <= len(a.text); cut++ {
			var u usage
			u.feed([]byte(a.text[:cut]))
			u.feed([]byte(a.text[cut:]))
			if !u.prompt.found || u.promptTokens != a.prompt {
				t.Fatalf("cut at %d of %q: prompt %d %v, want %d", cut, a.text, u.promptTokens, u.prompt.found, a.prompt)
			}
			if u.cached.found != (a.cached >= 0) || a.cached >= 0 && u.cachedTokens != a.cached {
				t.Fatalf("cut at %d of %q: cached %d %v, want %d", cut, a.text, u.cachedTokens, u.cached.found, a.cached)
			}
		}
	}
	for _, a := range []string{`{"usage":{"prompt_tokens":12.5}}`, `{"usage":{"prompt_tokens":"12"}}`, `{"usage":{"prompt_tokens":12`} {
		var u usageScan
		if v, ok := u.feed(promptTokensKey, []byte(a)); ok {
			t.Fatalf("%q read as %d", a, v)
		}
	}
	// Once found, a scan reads no other value.
	var u usageScan
	if v, ok := u.feed(promptTokensKey, []byte(`"prompt_tokens": 5,`)); !ok || v != 5 {
		t.Fatalf("read %d %v, want 5", v, ok)
	}
	if v, ok := u.feed(promptTokensKey, []byte(`"prompt_tokens": 6,`)); ok {
		t.Fatalf("a second value read: %d", v)
	}
}
