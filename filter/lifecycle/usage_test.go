package lifecycle

import "testing"

func TestUsageScanFindsPromptTokensWhereverThePiecesSplit(t *testing.T) {
	answers := []string{
		`{"choices":[{"message":{"content":"say \"prompt_tokens\": 7"}}],"usage":{"prompt_tokens_details":{"cached_tokens":3},"prompt_tokens":1234,"completion_tokens":5}}`,
		"data: {\"choices\":[]}\n\ndata: {\"usage\": {\"prompt_tokens\" :\n 1234, \"completion_tokens\": 5}}\n\ndata: [DONE]\n\n",
	}
	for _, a := range answers {
		for cut := 0; cut <= len(a); cut++ {
			var u usageScan
			v, ok := u.feed([]byte(a[:cut]))
			if !ok {
				v, ok = u.feed([]byte(a[cut:]))
			}
			if !ok || v != 1234 {
				t.Fatalf("cut at %d of %q: %d %v, want 1234", cut, a, v, ok)
			}
		}
	}
	for _, a := range []string{`{"usage":{"prompt_tokens":12.5}}`, `{"usage":{"prompt_tokens":"12"}}`, `{"usage":{"prompt_tokens":12`} {
		var u usageScan
		if v, ok := u.feed([]byte(a)); ok {
			t.Fatalf("%q read as %d", a, v)
		}
	}
}
